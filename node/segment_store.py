"""The replica's disk store of segment material: what it needs to answer a segment challenge.

For each of the last `SegmentConfig.keep_rounds` rounds, under `directory/round-<r>/`:

- `ckpt-<step>.safetensors`: the checkpoint at each segment boundary (weights, AdamW moments and
  step counts, float32; node.segments.SegmentCheckpoint);
- `step-<i>.safetensors`: the messages inner step i consumed, each as two uint8 tensors (the
  sender's signed header and the payload bytes) — stage 0 of a single-stage run writes none;
- `headers.jsonl`: every pipeline header the replica signed naming the round (`SignedHeader`), one
  JSON line each, appended and synced before the header is sent; kept when an unfinished recording
  is dropped, so a round redone after a crash lists what the crashed run signed;
- `end.json` and `start.json` (the openings of the round's last and first checkpoints: their
  weights' and optimizer's hashes), `commitment.json` and `log.json` once the round is closed (written last: a round without them
  was never committed and is not served).

Bounded twice: at most `keep_rounds` closed rounds, and the checkpoints and payloads of whole oldest
rounds are deleted until the kept ones fit in `max_bytes`; the round being written is never deleted,
so a round larger than the budget is kept alone and the log line says so. A round's small files
(log, commitment, openings) outlive its checkpoints by `LOG_ROUNDS` rounds. Files are written to a temporary name and renamed,
read back with safetensors (never pickle), and every read is checked against the log's hashes by
whoever uses it (verifier.segmentcheck), not trusted here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as st_load
from safetensors.torch import load_file, save_file
from safetensors.torch import save as st_save
from torch import Tensor

from neuroshard.data.files import fsync_directory
from neuroshard.protocol.refusal import Refused, malformed
from neuroshard.protocol.schema import split_header
from neuroshard.protocol.segments import (
    KINDS,
    MAX_MESSAGES_PER_STEP,
    CheckpointOpening,
    Received,
    SegmentCommitment,
    SegmentLog,
    SignedHeader,
)

from .replay import InnerState
from .segments import SegmentCheckpoint, SegmentConfig, SegmentSink


def _round_dir(directory: Path, round_: int) -> Path:
    return directory / f"round-{round_:012d}"


def _atomic_save(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def _atomic_write(data: bytes, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _bytes_tensor(data: bytes) -> Tensor:
    """Raw bytes as a (n,) uint8 tensor: how headers and payloads sit inside safetensors files."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


HEADERS_FILE = "headers.jsonl"


LOG_ROUNDS = 64
"""Rounds whose log, commitment and end opening are kept after their checkpoints and payloads are
dropped (a log is ~0.3 KB a step: ~10 MB for 64 rounds at H = 500)."""


def _heavy_files(where: Path) -> list[Path]:
    """A round's checkpoints and received payloads, and any file a crash left half-written: all but
    its small JSON files and its signed headers (what the byte budget bounds)."""
    return sorted(
        f for f in where.iterdir() if f.is_file() and f.suffix != ".json" and f.name != HEADERS_FILE
    )


class SegmentStore(SegmentSink):
    """A SegmentSink on disk, read by the peer route that answers challenges."""

    def __init__(
        self,
        directory: Path,
        config: SegmentConfig,
        *,
        log: Callable[[str], None] = print,
        budget_for: Callable[[int], int] | None = None,
    ) -> None:
        self.directory = directory
        self.config = config
        self._log = log
        self._budget_for = budget_for
        """Parameters of a round → the byte budget for rounds that size (node.reporting.segment_store);
        None: `config.max_bytes` whatever the rounds hold."""
        self._params: int | None = None
        self._lock = threading.Lock()
        self._headers_lock = threading.Lock()
        directory.mkdir(parents=True, exist_ok=True)

    # --- writing (the training thread) --------------------------------------------------------

    def checkpoint(self, round_: int, step: int, checkpoint: SegmentCheckpoint) -> None:
        where = _round_dir(self.directory, round_)
        where.mkdir(exist_ok=True)
        tensors = {
            "weights": checkpoint.weights.contiguous(),
            "exp_avg": checkpoint.inner.exp_avg.contiguous(),
            "exp_avg_sq": checkpoint.inner.exp_avg_sq.contiguous(),
            "steps": checkpoint.inner.steps.contiguous(),
        }
        _atomic_save(tensors, where / f"ckpt-{step:08d}.safetensors")

    def fit(self, params: int) -> None:
        """Rounds from now on checkpoint `params` parameters: set the budget for them when that is
        not the size the budget was set for (a grown vocabulary makes every checkpoint larger, and a
        budget sized before would keep fewer rounds than it should). The first call only notes it."""
        if self._budget_for is None or params == self._params:
            return
        if self._params is not None:
            self.config = dataclasses.replace(self.config, max_bytes=max(1, self._budget_for(params)))
        self._params = params

    def header(self, round_: int, header: SignedHeader) -> None:
        """Append `header` to the round's `headers.jsonl` and sync it (any thread): a header is sent
        only once its line is on disk."""
        where = _round_dir(self.directory, round_)
        with self._headers_lock:
            where.mkdir(exist_ok=True)
            path = where / HEADERS_FILE
            new = not path.exists()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, header.to_json() + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            if new:  # the file's name is durable too
                fsync_directory(where)

    def headers(self, round_: int) -> list[SignedHeader]:
        """The round's `headers.jsonl`, read back; a line a crash cut short (its header was never
        sent) or anything else unreadable is skipped."""
        try:
            data = (_round_dir(self.directory, round_) / HEADERS_FILE).read_bytes()
        except OSError:
            return []
        out = []
        for line in data.splitlines():
            try:
                out.append(SignedHeader.from_json(line))
            except (Refused, ValueError):
                continue
        return out

    def received(self, round_: int, step: int, messages: Sequence[Received]) -> None:
        self._save_messages(round_, f"step-{step:08d}.safetensors", messages)

    def failed(self, round_: int, index: int, messages: Sequence[Received], body: bytes) -> None:
        self._save_messages(round_, f"failed-{index:08d}.safetensors", messages)
        _atomic_write(body, _round_dir(self.directory, round_) / f"failed-{index:08d}-activations.bin")

    def _save_messages(self, round_: int, name: str, messages: Sequence[Received]) -> None:
        where = _round_dir(self.directory, round_)
        where.mkdir(exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        metadata: dict[str, str] = {"count": str(len(messages))}
        for j, m in enumerate(messages):
            tensors[f"header{j}"] = _bytes_tensor(m.header)
            tensors[f"body{j}"] = _bytes_tensor(m.body)
            metadata[f"kind{j}"] = m.kind
            metadata[f"sender{j}"] = m.sender
        _atomic_save(tensors, where / name, metadata)

    def sent(self, round_: int, step: int, kind: str, body: bytes) -> None:
        if kind not in KINDS:
            raise ValueError(f"a sent payload's kind is one of {KINDS}, not {kind!r}")
        where = _round_dir(self.directory, round_)
        where.mkdir(exist_ok=True)
        _atomic_write(body, where / f"sent-{step:08d}-{kind}.bin")

    def close(
        self,
        log: SegmentLog,
        commitment: SegmentCommitment | None,
        end: CheckpointOpening | None = None,
        start: CheckpointOpening | None = None,
    ) -> None:
        where = _round_dir(self.directory, log.round)
        where.mkdir(exist_ok=True)
        for name, opening in (("end", end), ("start", start)):
            if opening is not None:
                _atomic_write(opening.to_json(), where / f"{name}.json")
        if commitment is not None:
            _atomic_write(commitment.to_json(), where / "commitment.json")
        _atomic_write(log.to_json(), where / "log.json")
        self._evict(keep=log.round)

    def committed(self, round_: int) -> bool:
        return (_round_dir(self.directory, round_) / "commitment.json").exists()

    def abandon(self, round_: int) -> None:
        """Drop what an unfinished recording of `round_` left but its signed headers (a redone round
        lists them); a round already committed (its commitment written, its receipt perhaps sent)
        is kept: a node resumed at its start after a crash must still answer for it."""
        where = _round_dir(self.directory, round_)
        with self._headers_lock:  # a header being written to this round is kept
            if (where / "commitment.json").exists() or not where.is_dir():
                return
            if not (where / HEADERS_FILE).exists():
                shutil.rmtree(where, ignore_errors=True)
                return
            for entry in where.iterdir():
                if entry.name == HEADERS_FILE:
                    continue
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)

    def trim(self) -> None:
        """Bring what an earlier run left within the budget now (the newest round kept), rather
        than when this run closes its first round, on top of which it would be written."""
        with self._lock:
            rounds = [r for r in self._rounds_on_disk() if _heavy_files(_round_dir(self.directory, r))]
        if rounds:
            self._evict(keep=max(rounds))

    def _evict(self, keep: int) -> None:
        """Drop the checkpoints and payloads of whole oldest rounds beyond `keep_rounds` or the byte
        budget; a dropped round's small files (log, commitment, openings) stay for
        `LOG_ROUNDS` rounds: the verifier reads them to match senders' records and to hold the
        next round's optimizer state to this one's end, after the heavy files are gone."""
        with self._lock:
            rounds = sorted(self._rounds_on_disk())
            heavy = {r: _heavy_files(_round_dir(self.directory, r)) for r in rounds}
            older = [r for r in rounds if r != keep and heavy[r]]
            sizes = {r: sum(f.stat().st_size for f in heavy[r]) for r in rounds}
            total = sum(sizes.values())
            while older and (len(older) + 1 > self.config.keep_rounds or total > self.config.max_bytes):
                gone = older.pop(0)
                for f in heavy[gone]:
                    f.unlink(missing_ok=True)
                total -= sizes[gone]
            for old in [r for r in rounds if r < keep - LOG_ROUNDS]:
                shutil.rmtree(_round_dir(self.directory, old), ignore_errors=True)
            if total > self.config.max_bytes:
                self._log(
                    f"segments: round {keep} alone takes {total / 1e6:.1f} MB, over the store's "
                    f"{self.config.max_bytes / 1e6:.1f} MB budget; kept"
                )

    def _rounds_on_disk(self) -> list[int]:
        out = []
        for entry in self.directory.iterdir():
            if entry.is_dir() and entry.name.startswith("round-") and entry.name[6:].isdigit():
                out.append(int(entry.name[6:]))
        return out

    # --- reading (the peer server) ------------------------------------------------------------

    def rounds(self) -> list[int]:
        """Closed rounds whose checkpoints are held (challenges on them are answered), oldest first;
        `log` also reads the logs of the `LOG_ROUNDS` rounds before."""
        with self._lock:
            return sorted(
                r
                for r in self._rounds_on_disk()
                if (_round_dir(self.directory, r) / "log.json").exists()
                and (_round_dir(self.directory, r) / f"ckpt-{0:08d}.safetensors").exists()
            )

    def log(self, round_: int) -> tuple[SegmentLog, SegmentCommitment | None] | None:
        where = _round_dir(self.directory, round_)
        try:
            log = SegmentLog.from_json((where / "log.json").read_bytes())
            signed = where / "commitment.json"
            commitment = SegmentCommitment.from_json(signed.read_bytes()) if signed.exists() else None
        except FileNotFoundError:
            return None
        return log, commitment

    def end_opening(self, round_: int) -> CheckpointOpening | None:
        """The opening of a closed round's last checkpoint; None when not held (or not written:
        rounds closed before it was kept)."""
        return self._opening(round_, "end")

    def start_opening(self, round_: int) -> CheckpointOpening | None:
        """The opening of a closed round's first checkpoint (θ_round and the optimizer state the
        round started from); None when not held (rounds closed before it was kept)."""
        return self._opening(round_, "start")

    def _opening(self, round_: int, name: str) -> CheckpointOpening | None:
        try:
            return CheckpointOpening.from_json(
                (_round_dir(self.directory, round_) / f"{name}.json").read_bytes()
            )
        except FileNotFoundError:
            return None

    def load_checkpoint(self, round_: int, step: int) -> SegmentCheckpoint | None:
        path = _round_dir(self.directory, round_) / f"ckpt-{step:08d}.safetensors"
        if not path.exists():
            return None
        t = load_file(str(path))
        return SegmentCheckpoint(t["weights"], InnerState(t["exp_avg"], t["exp_avg_sq"], t["steps"]))

    def load_received(self, round_: int, step: int) -> list[Received]:
        return self._load_messages(_round_dir(self.directory, round_) / f"step-{step:08d}.safetensors")

    def load_failed(self, round_: int, index: int) -> tuple[list[Received], bytes] | None:
        """Failed step `index`'s messages and the activations it offered; None when not held."""
        where = _round_dir(self.directory, round_)
        try:
            body = (where / f"failed-{index:08d}-activations.bin").read_bytes()
        except FileNotFoundError:
            return None
        return self._load_messages(where / f"failed-{index:08d}.safetensors"), body

    @staticmethod
    def _load_messages(path: Path) -> list[Received]:
        if not path.exists():
            return []
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            count = int(meta.get("count", "0"))
            out = []
            for j in range(count):
                kind = meta[f"kind{j}"]
                if kind not in KINDS:
                    raise ValueError(f"{path}: message {j} has kind {kind!r}")
                out.append(
                    Received(
                        kind=kind,
                        sender=meta[f"sender{j}"],
                        header=f.get_tensor(f"header{j}").numpy().tobytes(),
                        body=f.get_tensor(f"body{j}").numpy().tobytes(),
                    )
                )
        return out

    def load_sent(self, round_: int, step: int) -> list[tuple[str, bytes]]:
        """(kind, bytes) of the payloads inner step `step` sent on, in KINDS order."""
        where = _round_dir(self.directory, round_)
        out = []
        for kind in KINDS:
            path = where / f"sent-{step:08d}-{kind}.bin"
            if path.exists():
                out.append((kind, path.read_bytes()))
        return out

    def material(self, round_: int, segment: int) -> SegmentMaterial | None:
        """What a challenge on `segment` of `round_` is answered with; None when not held. Read
        under the store's lock: a round evicted halfway through the read (its messages gone, its
        checkpoints not yet) would otherwise be served with steps that consumed nothing, which
        fails the check as if the replica had lied."""
        with self._lock:
            return self._material(round_, segment)

    def _material(self, round_: int, segment: int) -> SegmentMaterial | None:
        held = self.log(round_)
        if held is None:
            return None
        log, commitment = held
        if commitment is None:
            return None  # an unsigned round cannot be held against its replica
        if not 0 <= segment < log.segments:
            return None
        first, end = log.segment(segment)
        round_start = self.load_checkpoint(round_, 0)
        start_ckpt, end_ckpt = self.load_checkpoint(round_, first), self.load_checkpoint(round_, end)
        if round_start is None or start_ckpt is None or end_ckpt is None:
            return None
        received = tuple(tuple(self.load_received(round_, i)) for i in range(first, end))
        sent = tuple(tuple(self.load_sent(round_, i)) for i in range(first, end))
        failed = []
        for index in log.failures_in(segment):
            held_failed = self.load_failed(round_, index)
            if held_failed is None:
                return None
            failed.append((index, tuple(held_failed[0]), held_failed[1]))
        opening = self.start_opening(round_)
        return SegmentMaterial(
            log,
            commitment,
            segment,
            start_ckpt,
            end_ckpt,
            received,
            theta_round=round_start.weights,
            sent=sent,
            start_inner=None if opening is None else opening.inner_sha256,
            failed=tuple(failed),
        )


# --- the answer to a challenge, on the wire -----------------------------------------------------

HEX64 = re.compile(r"[0-9a-f]{64}")
MAX_MATERIAL_HEADER = 16 << 20
"""Largest safetensors header of a material body: the log of H steps takes ~0.3 KB a step."""


def _metadata(data: bytes) -> dict[str, str]:
    """The string metadata of a safetensors body, read before any tensor is (bounded, strict)."""
    header, _ = split_header(data, "segment material", MAX_MATERIAL_HEADER)
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise malformed("segment material has no string metadata")
    return meta


_CKPT_KEYS = ("weights", "exp_avg", "exp_avg_sq", "steps")


@dataclass(frozen=True)
class SegmentMaterial:
    """A replica's answer to a challenge on one segment: its round's log and signed commitment, the
    checkpoints at the segment's two ends and the messages each of its steps consumed. Checked
    against the commitment by verifier.segmentcheck; also the body of a segment fraud proof."""

    log: SegmentLog
    commitment: SegmentCommitment
    segment: int
    start: SegmentCheckpoint
    end: SegmentCheckpoint
    received: tuple[tuple[Received, ...], ...]
    """Per inner step of the segment, in order."""
    theta_round: Tensor
    """(d,) the weights at the round's start (checkpoint 0's): θ_round, whose hash the receipt's
    base_hash is; ties segment 0's start to it and the last segment's end to the receipt's Δ."""
    sent: tuple[tuple[tuple[str, bytes], ...], ...] = ()
    """Per inner step of the segment, (kind, bytes) of what it sent on (activations forward, a
    gradient back), in KINDS order: the log's `sent` entries name their sha256s, and the replay
    holds them to what the step computed."""
    start_inner: str | None = None
    """The sha256 of the inner optimizer state the round started from (the second half of its first
    checkpoint's opening, `theta_round` being the first): what a continuity fraud proof needs
    (verifier.segmentcheck.ContinuityFraudProof). None from nodes before it was served."""
    failed: tuple[tuple[int, tuple[Received, ...], bytes], ...] = ()
    """(index in the log's `failed`, the messages it ran on, the activations it offered) for each
    failed step the segment replays (`SegmentLog.failures_in`), in order."""

    def encode(self) -> bytes:
        """safetensors: the two checkpoints' tensors and each message's header and payload as uint8
        tensors; the log, the commitment and the message kinds and senders in its metadata."""
        tensors: dict[str, Tensor] = {"theta_round": self.theta_round.detach().to(torch.float32).contiguous()}
        metadata = {
            "log": self.log.to_json().decode(),
            "commitment": self.commitment.to_json().decode(),
            "segment": str(self.segment),
            "counts": ",".join(str(len(r)) for r in self.received),
            "sent": ",".join(f"{i}:{kind}" for i, step in enumerate(self.sent) for kind, _ in step),
        }
        if self.start_inner is not None:
            metadata["start_inner"] = self.start_inner
        for side, ckpt in (("start", self.start), ("end", self.end)):
            for key, t in zip(
                _CKPT_KEYS,
                (ckpt.weights, ckpt.inner.exp_avg, ckpt.inner.exp_avg_sq, ckpt.inner.steps),
                strict=True,
            ):
                tensors[f"{side}.{key}"] = t.detach().to(torch.float32).contiguous()
        for i, messages in enumerate(self.received):
            for j, m in enumerate(messages):
                tensors[f"m{i}.{j}.header"] = _bytes_tensor(m.header)
                tensors[f"m{i}.{j}.body"] = _bytes_tensor(m.body)
                metadata[f"m{i}.{j}"] = f"{m.kind}:{m.sender}"
        for i, step in enumerate(self.sent):
            for kind, body in step:
                tensors[f"s{i}.{kind}"] = _bytes_tensor(body)
        if self.failed:
            metadata["failed"] = ",".join(f"{n}:{len(messages)}" for n, messages, _ in self.failed)
        for n, messages, body in self.failed:
            tensors[f"f{n}.sent"] = _bytes_tensor(body)
            for j, m in enumerate(messages):
                tensors[f"f{n}.{j}.header"] = _bytes_tensor(m.header)
                tensors[f"f{n}.{j}.body"] = _bytes_tensor(m.body)
                metadata[f"f{n}.{j}"] = f"{m.kind}:{m.sender}"
        return st_save(tensors, metadata=metadata)

    @staticmethod
    def read_commitment(data: bytes) -> SegmentCommitment:
        """The signed commitment of encoded material, from its header alone (no tensor is read):
        what a reader needs to learn the stage, and so the shapes `decode` expects. Refused when
        the header or the commitment does not parse."""
        metadata = _metadata(data)
        if "commitment" not in metadata:
            raise malformed("segment material metadata holds no commitment")
        return SegmentCommitment.from_json(metadata["commitment"])

    @staticmethod
    def read_log(data: bytes) -> tuple[SegmentLog, int]:
        """(the round's log, the segment's index) of encoded material, from its header alone: what
        a reader needs to bound the rest before loading it. Refused when they do not parse or the
        index is not one of the log's segments."""
        metadata = _metadata(data)
        try:
            log, segment = SegmentLog.from_json(metadata["log"]), int(metadata["segment"])
        except (KeyError, ValueError) as exc:
            raise malformed(f"segment material metadata is incomplete: {exc}") from None
        if not 0 <= segment < log.segments:
            raise malformed(f"segment {segment} of a round with {log.segments} segments")
        return log, segment

    @classmethod
    def decode(cls, data: bytes, *, numel: int, n_tensors: int) -> SegmentMaterial:
        """Bytes -> material with exactly the expected tensors and shapes; Refused otherwise
        (whether they match the commitment is the verifier's question, not this one's)."""
        try:
            metadata = _metadata(data)
            tensors = st_load(data)
        except (SafetensorError, ValueError) as exc:
            raise malformed(f"segment material does not load: {exc}") from None
        try:
            log = SegmentLog.from_json(metadata["log"])
            commitment = SegmentCommitment.from_json(metadata["commitment"])
            segment = int(metadata["segment"])
            counts = [int(c) for c in metadata["counts"].split(",")] if metadata["counts"] else []
            sent_keys = [
                (int(i), kind)
                for i, _, kind in (e.partition(":") for e in metadata.get("sent", "").split(",") if e)
            ]
            failed_counts = [
                (int(n), int(c))
                for n, _, c in (e.partition(":") for e in metadata.get("failed", "").split(",") if e)
            ]
        except (KeyError, ValueError) as exc:
            raise malformed(f"segment material metadata is incomplete: {exc}") from None
        start_inner = metadata.get("start_inner")
        if start_inner is not None and not HEX64.fullmatch(start_inner):
            raise malformed("segment material's start_inner is not a sha256 (64 lowercase hex digits)")
        if not 0 <= segment < log.segments:
            raise malformed(f"segment {segment} of a round with {log.segments} segments")
        first, end = log.segment(segment)
        if len(counts) != end - first or any(not 0 <= c <= MAX_MESSAGES_PER_STEP for c in counts):
            raise malformed(
                f"segment material lists messages for {len(counts)} steps, the segment has {end - first}"
            )
        wanted = {"theta_round"} | {f"{side}.{key}" for side in ("start", "end") for key in _CKPT_KEYS}
        wanted |= {
            f"m{i}.{j}.{part}" for i, c in enumerate(counts) for j in range(c) for part in ("header", "body")
        }
        outside = any(not 0 <= i < len(counts) or kind not in KINDS for i, kind in sent_keys)
        if outside or len(set(sent_keys)) != len(sent_keys):
            raise malformed("segment material names sent payloads of no step of the segment, or twice")
        wanted |= {f"s{i}.{kind}" for i, kind in sent_keys}
        if [n for n, _ in failed_counts] != log.failures_in(segment) or any(
            not 0 <= c <= 1 for _, c in failed_counts
        ):
            raise malformed("segment material's failed steps are not the ones its segment replays")
        for n, c in failed_counts:
            wanted |= {f"f{n}.sent"} | {f"f{n}.{j}.{part}" for j in range(c) for part in ("header", "body")}
        if set(tensors) != wanted:
            raise malformed(
                f"segment material holds tensors {sorted(set(tensors) ^ wanted)[:4]} unexpectedly or lacks them"
            )
        ckpts = []
        for side in ("start", "end"):
            t = {key: tensors[f"{side}.{key}"] for key in _CKPT_KEYS}
            shapes = {"weights": (numel,), "exp_avg": (numel,), "exp_avg_sq": (numel,), "steps": (n_tensors,)}
            for key, shape in shapes.items():
                if t[key].dtype != torch.float32 or tuple(t[key].shape) != shape:
                    raise malformed(
                        f"{side}.{key} is {t[key].dtype} {tuple(t[key].shape)}, expected float32 {shape}"
                    )
            ckpts.append(
                SegmentCheckpoint(t["weights"], InnerState(t["exp_avg"], t["exp_avg_sq"], t["steps"]))
            )

        def messages(prefix: str, c: int, what: str) -> tuple[Received, ...]:
            out = []
            for j in range(c):
                kind, _, sender = metadata.get(f"{prefix}.{j}", "").partition(":")
                if kind not in KINDS or len(sender) != 64:
                    raise malformed(f"message {j} of {what} has no kind and sender")
                header, body = tensors[f"{prefix}.{j}.header"], tensors[f"{prefix}.{j}.body"]
                if header.dtype != torch.uint8 or body.dtype != torch.uint8:
                    raise malformed(f"message {j} of {what} is not raw bytes")
                out.append(Received(kind, sender, header.numpy().tobytes(), body.numpy().tobytes()))
            return tuple(out)

        received = [messages(f"m{i}", c, f"step {i}") for i, c in enumerate(counts)]
        failed = []
        for n, c in failed_counts:
            offered = tensors[f"f{n}.sent"]
            if offered.dtype != torch.uint8:
                raise malformed(f"the activations failed step {n} offered are not raw bytes")
            failed.append((n, messages(f"f{n}", c, f"failed step {n}"), offered.numpy().tobytes()))
        sent: list[list[tuple[str, bytes]]] = [[] for _ in counts]
        for i, kind in sorted(sent_keys, key=lambda k: (k[0], KINDS.index(k[1]))):
            body = tensors[f"s{i}.{kind}"]
            if body.dtype != torch.uint8:
                raise malformed(f"the {kind} step {i} sent is not raw bytes")
            sent[i].append((kind, body.numpy().tobytes()))
        theta = tensors["theta_round"]
        if theta.dtype != torch.float32 or tuple(theta.shape) != (numel,):
            raise malformed(f"theta_round is {theta.dtype} {tuple(theta.shape)}, expected float32 ({numel},)")
        return cls(
            log,
            commitment,
            segment,
            ckpts[0],
            ckpts[1],
            tuple(received),
            theta,
            tuple(tuple(s) for s in sent),
            start_inner,
            tuple(failed),
        )
