"""A verified local data set: signed manifest + the exact tokenizer it names + its shards."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from neuroshard.tokenizer import BPETokenizer

from .files import file_sha256
from .manifest import Manifest, ManifestError, read_manifest
from .shards import LocalShardSource, ShardSource


@dataclass(frozen=True)
class Dataset:
    """A verified manifest, the exact tokenizer it names, and where its shards come from."""

    location: str
    """Where the data set lives (a directory or a base URL), for messages."""
    manifest: Manifest
    tokenizer: BPETokenizer
    source: ShardSource


def open_dataset(directory: Path, publisher_key: bytes) -> Dataset:
    """Verify the manifest signature, then the tokenizer's sha256, and return the data set.

    Shards are verified one by one when they are loaded (`load_shard`), not here, so a
    node with a large data set starts without hashing gigabytes it may never read.
    """
    manifest = read_manifest(directory, publisher_key)
    tok_path = directory / manifest.tokenizer.file
    if not tok_path.is_file():
        raise ManifestError(f"{tok_path} is missing (the manifest names it)")
    actual = file_sha256(tok_path)
    if actual != manifest.tokenizer.sha256:
        raise ManifestError(
            f"{tok_path}: sha256 {actual[:16]}… is not the manifest's {manifest.tokenizer.sha256[:16]}…; "
            "the shards were made with a different tokenizer"
        )
    tokenizer = BPETokenizer.load(tok_path)
    if tokenizer.next_merge_id != manifest.tokenizer.next_merge_id:
        raise ManifestError(
            f"{tok_path}: next_merge_id {tokenizer.next_merge_id}, manifest says {manifest.tokenizer.next_merge_id}"
        )
    return Dataset(
        location=str(directory),
        manifest=manifest,
        tokenizer=tokenizer,
        source=LocalShardSource(directory, tokenizer.vocab_size),
    )
