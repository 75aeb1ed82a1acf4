"""Publishing: tokenize documents into fixed-size shards and write a signed manifest.

Every file is written atomically (temp file, fsync, rename) and the manifest last, so a
reader never sees a manifest that names a shard that is not fully on disk. Shards and
published tokenizers are immutable once written; only manifest.json(.sig) changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path

import torch
from nacl.signing import SigningKey

from neuroshard.tokenizer import EOS_ID, BPETokenizer

from .files import atomic_write, file_sha256
from .manifest import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    Manifest,
    ShardInfo,
    TokenizerInfo,
    read_manifest,
    sign_manifest,
)

TOKENIZER_NAME = "tokenizer.json"
"""The publisher's working copy, written by neuroshard-publish-tokenizer."""
TOKENIZERS_DIR = "tokenizers"
"""Published tokenizers, content-addressed: tokenizers/<sha256>.json."""
DEFAULT_SHARD_TOKENS = 2_500_000
_ENCODE_GROUP = 64
"""Documents encoded per engine call: large enough for the engine's threads, small enough for memory."""


def _token_chunks(tokenizer: BPETokenizer, documents: Iterable[str]) -> Iterable[list[int]]:
    group: list[str] = []
    for doc in documents:
        group.append(doc)
        if len(group) == _ENCODE_GROUP:
            yield from tokenizer.encode_batch(group)
            group = []
    if group:
        yield from tokenizer.encode_batch(group)


def publish_shards(
    documents: Iterable[str],
    *,
    out: Path,
    key: SigningKey,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    on_shard: Callable[[ShardInfo], None] | None = None,
) -> Manifest:
    """Tokenize `documents` with `out/tokenizer.json` into new shards in `out`; sign a new manifest.

    Publishing appends: if `out` already holds a manifest, the new shards get the next ids
    and the manifest's version goes up by one; existing shards are never touched. If
    tokenizer.json was extended since the last publish, it joins the tokenizer lineage
    (it must keep every earlier merge). The last, partial shard is kept when it holds at
    least a tenth of `shard_tokens` (smaller tails are too short to batch from).
    """
    if shard_tokens < 1024:
        raise ValueError(f"shard_tokens={shard_tokens} is too small (minimum 1024)")
    tokenizer_path = out / TOKENIZER_NAME
    if not tokenizer_path.is_file():
        raise FileNotFoundError(
            f"{tokenizer_path} is missing: run neuroshard-publish-tokenizer --out {out} first"
        )
    tokenizer = BPETokenizer.load(tokenizer_path)
    previous = _read_own_manifest(out, key)
    lineage = _extend_lineage(out, previous, tokenizer)

    shards: list[ShardInfo] = list(previous.shards) if previous else []
    first_new = len(shards)
    buffer: list[int] = []

    def flush(tokens: list[int]) -> None:
        info = _write_shard(out, len(shards), tokens, tokenizer.sha256)
        shards.append(info)
        if on_shard is not None:
            on_shard(info)

    for ids in _token_chunks(tokenizer, documents):
        buffer.extend(ids)
        buffer.append(EOS_ID)  # marks where one document ends and the next begins
        while len(buffer) >= shard_tokens:
            flush(buffer[:shard_tokens])
            del buffer[:shard_tokens]
    if len(buffer) >= shard_tokens // 10 or (len(shards) == first_new and buffer):
        flush(buffer)
    if len(shards) == first_new:
        raise ValueError("no text to publish: every input was empty or unreadable")

    manifest = Manifest(
        version=previous.version + 1 if previous else 1,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        publisher=bytes(key.verify_key).hex(),
        tokenizers=lineage,
        shards=tuple(shards),
    )
    # Signature first, manifest last: a reader that catches the moment between the two sees
    # a signature that does not match, refuses, and tries again later; it never sees a
    # manifest naming a shard that is not there.
    atomic_write(out / SIGNATURE_NAME, lambda p: p.write_bytes(sign_manifest(manifest, key) + b"\n"))
    atomic_write(out / MANIFEST_NAME, lambda p: p.write_bytes(manifest.to_bytes()))
    return manifest


def _read_own_manifest(out: Path, key: SigningKey) -> Manifest | None:
    if not (out / MANIFEST_NAME).exists():
        return None
    return read_manifest(out, bytes(key.verify_key))


def _extend_lineage(
    out: Path, previous: Manifest | None, tokenizer: BPETokenizer
) -> tuple[TokenizerInfo, ...]:
    """The tokenizer lineage for the new manifest; stores the tokenizer under its content address."""
    info = TokenizerInfo(
        file=f"{TOKENIZERS_DIR}/{tokenizer.sha256}.json",
        sha256=tokenizer.sha256,
        next_merge_id=tokenizer.next_merge_id,
    )
    if previous is not None and previous.tokenizer.sha256 == tokenizer.sha256:
        return previous.tokenizers
    if previous is not None:
        old = BPETokenizer.load(out / previous.tokenizer.file)
        if tokenizer.merges[: len(old.merges)] != old.merges:
            raise ValueError(
                f"{out / TOKENIZER_NAME} does not extend the published tokenizer {old.sha256[:16]}…: "
                "earlier merges changed (tokenizers may only grow with neuroshard-publish-tokenizer --extend)"
            )
    (out / TOKENIZERS_DIR).mkdir(exist_ok=True)
    tokenizer.save(out / info.file)
    return (*previous.tokenizers, info) if previous else (info,)


def _write_shard(out: Path, shard_id: int, tokens: list[int], tokenizer_sha256: str) -> ShardInfo:
    name = f"shard_{shard_id}.pt"
    tensor = torch.tensor(tokens, dtype=torch.int32)
    atomic_write(out / name, lambda p: torch.save(tensor, p))
    return ShardInfo(
        id=shard_id,
        file=name,
        sha256=file_sha256(out / name),
        tokens=len(tokens),
        tokenizer_sha256=tokenizer_sha256,
    )
