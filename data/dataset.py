"""A verified local data set: signed manifest + the exact tokenizer it names + its shards."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from neuroshard.tokenizer import BPETokenizer

from .fetch import FetchConfig, HttpShardSource, fetch_manifest
from .files import file_sha256
from .manifest import Manifest, ManifestError, read_manifest, resolve_inside
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
    tok_path = resolve_inside(directory, manifest.tokenizer.file, "tokenizer file")
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


def open_remote_dataset(
    base_url: str, publisher_key: bytes, cache_dir: Path, *, config: FetchConfig, log: Callable[[str], None]
) -> Dataset:
    """A data set served over HTTP (a CDN, a public bucket): verified manifest, tokenizer, cached shards.

    The source watches for newer manifests in the background; poll them with `remote_updates`.
    """
    manifest = fetch_manifest(base_url, publisher_key, config=config, log=log)
    source = HttpShardSource(base_url, cache_dir, manifest.tokenizer.next_merge_id, config=config, log=log)
    try:
        tokenizer = _remote_tokenizer(source, manifest)
    except BaseException:
        source.close()
        raise
    source.watch_manifest(manifest)
    return Dataset(location=base_url, manifest=manifest, tokenizer=tokenizer, source=source)


def _remote_tokenizer(source: HttpShardSource, manifest: Manifest) -> BPETokenizer:
    tokenizer = BPETokenizer.load(source.fetch_tokenizer(manifest.tokenizer))
    if tokenizer.next_merge_id != manifest.tokenizer.next_merge_id:
        raise ManifestError(
            f"tokenizer {manifest.tokenizer.sha256[:16]}… has next_merge_id {tokenizer.next_merge_id}, "
            f"manifest says {manifest.tokenizer.next_merge_id}"
        )
    return tokenizer


def remote_updates(dataset: Dataset, log: Callable[[str], None]) -> Callable[[], Dataset | None]:
    """For the trainer: at each round boundary, a Dataset for the newest accepted manifest, or None.

    A manifest whose tokenizer cannot be fetched and verified yet is logged and tried again
    at the next poll (the watcher hands each version over only once); the one in force
    stays meanwhile.
    """
    source = dataset.source
    if not isinstance(source, HttpShardSource):
        raise TypeError("remote_updates needs a data set opened with open_remote_dataset")

    pending: list[Manifest] = []  # a newer manifest whose tokenizer could not be fetched yet

    def poll() -> Dataset | None:
        manifest = source.newer_manifest() or (pending.pop() if pending else None)
        if manifest is None:
            return None
        try:
            tokenizer = _remote_tokenizer(source, manifest)
        except (ManifestError, ValueError) as exc:
            log(f"manifest version {manifest.version} not taken yet: {exc}; trying again next round")
            pending.append(manifest)
            return None
        source.vocab_size = tokenizer.vocab_size
        return Dataset(location=dataset.location, manifest=manifest, tokenizer=tokenizer, source=source)

    return poll
