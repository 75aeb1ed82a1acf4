"""Publishing appends: new shards, a higher manifest version, a tokenizer lineage that only grows."""

import hashlib
import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests_support import small_corpus

from neuroshard.data import open_dataset, read_manifest
from neuroshard.data.files import file_sha256
from neuroshard.data.manifest import MANIFEST_NAME
from neuroshard.data.publish import TOKENIZER_NAME, PublishProgress, publish_shards, shard_bytes
from neuroshard.data.storage import LocalStore
from neuroshard.tokenizer import BPETokenizer


@pytest.fixture
def copy(published, tmp_path: Path) -> Path:
    target = tmp_path / "ds"
    shutil.copytree(published.directory, target)
    return target


def test_first_publish_is_version_1_with_content_addressed_tokenizer(published) -> None:
    m = published.dataset.manifest
    assert m.version == 1 and len(m.tokenizers) == 1
    assert m.tokenizer.file == f"tokenizers/{m.tokenizer.sha256}.json"
    assert file_sha256(published.directory / m.tokenizer.file) == m.tokenizer.sha256
    assert all(s.tokenizer_sha256 == m.tokenizer.sha256 for s in m.shards)


def test_append_adds_shards_and_keeps_old_ones_byte_identical(copy: Path, published) -> None:
    before = read_manifest(copy, bytes(published.key.verify_key))
    hashes = {p.name: file_sha256(p) for p in copy.glob("shard_*.pt")}
    after = publish_shards(small_corpus(60_000), out=copy, key=published.key, shard_tokens=5_000)
    assert after.version == before.version + 1
    assert after.shards[: before.total_shards] == before.shards
    assert [s.id for s in after.shards] == list(
        range(after.total_shards)
    ) and after.total_shards > before.total_shards
    assert all(file_sha256(copy / name) == h for name, h in hashes.items())
    assert read_manifest(copy, bytes(published.key.verify_key)) == after


def test_extended_tokenizer_joins_the_lineage(copy: Path, published) -> None:
    old = BPETokenizer.load(copy / TOKENIZER_NAME)
    old.extend(small_corpus(50_000), 40).save(copy / TOKENIZER_NAME)
    after = publish_shards(small_corpus(60_000), out=copy, key=published.key, shard_tokens=5_000)
    assert [t.next_merge_id for t in after.tokenizers] == [512, 552]
    new_shards = after.shards[published.dataset.manifest.total_shards :]
    assert {s.tokenizer_sha256 for s in new_shards} == {after.tokenizer.sha256}
    assert all(after.made_with_lineage(s) for s in after.shards)
    assert open_dataset(copy, bytes(published.key.verify_key)).tokenizer.vocab_size == 552


def test_a_tokenizer_that_rewrites_old_merges_is_refused(copy: Path, published) -> None:
    BPETokenizer.train(small_corpus(30_000)[3:], 600).save(copy / TOKENIZER_NAME)
    with pytest.raises(ValueError, match="does not extend the published tokenizer"):
        publish_shards(small_corpus(60_000), out=copy, key=published.key, shard_tokens=5_000)


def test_shard_bytes_are_identical_across_processes() -> None:
    """Resuming relies on it: a re-run must produce the very bytes a crashed run stored."""
    tokens = list(range(0, 70_000, 7))
    program = (
        "import hashlib; from neuroshard.data.publish import shard_bytes; "
        "print(hashlib.sha256(shard_bytes(list(range(0, 70_000, 7)))).hexdigest())"
    )
    other = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True, timeout=120
    )
    data = shard_bytes(tokens)
    assert other.stdout.strip() == hashlib.sha256(data).hexdigest()
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert loaded.dtype == torch.int32 and loaded.tolist() == tokens


class FailingStore(LocalStore):
    """A directory whose write of one object fails, as a full disk would."""

    def __init__(self, directory: Path, fail_on: str) -> None:
        super().__init__(directory)
        self.fail_on = fail_on

    def put_bytes(self, name: str, data: bytes, *, immutable: bool = False) -> None:
        if name == self.fail_on:
            raise OSError(28, "No space left on device (injected)", name)
        super().put_bytes(name, data, immutable=immutable)


def test_a_crashed_local_publish_resumes_without_rewriting_stored_shards(published, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    out.mkdir()
    shutil.copy(published.directory / TOKENIZER_NAME, out / TOKENIZER_NAME)
    docs = small_corpus(60_000)
    with pytest.raises(OSError, match="injected"):
        publish_shards(
            docs, out=FailingStore(out, "shard_3.pt"), key=published.key, shard_tokens=5_000, workers=2
        )
    assert not (out / "manifest.json").exists()
    inodes = {p.name: p.stat().st_ino for p in out.glob("shard_*.pt")}
    assert "shard_0.pt" in inodes and "shard_3.pt" not in inodes

    progress: list[PublishProgress] = []
    manifest = publish_shards(
        docs, out=out, key=published.key, shard_tokens=5_000, on_progress=progress.append
    )
    assert all((out / name).stat().st_ino == ino for name, ino in inodes.items())
    assert progress[-1].shards_skipped == len(inodes)
    assert progress[-1].shards_done == progress[-1].shards_total == manifest.total_shards > len(inodes)
    assert open_dataset(out, bytes(published.key.verify_key)).manifest == manifest


def test_a_publish_that_dies_between_signature_and_manifest_leaves_a_readable_data_set(
    copy: Path, published
) -> None:
    class DiesOnManifest(LocalStore):
        def put_bytes(self, name: str, data: bytes, *, immutable: bool = False) -> None:
            if name == MANIFEST_NAME:
                raise OSError("connection reset while writing the manifest")
            super().put_bytes(name, data, immutable=immutable)

    before = read_manifest(copy, bytes(published.key.verify_key))
    with pytest.raises(OSError, match="connection reset"):
        publish_shards(small_corpus(60_000), out=DiesOnManifest(copy), key=published.key, shard_tokens=5_000)
    assert read_manifest(copy, bytes(published.key.verify_key)) == before  # nodes still start
    after = publish_shards(small_corpus(60_000), out=copy, key=published.key, shard_tokens=5_000)
    assert after.version == before.version + 1
    assert read_manifest(copy, bytes(published.key.verify_key)) == after
