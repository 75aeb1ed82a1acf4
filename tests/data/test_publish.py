"""Publishing appends: new shards, a higher manifest version, a tokenizer lineage that only grows."""

import shutil
from pathlib import Path

import pytest
from tests_support import small_corpus

from neuroshard.data import open_dataset, read_manifest
from neuroshard.data.files import file_sha256
from neuroshard.data.publish import TOKENIZER_NAME, publish_shards
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
