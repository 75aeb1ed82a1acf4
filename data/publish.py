"""Publishing: tokenize documents into fixed-size shards and write a signed manifest.

Every file is written atomically (temp file, fsync, rename) and the manifest last, so a
reader never sees a manifest that names a shard that is not fully on disk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path

import torch
from nacl.signing import SigningKey

from neuroshard.tokenizer import EOS_ID, BPETokenizer

from .files import atomic_write, file_sha256
from .manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest, ShardInfo, TokenizerInfo, sign_manifest

TOKENIZER_NAME = "tokenizer.json"
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
    """Tokenize `documents` with `out/tokenizer.json` into shards in `out`, then sign the manifest.

    The last, partial shard is kept when it holds at least a tenth of `shard_tokens`
    (smaller tails would be too short to batch from) and dropped otherwise.
    """
    if shard_tokens < 1024:
        raise ValueError(f"shard_tokens={shard_tokens} is too small (minimum 1024)")
    if (out / MANIFEST_NAME).exists():
        raise FileExistsError(
            f"{out} already holds a published data set ({MANIFEST_NAME}); appending is not supported"
        )
    tokenizer_path = out / TOKENIZER_NAME
    if not tokenizer_path.is_file():
        raise FileNotFoundError(
            f"{tokenizer_path} is missing: run neuroshard-publish-tokenizer --out {out} first"
        )
    tokenizer = BPETokenizer.load(tokenizer_path)

    shards: list[ShardInfo] = []
    buffer: list[int] = []

    def flush(tokens: list[int]) -> None:
        info = _write_shard(out, len(shards), tokens)
        shards.append(info)
        if on_shard is not None:
            on_shard(info)

    for ids in _token_chunks(tokenizer, documents):
        buffer.extend(ids)
        buffer.append(EOS_ID)  # marks where one document ends and the next begins
        while len(buffer) >= shard_tokens:
            flush(buffer[:shard_tokens])
            del buffer[:shard_tokens]
    if len(buffer) >= shard_tokens // 10 or (not shards and buffer):
        flush(buffer)
    if not shards:
        raise ValueError("no text to publish: every input was empty or unreadable")

    manifest = Manifest(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        publisher=bytes(key.verify_key).hex(),
        tokenizer=TokenizerInfo(
            file=TOKENIZER_NAME, sha256=file_sha256(tokenizer_path), next_merge_id=tokenizer.next_merge_id
        ),
        shards=tuple(shards),
    )
    atomic_write(out / SIGNATURE_NAME, lambda p: p.write_bytes(sign_manifest(manifest, key) + b"\n"))
    atomic_write(out / MANIFEST_NAME, lambda p: p.write_bytes(manifest.to_bytes()))
    return manifest


def _write_shard(out: Path, shard_id: int, tokens: list[int]) -> ShardInfo:
    name = f"shard_{shard_id}.pt"
    tensor = torch.tensor(tokens, dtype=torch.int32)
    atomic_write(out / name, lambda p: torch.save(tensor, p))
    return ShardInfo(id=shard_id, file=name, sha256=file_sha256(out / name), tokens=len(tokens))
