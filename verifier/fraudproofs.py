"""Fraud proofs kept where a third party can fetch them (issue 17).

A segment that fails its replay on material matching the replica's signed commitment
(verifier.segmentcheck.SegmentFraudProof, kind "segment") proves fraud to anyone holding the run's
definition (and, at stage 0, its data); a sender's signed round log that contradicts a header it
signed (verifier.segmentcheck.SenderFraudProof, kind "sender": kilobytes) proves it to anyone, and
a round that starts from AdamW moments neither fresh nor the ones the replica's round before ended
with (verifier.segmentcheck.ContinuityFraudProof, kind "continuity": θ_round's 4 bytes per
parameter and two round logs) to anyone holding the run's definition. The replay checker (verifier.replaycheck) keeps each one:

- the bytes in `<directory>/<sha256>.proof` (the verifier's HOME/fraud-proofs): of a segment
  proof, two checkpoints of 12 bytes per parameter and θ_round's 4, 28 bytes per parameter, plus
  the segment's inputs: tens of MB for the tiny model, 3.5 GB at 125M parameters, so files, not
  rows (a sender proof is its round log and one header: kilobytes). Written to a temporary file in the same directory, fsynced and renamed: a reader sees a
  whole proof or none;
- a row in `fraud_proofs` (verifier.models.FraudProof): whose, which stage, round and segment,
  the verdict, the size, and the receipt's data spans a stage-0 re-check compares the signed log
  with. Added in the transaction that records the verdict, after the file is on disk, so a row
  never names a missing file.

Bounded: at most `keep` proofs (ReplayCheckConfig.keep_fraud_proofs, default 64) holding at most
`keep_bytes` together (ReplayCheckConfig.keep_fraud_bytes, default 8 GiB; the newest is kept
even alone over it). Beyond either the oldest rows are deleted in the same transaction and their
files after it commits; a file left without a row (a crash between the write and the commit, or
a failed delete) is removed by a later pass once it is `ORPHAN_GRACE_S` old. A proof is not
written when the disk would be left with less than `MIN_FREE_BYTES` free (the verdict is recorded
all the same). A proof whose bytes are already held (the same sha256) is neither written nor
listed twice: its file's mtime is refreshed, so a sweep does not take it as an orphan, and a row
inserted meanwhile by another verifier (two leaders replaying the same receipt) is left as it is.

GET /api/fraud-proofs lists the rows, GET /api/fraud-proofs/{sha256} serves a file (api.reads),
and `neuroshard-check-proof` re-checks one alone (cli.check_proof).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from neuroshard.data.files import atomic_write

from . import models as m

KIND_SEGMENT, KIND_SENDER, KIND_CONTINUITY = "segment", "sender", "continuity"
"""`FraudProof.kind`: a failed segment replay, a sender's log against its own header, or a round
that starts from neither a fresh optimizer nor the state the replica's round before ended with."""
DIRECTORY_NAME = "fraud-proofs"
"""The proofs' directory under the verifier's HOME."""
SUFFIX = ".proof"
DEFAULT_KEEP = 64
"""Proofs kept by default (each tens of MB for the tiny model, 28 bytes per parameter and more)."""
DEFAULT_KEEP_BYTES = 8 << 30
"""Bytes the kept proofs may hold together by default."""
MIN_FREE_BYTES = 1 << 30
"""A proof is not written when the disk would be left with less than this free."""
ORPHAN_GRACE_S = 600.0
"""A proof file with no row is removed once it is this old (seconds): younger ones may be about
to be committed."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


def is_sha256(name: str) -> bool:
    """Whether `name` is 64 lowercase hex digits: the only names a proof is looked up by."""
    return _SHA256.fullmatch(name) is not None


def proof_path(directory: Path, sha256: str) -> Path:
    """Where the proof named `sha256` lies; ValueError for anything but 64 lowercase hex digits,
    so no name reaches the file system unchecked."""
    if not is_sha256(sha256):
        raise ValueError(
            f"a fraud proof is named by its sha256 (64 lowercase hex digits), not {sha256[:80]!r}"
        )
    return directory / f"{sha256}{SUFFIX}"


def write_proof(directory: Path, data: bytes) -> str:
    """Write `data` as `<sha256>.proof` in `directory` (created if missing): a temporary file in
    the same directory, fsynced, renamed over the name, and the directory fsynced. Returns the
    sha256. Bytes already held under their name are not written again."""
    sha256 = hashlib.sha256(data).hexdigest()
    path = proof_path(directory, sha256)
    directory.mkdir(parents=True, exist_ok=True)
    if path.is_file() and path.stat().st_size == len(data):
        os.utime(path)  # a sweep spares a file this young: the row about to name it is not committed yet
        return sha256
    atomic_write(path, lambda tmp: tmp.write_bytes(data))
    return sha256


def add_row(
    session: Session,
    *,
    sha256: str,
    size: int,
    receipt: m.Receipt,
    segment: int,
    reason: str,
    now: float,
    kind: str = KIND_SEGMENT,
) -> bool:
    """List a proof already written with `write_proof` (in the caller's transaction); False when
    these bytes are already listed, by this verifier or by another one that inserted them first
    (a savepoint: the duplicate key rolls back only this insert, not the caller's verdict)."""
    if session.get(m.FraudProof, sha256) is not None:
        return False
    row = m.FraudProof(
        sha256=sha256,
        wallet_id=receipt.wallet_id,
        stage=receipt.stage,
        round=receipt.round,
        segment=segment,
        kind=kind,
        reason=reason[: m.FRAUD_REASON_LEN],
        size_bytes=size,
        data_spans=(
            [list(span) for span in receipt.data_spans] if receipt.stage == 0 and kind == KIND_SEGMENT else []
        ),
        # What the replica trained with: the replay's condition, meaningless for a sender proof.
        device=getattr(receipt, "device", None) if kind == KIND_SEGMENT else None,
        precision=getattr(receipt, "precision", None) if kind == KIND_SEGMENT else None,
        created_at=now,
    )
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        return False
    return True


def prune_rows(session: Session, keep: int, keep_bytes: int | None = None) -> list[str]:
    """Delete the oldest rows until at most `keep` remain holding at most `keep_bytes` together
    (the newest is kept even alone over it), in the caller's transaction; returns their hashes,
    whose files the caller removes once the transaction has committed."""
    session.flush()
    rows = session.execute(
        select(m.FraudProof.sha256, m.FraudProof.size_bytes).order_by(
            m.FraudProof.created_at.desc(), m.FraudProof.sha256.desc()
        )
    )
    old: list[str] = []
    held = 0
    for i, (sha256, size) in enumerate(rows):
        held += size
        if i >= keep or (i > 0 and keep_bytes is not None and held > keep_bytes):
            old.append(sha256)
    for sha256 in old:
        row = session.get(m.FraudProof, sha256)
        if row is not None:
            session.delete(row)
    return old


def room_for(directory: Path, size: int, *, min_free: int = MIN_FREE_BYTES) -> str | None:
    """Why `size` more bytes should not be written in `directory` (the disk would be left with less
    than `min_free` free), or None when they fit."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free - size < min_free:
        return f"{free / 2**30:.1f} GiB free, {size / 2**30:.2f} GiB would leave less than {min_free / 2**30:.1f} GiB"
    return None


def remove_files(directory: Path, hashes: Iterable[str]) -> None:
    """Delete the named proofs' files (after their rows are gone); missing ones are skipped."""
    for sha256 in hashes:
        with contextlib.suppress(OSError):
            proof_path(directory, sha256).unlink(missing_ok=True)


def sweep_orphans(
    directory: Path, listed: Sequence[str], *, now: float | None = None, grace_s: float = ORPHAN_GRACE_S
) -> list[str]:
    """Remove proof and temporary files no row names that are older than `grace_s`; returns the
    names removed."""
    if not directory.is_dir():
        return []
    held, now = set(listed), time.time() if now is None else now
    removed = []
    for entry in directory.iterdir():
        name = entry.name
        ours = (name.endswith(SUFFIX) and is_sha256(name[: -len(SUFFIX)])) or (
            name.startswith(".") and name.endswith(".tmp")
        )
        if not ours or name[: -len(SUFFIX)] in held:
            continue
        try:
            if now - entry.stat().st_mtime > grace_s:
                entry.unlink()
                removed.append(name)
        except OSError:
            continue
    return removed


def listed(session: Session) -> list[str]:
    """Every listed proof's sha256."""
    return list(session.scalars(select(m.FraudProof.sha256)))


def page(session: Session, *, limit: int, offset: int) -> tuple[list[m.FraudProof], int]:
    """A page of the listed proofs, newest first, and how many there are."""
    rows = list(
        session.scalars(
            select(m.FraudProof)
            .order_by(m.FraudProof.created_at.desc(), m.FraudProof.sha256.desc())
            .limit(limit)
            .offset(offset)
        )
    )
    total = session.scalar(select(func.count()).select_from(m.FraudProof)) or 0
    return rows, total
