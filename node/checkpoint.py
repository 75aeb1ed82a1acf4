"""Checkpoints: everything a replica needs to resume exactly, written atomically.

One file per (wallet, stage) under the checkpoint directory. A checkpoint records the
fingerprints of the model config and tokenizer it was made with; loading it under a
different config is refused with both fingerprints in the message, never done silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neuroshard.data.files import atomic_write

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
    atomic_write(path, lambda tmp: torch.save(payload, tmp))


def load_checkpoint(path: Path, expected: CheckpointIdentity) -> dict[str, Any] | None:
    """The saved state, or None when there is no checkpoint at `path`.

    Raises CheckpointMismatch when the file belongs to another config, naming what differs.
    """
    if not path.exists():
        return None
    try:
        payload = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # the restricted unpickler raises many types
        raise CheckpointMismatch(f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointMismatch(f"checkpoint {path} has an unknown format")
    saved = payload["identity"]
    wanted = expected.as_dict()
    differences = [
        f"{k}: checkpoint {saved.get(k)!r}, now {v!r}" for k, v in wanted.items() if saved.get(k) != v
    ]
    if differences:
        raise CheckpointMismatch(
            f"checkpoint {path} was written for a different configuration ({'; '.join(differences)}). "
            "Start with --fresh to discard it, or point --checkpoint-dir elsewhere."
        )
    state: dict[str, Any] = payload["state"]
    return state
