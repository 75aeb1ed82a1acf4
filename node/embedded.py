"""The embedded default data set: built once from the Python standard library's source.

A node started with no `--data` needs text that every machine with Python has; the
standard library's own `.py` files are exactly that. The set is published like any
other (tokenizer, shards, signed manifest) with a local publisher key, which the node
then pins: trust on first use, as ARCHITECTURE.md describes for the embedded default.
"""

from __future__ import annotations

import fcntl
import time
from collections.abc import Callable
from pathlib import Path

from nacl.signing import SigningKey

from neuroshard.data import Dataset, load_or_create_signing_key, open_dataset
from neuroshard.data.corpus import read_documents, stdlib_source_files
from neuroshard.data.manifest import MANIFEST_NAME
from neuroshard.data.publish import TOKENIZER_NAME, publish_shards
from neuroshard.tokenizer import BPETokenizer

DEFAULT_VOCAB_SIZE = 4096
TOKENIZER_TRAIN_BYTES = 3_000_000
"""Tokenizer training text: ~3 MB takes ~20 s in the pure-Python trainer and already gives a stable vocab."""
CORPUS_BYTES = 12_000_000
"""All of the stdlib without its tests is ~12.6 MB on CPython 3.11."""
SHARD_TOKENS = 1_000_000
"""Smaller than the publisher's 2.5M default so one machine's corpus still makes several shards to rotate over."""


def ensure_default_dataset(home: Path, log: Callable[[str], None]) -> Dataset:
    """Open `home/data/default`, building it first if it is not there. Safe against concurrent nodes."""
    directory = home / "data" / "default"
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second node waits here until the first has built the set
        key, _ = load_or_create_signing_key(home / "publisher.key")
        if not (directory / MANIFEST_NAME).exists():
            _build(directory, key, log)
    return open_dataset(directory, bytes(key.verify_key))


def _build(directory: Path, key: SigningKey, log: Callable[[str], None]) -> None:
    files = stdlib_source_files()
    log(f"building the default data set in {directory} from {len(files)} standard-library source files")
    start = time.monotonic()
    tokenizer = BPETokenizer.train(read_documents(files, TOKENIZER_TRAIN_BYTES), DEFAULT_VOCAB_SIZE)
    tokenizer.save(directory / TOKENIZER_NAME)
    log(f"  tokenizer: vocab {tokenizer.vocab_size} trained in {time.monotonic() - start:.1f}s")
    manifest = publish_shards(
        read_documents(files, CORPUS_BYTES),
        out=directory,
        key=key,
        shard_tokens=SHARD_TOKENS,
        on_shard=lambda info: log(f"  shard {info.id}: {info.tokens:,} tokens"),
    )
    total = sum(s.tokens for s in manifest.shards)
    log(f"  {manifest.total_shards} shards, {total:,} tokens, done in {time.monotonic() - start:.1f}s")
