"""Fraud proofs on disk and in the database (verifier.fraudproofs): written atomically under their
sha256, listed once (also when another verifier lists them first), bounded to the newest `keep`
and `keep_bytes` (the rest's rows and files go), not written on a nearly full disk, files no row
names swept once old, and no name but 64 lowercase hex digits reaches the file system."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from neuroshard.verifier import fraudproofs
from neuroshard.verifier import models as m
from neuroshard.verifier.db import Database

WALLET = "f" * 20


def _receipt(round_: int, stage: int = 0) -> m.Receipt:
    return m.Receipt(
        wallet_id=WALLET, stage=stage, round=round_, inner_steps=4, start_step=0, tokens=1, shard_id=None,
        offset_start=None, offset_end=None, data_spans=[[3, 0, 8]], losses=[], base_hash="0" * 64,
        result_hash="1" * 64, delta_digest="2" * 64, accepted=[], rejected=[], equivocators=[],
        body_sha256="3" * 64, received_at=0.0, device="cuda", precision="bf16",
    )  # fmt: skip


@pytest.fixture
def wallet(db: Database) -> str:
    with db.write() as s:
        s.add(m.Wallet(wallet_id=WALLET, public_key="e" * 64, reputation=0.5, registered_at=0.0,
                       software_version="0.1.0"))  # fmt: skip
    return WALLET


def test_a_proof_is_written_whole_under_its_sha256_once(tmp_path: Path) -> None:
    data = os.urandom(3000)
    sha = fraudproofs.write_proof(tmp_path / "fp", data)
    assert sha == hashlib.sha256(data).hexdigest()
    path = tmp_path / "fp" / f"{sha}.proof"
    assert path.read_bytes() == data
    old = time.time() - 2 * fraudproofs.ORPHAN_GRACE_S
    os.utime(path, (old, old))
    inode = path.stat().st_ino
    assert (
        fraudproofs.write_proof(tmp_path / "fp", data) == sha and path.stat().st_ino == inode
    )  # not rewritten
    assert path.stat().st_mtime > old + fraudproofs.ORPHAN_GRACE_S  # but young again: a sweep spares it
    assert fraudproofs.sweep_orphans(tmp_path / "fp", []) == []
    assert [p.name for p in (tmp_path / "fp").iterdir()] == [path.name]  # no temporary file left


@pytest.mark.parametrize(
    "name", ["../" + "a" * 61, "A" * 64, "a" * 63, "a" * 65, "", "g" * 64, "a" * 63 + "\n"]
)
def test_only_a_sha256_names_a_proof(tmp_path: Path, name: str) -> None:
    assert not fraudproofs.is_sha256(name)
    with pytest.raises(ValueError, match="64 lowercase hex"):
        fraudproofs.proof_path(tmp_path, name)


def test_rows_beyond_keep_are_pruned_oldest_first_with_their_files(
    db: Database, wallet: str, tmp_path: Path
) -> None:
    directory = tmp_path / "fp"
    written = []
    for r in range(5):
        data = f"proof {r}".encode() * 100
        sha = fraudproofs.write_proof(directory, data)
        written.append(sha)
        with db.write() as s:
            assert fraudproofs.add_row(
                s,
                sha256=sha,
                size=len(data),
                receipt=_receipt(r),
                segment=r % 2,
                reason="x" * 1000,
                now=100.0 + r,
            )
            assert not fraudproofs.add_row(  # the same bytes are listed once
                s, sha256=sha, size=len(data), receipt=_receipt(r), segment=r % 2, reason="again", now=200.0
            )
            dropped = fraudproofs.prune_rows(s, keep=3)
        fraudproofs.remove_files(directory, dropped)
    with db.read() as s:
        rows, total = fraudproofs.page(s, limit=10, offset=0)
        assert [r.sha256 for r in rows] == written[:1:-1] and total == 3  # newest first
        assert [r.round for r in fraudproofs.page(s, limit=1, offset=1)[0]] == [3]
        row = s.scalars(select(m.FraudProof).where(m.FraudProof.round == 4)).one()
        assert len(row.reason) == m.FRAUD_REASON_LEN and row.data_spans == [[3, 0, 8]]
        assert (row.device, row.precision, row.segment) == ("cuda", "bf16", 0)
    assert sorted(p.name for p in directory.iterdir()) == sorted(f"{h}.proof" for h in written[2:])


def test_later_stages_keep_no_data_spans(db: Database, wallet: str) -> None:
    with db.write() as s:
        fraudproofs.add_row(
            s, sha256="a" * 64, size=1, receipt=_receipt(0, stage=1), segment=0, reason="r", now=1.0
        )
    with db.read() as s:
        assert s.get(m.FraudProof, "a" * 64).data_spans == []  # type: ignore[union-attr]


def test_files_no_row_names_are_swept_once_old(tmp_path: Path) -> None:
    directory = tmp_path / "fp"
    listed = fraudproofs.write_proof(directory, b"listed")
    orphan = fraudproofs.write_proof(directory, b"orphan")
    young = fraudproofs.write_proof(directory, b"young")
    (directory / ".0123456789abcdef-x.tmp").write_bytes(b"half")
    (directory / "notes.txt").write_text("not ours")
    old = time.time() - 2 * fraudproofs.ORPHAN_GRACE_S
    for name in (f"{listed}.proof", f"{orphan}.proof", ".0123456789abcdef-x.tmp"):
        os.utime(directory / name, (old, old))
    removed = fraudproofs.sweep_orphans(directory, [listed])
    assert sorted(removed) == sorted([f"{orphan}.proof", ".0123456789abcdef-x.tmp"])
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [f"{listed}.proof", f"{young}.proof", "notes.txt"]
    )
    assert fraudproofs.sweep_orphans(tmp_path / "missing", []) == []


def test_a_row_another_verifier_inserted_first_leaves_the_verdict_standing(
    db: Database, wallet: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two leaders replaying one receipt make the same proof; the second's insert finds the first's
    row only at the database (its look-up ran before the other committed): its transaction, and
    so its verdict, still commits."""
    with db.write() as s:
        assert fraudproofs.add_row(
            s, sha256="a" * 64, size=1, receipt=_receipt(0), segment=0, reason="r", now=1.0
        )
    real_get = Session.get

    def stale_get(self: Session, entity: object, ident: object, **kw: object) -> object:
        return None if entity is m.FraudProof else real_get(self, entity, ident, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Session, "get", stale_get)
    with db.write() as s:  # the verdict's other writes, then the proof's row
        s.add(m.Wallet(wallet_id="9" * 20, public_key="8" * 64, reputation=0.5, registered_at=0.0,
                       software_version="0.1.0"))  # fmt: skip
        assert not fraudproofs.add_row(
            s, sha256="a" * 64, size=1, receipt=_receipt(0), segment=0, reason="again", now=2.0
        )
    monkeypatch.undo()
    with db.read() as s:
        assert s.get(m.Wallet, "9" * 20) is not None
        assert [r.reason for r in fraudproofs.page(s, limit=10, offset=0)[0]] == ["r"]


def test_rows_beyond_the_byte_budget_are_pruned_oldest_first(db: Database, wallet: str) -> None:
    with db.write() as s:
        for r, size in enumerate([500, 300, 300, 300]):
            fraudproofs.add_row(
                s, sha256=f"{r:x}" * 64, size=size, receipt=_receipt(r), segment=0, reason="r", now=float(r)
            )
        assert fraudproofs.prune_rows(s, keep=10, keep_bytes=700) == ["1" * 64, "0" * 64]
    with db.read() as s:
        assert sorted(fraudproofs.listed(s)) == ["2" * 64, "3" * 64]
    with db.write() as s:
        fraudproofs.add_row(
            s, sha256="4" * 64, size=5000, receipt=_receipt(4), segment=0, reason="r", now=4.0
        )
        assert sorted(fraudproofs.prune_rows(s, keep=10, keep_bytes=700)) == ["2" * 64, "3" * 64]
    with db.read() as s:
        assert fraudproofs.listed(s) == ["4" * 64]  # the newest stays, even alone over the budget


def test_no_proof_is_written_on_a_nearly_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    free = fraudproofs.MIN_FREE_BYTES + 1000
    monkeypatch.setattr(fraudproofs.shutil, "disk_usage", lambda _: _Usage(free))
    assert fraudproofs.room_for(tmp_path / "fp", 999) is None
    why = fraudproofs.room_for(tmp_path / "fp", 1001)
    assert why is not None and "GiB free" in why


class _Usage:
    def __init__(self, free: int) -> None:
        self.total, self.used, self.free = 2 * free, free, free
