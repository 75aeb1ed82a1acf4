"""Checkpoints are written atomically, without torch.save's CRC-32s (shards keep theirs), and refused
under a different configuration."""

import io
import threading
import time
from pathlib import Path

import pytest
import torch

from neuroshard.data.files import torch_save
from neuroshard.data.publish import shard_bytes
from neuroshard.node import checkpoint as ckpt_module
from neuroshard.node.checkpoint import (
    CheckpointIdentity,
    CheckpointMismatch,
    checkpoint_path,
    load_checkpoint,
    save_checkpoint,
)

IDENTITY = CheckpointIdentity(wallet_id="abc", stage=0, model_fingerprint="m1", tokenizer_sha256="t1")


def test_round_trip(tmp_path: Path) -> None:
    path = checkpoint_path(tmp_path, "abc", 0)
    state = {"weights": torch.arange(5.0), "step": 7, "nested": {"x": [1, 2]}}
    save_checkpoint(path, IDENTITY, state)
    loaded = load_checkpoint(path, IDENTITY)
    assert loaded is not None
    assert (
        torch.equal(loaded["weights"], state["weights"])
        and loaded["step"] == 7
        and loaded["nested"] == {"x": [1, 2]}
    )


def test_missing_checkpoint_is_none(tmp_path: Path) -> None:
    assert load_checkpoint(tmp_path / "none.pt", IDENTITY) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("model_fingerprint", "m2"), ("tokenizer_sha256", "t2"), ("stage", 1), ("wallet_id", "zz")],
)
def test_incompatible_checkpoint_is_refused_with_both_values(
    tmp_path: Path, field: str, value: object
) -> None:
    path = tmp_path / "c.pt"
    save_checkpoint(path, IDENTITY, {"step": 1})
    other = CheckpointIdentity(**{**IDENTITY.as_dict(), field: value})
    with pytest.raises(CheckpointMismatch, match=rf"{field}: checkpoint .*, now {value!r}"):
        load_checkpoint(path, other)


def test_crash_while_writing_leaves_the_previous_checkpoint_whole(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "c.pt"
    save_checkpoint(path, IDENTITY, {"step": 1})

    def dying_save(obj, f):  # type: ignore[no-untyped-def]
        Path(f).write_bytes(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_module.torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, IDENTITY, {"step": 2})
    monkeypatch.undo()
    loaded = load_checkpoint(path, IDENTITY)
    assert loaded is not None and loaded["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]  # no temp file left behind


def test_garbage_file_is_refused_clearly(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    path.write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointMismatch, match="cannot be read"):
        load_checkpoint(path, IDENTITY)


needs_crc_switch = pytest.mark.skipif(
    not hasattr(torch.serialization, "set_crc32_options"), reason="torch < 2.6 always writes CRC-32s"
)


@needs_crc_switch
def test_a_checkpoint_is_written_without_crc32s_and_the_setting_is_restored(
    tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    seen: list[bool] = []
    real_save = torch.save

    def spying_save(obj, f) -> None:  # type: ignore[no-untyped-def]
        seen.append(torch.serialization.get_crc32_options())
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", spying_save)
    path = checkpoint_path(tmp_path, "abc", 0)
    save_checkpoint(path, IDENTITY, {"weights": torch.arange(5.0)})
    assert seen == [False]
    assert torch.serialization.get_crc32_options() is True
    loaded = load_checkpoint(path, IDENTITY)
    assert loaded is not None and torch.equal(loaded["weights"], torch.arange(5.0))


@needs_crc_switch
def test_saves_made_at_once_each_get_their_own_crc32_setting(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint written in the background must not strip the CRC-32s from a shard saved meanwhile."""
    seen: list[tuple[int, bool, bool]] = []
    real_save = torch.save

    def slow_save(obj, f) -> None:  # type: ignore[no-untyped-def]
        at_start = torch.serialization.get_crc32_options()
        time.sleep(0.02)  # long enough for the other threads to try their own setting
        seen.append((obj, at_start, torch.serialization.get_crc32_options()))
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", slow_save)
    threads = [
        threading.Thread(target=torch_save, args=(i, io.BytesIO()), kwargs={"crc32": i % 2 == 0})
        for i in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == [(i, i % 2 == 0, i % 2 == 0) for i in range(6)]
    assert torch.serialization.get_crc32_options() is True


def test_shards_keep_their_crc32s_so_the_same_tokens_give_the_same_bytes() -> None:
    buffer = io.BytesIO()
    torch.save(torch.tensor([1, 2, 3], dtype=torch.int32), buffer)
    assert shard_bytes([1, 2, 3]) == buffer.getvalue()
