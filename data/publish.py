"""Publishing: tokenize documents into fixed-size shards, store them, and write a signed manifest.

Shards are tokenized one after another (so ids are deterministic) and stored in parallel
through a `Store` (a local directory or an S3 bucket). The manifest is written only after
every shard of the run is stored, signature first and manifest.json last, so a reader never
sees a manifest that names a missing shard.

Appending vs resuming: a run starts from the store's signed manifest, if any, and numbers its
new shards from the next id; shards named by that manifest are never written again. A run that
crashed left shard objects that no manifest names; re-running the same input regenerates the
same bytes under the same ids, and those already stored with that sha256 are not uploaded again.
"""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType

import torch
from nacl.signing import SigningKey

from neuroshard.tokenizer import EOS_ID, BPETokenizer

from .files import torch_save
from .manifest import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    Manifest,
    ManifestError,
    ShardInfo,
    TokenizerInfo,
    sign_manifest,
    verify_manifest,
)
from .storage import LocalStore, Store

TOKENIZER_NAME = "tokenizer.json"
"""The publisher's working copy, written by neuroshard-publish-tokenizer."""
TOKENIZERS_DIR = "tokenizers"
"""Published tokenizers, content-addressed: tokenizers/<sha256>.json."""
DEFAULT_SHARD_TOKENS = 2_500_000
DEFAULT_WORKERS = 8
"""Parallel shard uploads. Uploads to S3 wait on round trips, not CPU, so more than the 2 cores help."""
_ENCODE_GROUP = 64
"""Documents encoded per engine call: large enough for the engine's threads, small enough for memory."""


@dataclass(frozen=True, kw_only=True)
class PublishProgress:
    """How far a run is, reported after each stored shard and once tokenizing is done."""

    shards_done: int
    """New shards stored by this run, uploaded or found already there."""
    shards_total: int | None
    """New shards this run makes; None until all text is tokenized."""
    shards_skipped: int
    """Shards found in the store with the same sha256 (left by a crashed run) and not uploaded again."""
    bytes_uploaded: int
    text_chars_read: int
    """Characters of input consumed so far, for an ETA before shards_total is known."""
    seconds: float
    """Since the run started."""

    @property
    def mb_per_s(self) -> float:
        return self.bytes_uploaded / 1e6 / self.seconds if self.seconds > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        """Seconds left at the rate so far, once shards_total is known."""
        if self.shards_total is None or self.shards_done == 0:
            return None
        return self.seconds * (self.shards_total - self.shards_done) / self.shards_done


def shard_bytes(tokens: list[int]) -> bytes:
    """The shard file: torch.save of a flat int32 tensor, byte-identical for identical tokens.

    Saved through a memory buffer, not a path: torch.save names the zip's top folder after the
    file, and atomic_write's temp names are random, so the same tokens gave different bytes
    (and resuming could never match). Through a buffer the folder is always "archive";
    tests/data/test_publish.py checks the bytes are the same across processes.
    """
    buffer = io.BytesIO()
    torch_save(torch.tensor(tokens, dtype=torch.int32), buffer, crc32=True)
    return buffer.getvalue()


def publish_shards(
    documents: Iterable[str],
    *,
    out: Store | Path,
    key: SigningKey,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int = DEFAULT_WORKERS,
    on_shard: Callable[[ShardInfo], None] | None = None,
    on_progress: Callable[[PublishProgress], None] | None = None,
) -> Manifest:
    """Tokenize `documents` with the store's tokenizer.json into new shards; sign a new manifest.

    Publishing appends: if `out` already holds a manifest, the new shards get the next ids and
    the manifest's version goes up by one. If tokenizer.json was extended since the last
    publish, it joins the tokenizer lineage (it must keep every earlier merge). The last,
    partial shard is kept when it holds at least a tenth of `shard_tokens` (smaller tails are
    too short to batch from).

    Shards are uploaded on `workers` threads while tokenizing goes on; a re-run after a crash
    skips shards already stored with the same sha256 (see the module docstring). `on_shard`
    and `on_progress` run on the calling thread, as each shard is stored (not in id order).
    """
    if shard_tokens < 1024:
        raise ValueError(f"shard_tokens={shard_tokens} is too small (minimum 1024)")
    if workers < 1:
        raise ValueError(f"workers={workers} must be at least 1")
    store = LocalStore(out) if isinstance(out, Path) else out
    tokenizer = _working_tokenizer(store)
    previous = _read_own_manifest(store, key)
    lineage = _extend_lineage(store, previous, tokenizer)
    first_id = previous.total_shards if previous else 0

    with _ShardWriter(store, workers, tokenizer.sha256, on_shard, on_progress) as writer:
        buffer: list[int] = []
        next_id = first_id
        for ids, chars in _token_chunks(tokenizer, documents):
            writer.text_chars_read += chars
            buffer.extend(ids)
            buffer.append(EOS_ID)  # marks where one document ends and the next begins
            while len(buffer) >= shard_tokens:
                writer.submit(next_id, buffer[:shard_tokens])
                del buffer[:shard_tokens]
                next_id += 1
        if len(buffer) >= shard_tokens // 10 or (next_id == first_id and buffer):
            writer.submit(next_id, buffer)
            next_id += 1
        if next_id == first_id:
            raise ValueError("no text to publish: every input was empty or unreadable")
        new_shards = writer.finish(total=next_id - first_id)

    manifest = Manifest(
        version=previous.version + 1 if previous else 1,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        publisher=bytes(key.verify_key).hex(),
        tokenizers=lineage,
        shards=(*(previous.shards if previous else ()), *new_shards),
    )
    # Signatures first (the new manifest's and the one in force), manifest last: whatever a
    # reader sees — before, between or after the two writes, or after a publish that died
    # between them — a line of manifest.json.sig verifies it, and no manifest ever names a
    # shard that is not stored.
    in_force = store.get_bytes(MANIFEST_NAME) if previous else None
    signatures = sign_manifest(manifest, key) + b"\n"
    if in_force is not None:
        signatures += key.sign(in_force).signature.hex().encode("ascii") + b"\n"
    store.put_bytes(SIGNATURE_NAME, signatures)
    store.put_bytes(MANIFEST_NAME, manifest.to_bytes())
    return manifest


def _token_chunks(tokenizer: BPETokenizer, documents: Iterable[str]) -> Iterable[tuple[list[int], int]]:
    """(token ids, characters) per document, in order."""
    group: list[str] = []
    for doc in documents:
        group.append(doc)
        if len(group) == _ENCODE_GROUP:
            yield from zip(tokenizer.encode_batch(group), map(len, group), strict=True)
            group = []
    if group:
        yield from zip(tokenizer.encode_batch(group), map(len, group), strict=True)


def _working_tokenizer(store: Store) -> BPETokenizer:
    raw = store.get_bytes(TOKENIZER_NAME)
    if raw is None:
        raise FileNotFoundError(
            f"{store.describe(TOKENIZER_NAME)} is missing: "
            f"run neuroshard-publish-tokenizer --out {store.describe()} first"
        )
    return BPETokenizer.from_bytes(raw, source=store.describe(TOKENIZER_NAME))


def _read_own_manifest(store: Store, key: SigningKey) -> Manifest | None:
    raw = store.get_bytes(MANIFEST_NAME)
    if raw is None:
        return None  # a signature without a manifest is a first publish that stopped in between
    signature = store.get_bytes(SIGNATURE_NAME)
    if signature is None:
        raise ManifestError(f"{store.describe(MANIFEST_NAME)} exists but {SIGNATURE_NAME} is missing")
    return verify_manifest(raw, signature, bytes(key.verify_key), store.describe(MANIFEST_NAME))


def _extend_lineage(
    store: Store, previous: Manifest | None, tokenizer: BPETokenizer
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
        old_name = previous.tokenizer.file
        raw = store.get_bytes(old_name)
        if raw is None:
            raise ManifestError(f"{store.describe(old_name)} is missing (the manifest names it)")
        old = BPETokenizer.from_bytes(raw, source=store.describe(old_name))
        if tokenizer.merges[: len(old.merges)] != old.merges:
            raise ValueError(
                f"{store.describe(TOKENIZER_NAME)} does not extend the published tokenizer {old.sha256[:16]}…: "
                "earlier merges changed (tokenizers may only grow with neuroshard-publish-tokenizer --extend)"
            )
    if store.sha256_of(info.file) != info.sha256:
        store.put_bytes(info.file, tokenizer.to_bytes(), immutable=True)
    return (*previous.tokenizers, info) if previous else (info,)


def store_shard(store: Store, name: str, data: bytes) -> tuple[str, int]:
    """(sha256, bytes uploaded): uploads nothing when the store already holds these exact bytes.

    A name may get other bytes only while no manifest names it (an orphan of a crashed run,
    re-run with other text); readers take names from the manifest, so no reader or CDN has
    fetched it yet and the immutable cache header still holds for every shard they see.
    """
    sha256 = hashlib.sha256(data).hexdigest()
    if store.sha256_of(name) == sha256:
        return sha256, 0
    store.put_bytes(name, data, immutable=True)
    return sha256, len(data)


class _ShardWriter:
    """Stores shards on a thread pool with a bounded number in flight; reports on the caller's thread.

    Each shard waiting or uploading holds its bytes (4 bytes per token), so the bound of two per
    worker caps memory at 2 * workers shards while keeping every worker busy.
    """

    def __init__(
        self,
        store: Store,
        workers: int,
        tokenizer_sha256: str,
        on_shard: Callable[[ShardInfo], None] | None,
        on_progress: Callable[[PublishProgress], None] | None,
    ) -> None:
        self._store = store
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="publish")
        self._max_in_flight = 2 * workers
        self._in_flight: dict[Future[tuple[str, int]], tuple[int, int]] = {}  # -> (shard id, tokens)
        self._tokenizer_sha256 = tokenizer_sha256
        self._on_shard = on_shard
        self._on_progress = on_progress
        self._stored: dict[int, ShardInfo] = {}
        self._start = time.monotonic()
        self._total: int | None = None
        self._skipped = 0
        self._bytes_uploaded = 0
        self.text_chars_read = 0

    def __enter__(self) -> _ShardWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # On an error, uploads not yet started are dropped and running ones finish before we return.
        self._pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, shard_id: int, tokens: list[int]) -> None:
        while len(self._in_flight) >= self._max_in_flight:
            self._collect()
        data = shard_bytes(tokens)
        future = self._pool.submit(store_shard, self._store, f"shard_{shard_id}.pt", data)
        self._in_flight[future] = (shard_id, len(tokens))

    def finish(self, total: int) -> list[ShardInfo]:
        """Wait for every upload; the new shards in id order. Raises the first upload error."""
        self._total = total
        self._report()
        while self._in_flight:
            self._collect()
        return [self._stored[i] for i in sorted(self._stored)]

    def _collect(self) -> None:
        """Take in the uploads that finished (at least one); re-raise the first that failed."""
        done, _ = wait(self._in_flight, return_when=FIRST_COMPLETED)
        for future in done:
            shard_id, tokens = self._in_flight.pop(future)
            sha256, uploaded = future.result()
            info = ShardInfo(
                id=shard_id,
                file=f"shard_{shard_id}.pt",
                sha256=sha256,
                tokens=tokens,
                tokenizer_sha256=self._tokenizer_sha256,
            )
            self._stored[shard_id] = info
            self._bytes_uploaded += uploaded
            self._skipped += uploaded == 0
            if self._on_shard is not None:
                self._on_shard(info)
            self._report()

    def _report(self) -> None:
        if self._on_progress is None:
            return
        self._on_progress(
            PublishProgress(
                shards_done=len(self._stored),
                shards_total=self._total,
                shards_skipped=self._skipped,
                bytes_uploaded=self._bytes_uploaded,
                text_chars_read=self.text_chars_read,
                seconds=time.monotonic() - self._start,
            )
        )
