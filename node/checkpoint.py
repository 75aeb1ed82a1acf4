"""Checkpoints: everything a replica needs to resume exactly, written atomically.

One file per (wallet, stage) under the checkpoint directory. A checkpoint records the
fingerprints of the model config and tokenizer it was made with; loading it under a
different config is refused with both fingerprints in the message, never done silently.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neuroshard.data.files import atomic_write, torch_save

CHECKPOINT_FORMAT = 1


class CheckpointMismatch(ValueError):
    """A checkpoint written for a different model, tokenizer, wallet or stage."""


@dataclass(frozen=True, kw_only=True)
class CheckpointIdentity:
    """What a checkpoint must match to be loaded."""

    wallet_id: str
    stage: int
    model_fingerprint: str
    tokenizer_sha256: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "wallet_id": self.wallet_id,
            "stage": self.stage,
            "model_fingerprint": self.model_fingerprint,
            "tokenizer_sha256": self.tokenizer_sha256,
        }


def checkpoint_path(directory: Path, wallet_id: str, stage: int) -> Path:
    return directory / f"{wallet_id}-stage{stage}.pt"


def save_checkpoint(path: Path, identity: CheckpointIdentity, state: dict[str, Any]) -> None:
    """Write `state` atomically: temp file in the same directory, fsync, rename, fsync the directory.

    A crash at any point leaves either the previous checkpoint or the new one, whole.
    """
    payload = {"format": CHECKPOINT_FORMAT, "identity": identity.as_dict(), "state": state}
    # No CRC-32s: torch.load never reads them, and they took 0.8 s of a 1.5 GB write (torch_save).
    atomic_write(path, lambda tmp: torch_save(payload, tmp, crc32=False))


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint file at `path` as saved ("format", "identity", "state"), read with the
    restricted unpickler; CheckpointMismatch when it cannot be read or is not a checkpoint."""
    try:
        payload = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # the restricted unpickler raises many types
        raise CheckpointMismatch(f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointMismatch(f"{path} is not a node checkpoint (format {CHECKPOINT_FORMAT})")
    return payload


def load_checkpoint(
    path: Path, expected: CheckpointIdentity, older_tokenizers: Collection[str] = ()
) -> dict[str, Any] | None:
    """The saved state, or None when there is no checkpoint at `path`.

    A checkpoint made with one of `older_tokenizers` (the current tokenizer's ancestors in
    the manifest's lineage) is accepted: its ids are a prefix of ours and the caller grows
    the vocabulary. Anything else that differs raises CheckpointMismatch, naming it.
    """
    if not path.exists():
        return None
    payload = read_checkpoint(path)
    saved = payload["identity"]
    wanted = expected.as_dict()
    differences = [
        f"{k}: checkpoint {saved.get(k)!r}, now {v!r}"
        for k, v in wanted.items()
        if saved.get(k) != v and not (k == "tokenizer_sha256" and saved.get(k) in older_tokenizers)
    ]
    if differences:
        raise CheckpointMismatch(
            f"checkpoint {path} was written for a different configuration ({'; '.join(differences)}). "
            "Start with --fresh to discard it, or point --checkpoint-dir elsewhere."
        )
    state: dict[str, Any] = payload["state"]
    return state


class CheckpointWriter:
    """Writes checkpoints on a background thread so the training loop does not wait on the disk.

    At most one write is in flight: `submit` first waits for the previous one. The caller
    hands over a snapshot (tensors it will not modify again). `flush` waits for the write
    in flight and re-raises its error, so a failed checkpoint is never silently lost.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, path: Path, identity: CheckpointIdentity, state: dict[str, Any]) -> None:
        self.flush()
        self._thread = threading.Thread(
            target=self._write, args=(path, identity, state), name="checkpoint-writer"
        )
        self._thread.start()

    def _write(self, path: Path, identity: CheckpointIdentity, state: dict[str, Any]) -> None:
        try:
            save_checkpoint(path, identity, state)
        except BaseException as exc:  # handed to the training thread by flush()
            self._error = exc

    @property
    def busy(self) -> bool:
        """True while a write is in flight (a periodic checkpoint then skips its turn)."""
        return self._thread is not None and self._thread.is_alive()

    def flush(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
