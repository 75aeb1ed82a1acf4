"""Whole-model files: a trained model's weights with its config in one safetensors file, and the
verifier's majority models kept by round (issue 14).

A model file (`save_model_file`) is safetensors (never pickle) whose header holds the format
name, the ModelConfig and the tokenizer's sha256. A round file is a model file of the verifier's
measured majority model of one round, its pipeline stages assembled (`assemble_stages`), whose
header also names every stage's own round and majority θ hash: `load_round_model` re-hashes
each stage's weights against it. verifier.evaluator writes round files under
HOME/models/RUN (one directory per run definition, the newest few rounds); node.export turns
one into a Hugging Face folder and node.generate samples from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from neuroshard.data.files import fsync_directory
from neuroshard.tokenizer import BPETokenizer

from .diloco import tensor_digest
from .model import ModelConfig, Transformer, build_stage

MODEL_FILE_FORMAT = "neuroshard-model"
MODELS_DIR = "models"
"""HOME/models/RUN: the round files of the verifier's majority models, a directory per run."""
_ROUND_FILE = re.compile(r"^round-(\d{8,})\.safetensors$")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class TrainedModel:
    """A whole model's weights (our parameter names) with its config and, if known, its tokenizer."""

    config: ModelConfig
    state_dict: dict[str, Tensor]
    tokenizer_sha256: str | None

    def build(self) -> Transformer:
        model = Transformer(self.config)
        model.load_state_dict(self.state_dict)
        return model.eval()


def assemble_stages(stages: Sequence[nn.Module]) -> dict[str, Tensor]:
    """The whole model's state dict from its pipeline stages in order (stage 0 first). Parameter
    names carry global layer indices (node.model), so the union of the stages' is the whole one."""
    whole: dict[str, Tensor] = {}
    for s, stage in enumerate(stages):
        for name, tensor in stage.state_dict().items():
            if name in whole:
                raise ValueError(f"stage {s} holds {name!r}, already held by an earlier stage")
            whole[name] = tensor.detach().to("cpu", torch.float32)
    return whole


def save_model_file(
    path: Path,
    config: ModelConfig,
    state: Mapping[str, Tensor],
    tokenizer_sha256: str,
    *,
    extra: Mapping[str, str] | None = None,
) -> None:
    """A whole model as one safetensors file with its ModelConfig and tokenizer hash in the header
    (plus `extra` header entries), written atomically: a temporary file beside it, fsync, rename."""
    metadata = {
        **(extra or {}),
        "format": MODEL_FILE_FORMAT,
        "model_config": json.dumps(config.to_dict(), sort_keys=True),
        "tokenizer_sha256": tokenizer_sha256,
    }
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        save_file(tensors, str(tmp), metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_directory(path.parent)  # the rename itself survives a power cut


# ----- the verifier's majority models, by round -----


@dataclass(frozen=True)
class StageProvenance:
    """Where one stage of an assembled majority model comes from."""

    stage: int
    round: int
    """The stage's own round R_s: its weights are θ_{R_s}, the result of its round R_s − 1."""
    theta_hash: str
    """The settled majority hash of that result (node.diloco.tensor_digest of the flat θ)."""


def round_model_path(directory: Path, round_: int) -> Path:
    return directory / f"round-{round_:08d}.safetensors"


def round_tokenizer_path(directory: Path, sha256: str) -> Path:
    """Beside the round files, the tokenizer each names, by content (a run's tokenizer may grow)."""
    if not _SHA256.fullmatch(sha256):
        raise ValueError(f"tokenizer hash {sha256[:80]!r} is not a sha256 hex digest")
    return directory / f"tokenizer-{sha256}.json"


def round_models(directory: Path) -> list[int]:
    """The rounds whose majority model `directory` holds, oldest first."""
    if not directory.is_dir():
        return []
    found = (_ROUND_FILE.match(p.name) for p in directory.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


def save_round_model(
    directory: Path,
    round_: int,
    config: ModelConfig,
    stages: Sequence[nn.Module],
    provenance: Sequence[StageProvenance],
    tokenizer: BPETokenizer,
    *,
    keep: int,
) -> Path:
    """Write the assembled majority model of `round_` (stage 0's round) and its tokenizer, and
    keep only the newest `keep` round files. Each stage's weights must hash to its provenance's
    majority hash."""
    if keep < 1:
        raise ValueError(f"keep must be ≥ 1 round file, got {keep}")
    if [p.stage for p in provenance] != list(range(len(stages))):
        raise ValueError(f"provenance names stages {[p.stage for p in provenance]} for {len(stages)} stages")
    for stage, origin in zip(stages, provenance, strict=True):
        got = _stage_hash(stage.state_dict(), config, origin.stage, len(stages))
        if got != origin.theta_hash:
            raise ValueError(f"stage {origin.stage} hashes to {got[:16]}…, not {origin.theta_hash[:16]}…")
    directory.mkdir(parents=True, exist_ok=True)
    if not round_tokenizer_path(directory, tokenizer.sha256).exists():
        tokenizer.save(round_tokenizer_path(directory, tokenizer.sha256))
    path = round_model_path(directory, round_)
    extra = {"round": str(round_), "stages": json.dumps([vars(p) for p in provenance])}
    save_model_file(path, config, assemble_stages(stages), tokenizer.sha256, extra=extra)
    # Rounds only grow within a run (the evaluator keeps no round older than one it kept): a file
    # past this round is an earlier run's (a database started over beside the same directory),
    # and must not outlive this run's newest.
    kept = [r for r in round_models(directory) if r <= round_]
    for old in [r for r in round_models(directory) if r > round_] + kept[:-keep]:
        round_model_path(directory, old).unlink(missing_ok=True)
    for stray in directory.glob(".round-*.tmp"):  # writes interrupted by a crash, not one in flight
        with contextlib.suppress(FileNotFoundError):
            if time.time() - stray.stat().st_mtime > STRAY_TMP_AGE_S:
                stray.unlink(missing_ok=True)
    return path


STRAY_TMP_AGE_S = 3600.0
"""A round file's temporary older than this is a crashed write's, removed at the next save."""


def _stage_hash(state: Mapping[str, Tensor], config: ModelConfig, stage: int, num_stages: int) -> str:
    """The θ hash replicas of this stage vote with, from whole-model (or stage) tensors by name:
    the stage's parameters flattened in parameter order (node.diloco.flat_parameters)."""
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in build_stage(config, stage, num_stages).named_parameters()}
    names = list(shapes)
    missing = [n for n in names if n not in state]
    if missing:
        raise ValueError(f"stage {stage} of {num_stages} lacks {missing[:4]} ({len(missing)} tensors)")
    # The hash covers the values, not the shapes: a (3C, C) matrix stored as (C, 3C) hashes the same.
    wrong = [n for n in names if tuple(state[n].shape) != tuple(shapes[n])]
    if wrong:
        n = wrong[0]
        raise ValueError(
            f"stage {stage} of {num_stages}: {n} is {tuple(state[n].shape)}, the model needs "
            f"{tuple(shapes[n])} ({len(wrong)} tensors of the wrong shape)"
        )
    return tensor_digest(torch.cat([state[n].detach().to("cpu", torch.float32).flatten() for n in names]))


def latest_models_dir(home: Path) -> Path:
    """The run directory under HOME/models (one per run definition, verifier.evaluator) whose
    newest round file is the most recent: the run the verifier on this HOME measured last."""
    root = home / MODELS_DIR
    runs = [d for d in root.iterdir() if d.is_dir() and round_models(d)] if root.is_dir() else []
    if not runs:
        raise ValueError(
            f"no verifier round files under {root}: a verifier with this HOME keeps the majority "
            "model of its latest measured rounds there (or give --models DIR)"
        )
    return max(runs, key=lambda d: round_model_path(d, round_models(d)[-1]).stat().st_mtime)


@dataclass(frozen=True)
class RoundHeader:
    """What a round file's header says, read without its tensors."""

    round: int
    provenance: tuple[StageProvenance, ...]
    tokenizer_sha256: str | None


def read_round_header(path: Path) -> RoundHeader:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except SafetensorError as exc:
        raise ValueError(f"{path}: not a safetensors file ({exc})") from None
    if meta.get("format") != MODEL_FILE_FORMAT:
        raise ValueError(f"{path}: not a {MODEL_FILE_FORMAT} file (header format {meta.get('format')!r})")
    try:
        provenance = tuple(StageProvenance(**p) for p in json.loads(meta["stages"]))
        round_ = int(meta["round"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: no valid round and stage provenance in the header ({exc})") from None
    if [p.stage for p in provenance] != list(range(len(provenance))) or not provenance:
        raise ValueError(f"{path}: the header names stages {[p.stage for p in provenance]}")
    for p in provenance:
        if not (type(p.round) is int and p.round >= 1 and isinstance(p.theta_hash, str)):
            raise ValueError(f"{path}: stage {p.stage}'s round {p.round!r} or hash is not valid")
        if not _SHA256.fullmatch(p.theta_hash):
            raise ValueError(f"{path}: stage {p.stage}'s hash {p.theta_hash[:80]!r} is not a sha256 digest")
    tokenizer_sha256 = meta.get("tokenizer_sha256")
    if tokenizer_sha256 is not None and not _SHA256.fullmatch(tokenizer_sha256):
        raise ValueError(f"{path}: tokenizer hash {tokenizer_sha256[:80]!r} is not a sha256 digest")
    return RoundHeader(round_, provenance, tokenizer_sha256)


def load_round_model(directory: Path, which: str) -> TrainedModel:
    """The majority model of round `which` (a number, or "latest") from the verifier's round
    files, every stage re-hashed against the majority hash the file names."""
    rounds = round_models(directory)
    if not rounds:
        raise ValueError(f"{directory} holds no round files (round-NNNNNNNN.safetensors)")
    round_ = rounds[-1] if which == "latest" else int(which)
    if round_ not in rounds:
        raise ValueError(f"round {round_} is not kept in {directory}; kept: {', '.join(map(str, rounds))}")
    path = round_model_path(directory, round_)
    header = read_round_header(path)
    model = load_model_file(path)
    provenance = header.provenance
    for origin in provenance:
        got = _stage_hash(model.state_dict, model.config, origin.stage, len(provenance))
        if got != origin.theta_hash:
            raise ValueError(
                f"{path}: stage {origin.stage} hashes to {got[:16]}…, the file says the majority "
                f"{origin.theta_hash[:16]}…; the file is damaged"
            )
    return model


def load_model_file(path: Path) -> TrainedModel:
    """A model file as a whole model on the CPU (safetensors: no code runs while reading it)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != MODEL_FILE_FORMAT:
                raise ValueError(
                    f"{path}: not a {MODEL_FILE_FORMAT} file (header format {meta.get('format')!r})"
                )
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    except SafetensorError as exc:
        raise ValueError(f"{path}: not a safetensors file ({exc})") from None
    config = ModelConfig.from_dict(json.loads(meta["model_config"]))
    return TrainedModel(config, state, meta.get("tokenizer_sha256"))
