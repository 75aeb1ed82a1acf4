"""Shards load only after their sha256 matches; batches are (inputs, labels shifted by one)."""

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from neuroshard.data import BatchStream, DataPosition, ShardError, load_shard
from neuroshard.data.files import file_sha256
from neuroshard.data.shards import window_order


def test_shard_loads_as_flat_int32_of_the_declared_length(published) -> None:
    ds = published.dataset
    info = ds.manifest.shards[0]
    tokens = load_shard(published.directory, info, ds.tokenizer.vocab_size)
    assert tokens.dtype == torch.int32 and tokens.dim() == 1 and tokens.numel() == info.tokens == 20_000
    assert int(tokens.max()) < ds.tokenizer.vocab_size


def test_corrupted_shard_is_rejected_before_loading(published, tmp_path: Path) -> None:
    ds = published.dataset
    info = ds.manifest.shards[1]
    shutil.copy(published.directory / info.file, tmp_path / info.file)
    raw = bytearray((tmp_path / info.file).read_bytes())
    raw[-10] ^= 0xFF
    (tmp_path / info.file).write_bytes(bytes(raw))
    with pytest.raises(ShardError, match="does not match the manifest"):
        load_shard(tmp_path, info, ds.tokenizer.vocab_size)


def test_pickle_payload_with_matching_hash_is_still_not_executed(published, tmp_path: Path) -> None:
    """Even a file whose hash a compromised manifest vouches for is loaded with weights_only=True."""

    class Boom:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (Path("/nonexistent-neuroshard-marker").touch, ())

    path = tmp_path / "shard_0.pt"
    torch.save(Boom(), path)
    info = replace(published.dataset.manifest.shards[0], sha256=file_sha256(path))
    with pytest.raises(ShardError, match="is not a tensor file"):
        load_shard(tmp_path, info, 512)
    assert not Path("/nonexistent-neuroshard-marker").exists()


def test_wrong_dtype_or_length_is_rejected(tmp_path: Path, published) -> None:
    base = published.dataset.manifest.shards[0]
    path = tmp_path / base.file
    torch.save(torch.zeros(base.tokens, dtype=torch.int64), path)
    with pytest.raises(ShardError, match="flat int32"):
        load_shard(tmp_path, replace(base, sha256=file_sha256(path)), 512)
    torch.save(torch.zeros(10, dtype=torch.int32), path)
    with pytest.raises(ShardError, match="10 tokens, the manifest says"):
        load_shard(tmp_path, replace(base, sha256=file_sha256(path)), 512)
    torch.save(torch.full((base.tokens,), 600, dtype=torch.int32), path)
    with pytest.raises(ShardError, match="outside"):
        load_shard(tmp_path, replace(base, sha256=file_sha256(path)), 512)


def _stream(published, position: DataPosition | None = None, seed: str = "node-a") -> BatchStream:
    ds = published.dataset
    return BatchStream(
        source=ds.source,
        manifest=ds.manifest,
        order=[2, 0, 1],
        seed=seed,
        batch_size=4,
        seq_len=32,
        position=position,
    )


def test_labels_are_inputs_shifted_by_one_from_the_permuted_windows(published) -> None:
    inputs, labels = _stream(published).next_batch()
    assert inputs.shape == labels.shape == (4, 32) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    tokens = load_shard(published.directory, published.dataset.manifest.shards[2], 512).long()
    windows = window_order("node-a", 2, (20_000 - 1) // 32)
    assert sorted(windows.tolist()) == list(range((20_000 - 1) // 32))
    for row, w in enumerate(windows[:4].tolist()):
        assert torch.equal(inputs[row], tokens[w * 32 : w * 32 + 32])
        assert torch.equal(labels[row], tokens[w * 32 + 1 : w * 32 + 33])


def test_window_order_is_seeded_by_node_and_shard() -> None:
    assert torch.equal(window_order("a", 1, 100), window_order("a", 1, 100))
    assert not torch.equal(window_order("a", 1, 100), window_order("b", 1, 100))
    assert not torch.equal(window_order("a", 1, 100), window_order("a", 2, 100))


def test_stream_moves_to_the_next_shard_in_order_and_resumes_from_a_position(published) -> None:
    stream = _stream(published)
    per_shard = ((20_000 - 1) // 32) // 4
    for _ in range(per_shard):
        stream.next_batch()
    assert stream.shard_id == 2
    stream.next_batch()
    assert stream.shard_id == 0 and stream.position == DataPosition(order_index=1, offset=4)
    expected = stream.next_batch()
    resumed = _stream(published, DataPosition(order_index=1, offset=4))
    assert all(torch.equal(a, b) for a, b in zip(resumed.next_batch(), expected, strict=True))


def test_batch_larger_than_a_shard_is_refused(published) -> None:
    ds = published.dataset
    with pytest.raises(ValueError, match="largest shard has"):
        BatchStream(source=ds.source, manifest=ds.manifest, order=[0], seed="x", batch_size=1000, seq_len=64)


class _FailingSource:
    """Serves shards from a directory except the ones listed, which are 'unavailable'."""

    def __init__(self, inner, broken: set[int]) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.broken, self.fetched = inner, broken, []

    def fetch(self, info):  # type: ignore[no-untyped-def]
        self.fetched.append(info.id)
        if info.id in self.broken:
            raise ShardError(f"shard {info.id}: unavailable after 5 attempts")
        return self.inner.fetch(info)

    def prefetch(self, infos) -> None:  # type: ignore[no-untyped-def]
        pass


def test_unavailable_shard_is_skipped_and_reported(published) -> None:
    ds = published.dataset
    skipped: list[tuple[int, str]] = []
    source = _FailingSource(ds.source, broken={2})
    stream = BatchStream(
        source=source, manifest=ds.manifest, order=[2, 0, 1], seed="s", batch_size=4, seq_len=32,
        on_skip=lambda shard_id, reason: skipped.append((shard_id, reason)),
    )  # fmt: skip
    stream.next_batch()
    assert stream.shard_id == 0 and skipped == [(2, "shard 2: unavailable after 5 attempts")]


def test_shard_from_a_foreign_tokenizer_is_refused_without_loading(published) -> None:
    ds = published.dataset
    foreign = replace(ds.manifest.shards[2], tokenizer_sha256="f" * 64)
    manifest = replace(ds.manifest, shards=(*ds.manifest.shards[:2], foreign, *ds.manifest.shards[3:]))
    skipped: list[int] = []
    source = _FailingSource(ds.source, broken=set())
    stream = BatchStream(
        source=source, manifest=manifest, order=[2, 0, 1], seed="s", batch_size=4, seq_len=32,
        on_skip=lambda shard_id, reason: skipped.append(shard_id),
    )  # fmt: skip
    stream.next_batch()
    assert skipped == [2] and source.fetched == [0] and stream.shard_id == 0


def test_rotate_moves_to_the_next_shard_at_offset_zero(published) -> None:
    stream = _stream(published)
    stream.next_batch()
    stream.rotate()
    assert stream.position == DataPosition(order_index=1, offset=0)
    stream.next_batch()
    assert stream.shard_id == 0
