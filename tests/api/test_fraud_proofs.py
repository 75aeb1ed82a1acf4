"""GET /api/fraud-proofs and /api/fraud-proofs/{sha256}: the kept segment fraud proofs listed
newest first, a page at a time, and served whole with their sha256 as ETag; an unknown or
malformed name, or a verifier that keeps no proofs, answers 404 with a refusal body."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from neuroshard.api.app import create_app
from neuroshard.testing.api import Harness, test_config
from neuroshard.testing.verifier import ManualClock
from neuroshard.verifier import fraudproofs
from neuroshard.verifier import models as m

WALLET = "c" * 20


@pytest.fixture
def kept(database_url: str, tmp_path: Path) -> Iterator[Harness]:
    clock = ManualClock()
    config = test_config(database_url, clock, fraud_proof_dir=tmp_path / "fp")
    with TestClient(create_app(config)) as client:
        yield Harness(client, clock, config)


def _keep(h: Harness, data: bytes, round_: int) -> str:
    directory = h.config.fraud_proof_dir
    assert directory is not None
    sha = fraudproofs.write_proof(directory, data)
    with h.services.db.write() as s:
        if s.get(m.Wallet, WALLET) is None:
            s.add(m.Wallet(wallet_id=WALLET, public_key="d" * 64, reputation=0.5, registered_at=0.0,
                           software_version="0.1.0"))  # fmt: skip
            s.flush()
        row = dict(
            sha256=sha, wallet_id=WALLET, stage=0, round=round_, segment=2, size_bytes=len(data),
            reason="segment 2 of 4: norm ratio 1.25", data_spans=[[1, 0, 8]], created_at=float(round_),
        )  # fmt: skip
        s.add(m.FraudProof(**row))
    return sha


def test_proofs_are_listed_newest_first_and_served_whole(kept: Harness) -> None:
    h = kept
    assert h.client.get("/api/fraud-proofs").json() == {"proofs": [], "served": True}
    blobs = [os.urandom(3 << 20) for _ in range(3)]  # several chunks of the stream
    hashes = [_keep(h, data, r) for r, data in enumerate(blobs)]
    page = h.client.get("/api/fraud-proofs", params={"limit": 2})
    assert page.status_code == 200 and page.headers["x-total-count"] == "3"
    assert 'offset=2>; rel="next"' in page.headers["link"]
    proofs = page.json()["proofs"]
    assert [p["sha256"] for p in proofs] == hashes[:0:-1]
    assert proofs[0] == {
        "sha256": hashes[2], "wallet_id": WALLET, "stage": 0, "round": 2, "segment": 2,
        "kind": "segment", "reason": "segment 2 of 4: norm ratio 1.25", "size_bytes": len(blobs[2]), "data_spans": [[1, 0, 8]],
        "device": None, "precision": None, "created_at": 2.0, "download": f"/api/fraud-proofs/{hashes[2]}",
    }  # fmt: skip
    reply = h.client.get(proofs[1]["download"])
    assert reply.status_code == 200 and reply.content == blobs[1]
    assert reply.headers["content-type"] == "application/octet-stream"
    assert reply.headers["content-length"] == str(len(blobs[1]))
    assert reply.headers["etag"] == f'"{hashes[1]}"'
    again = h.client.get(proofs[1]["download"], headers={"If-None-Match": reply.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    head = h.client.head(proofs[1]["download"])
    assert (
        head.status_code == 200 and head.headers["content-length"] == str(len(blobs[1])) and not head.content
    )


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("0" * 64, "not kept here"),  # well-formed, not held
        ("A" * 64, "64 lowercase hex"),
        ("abc", "64 lowercase hex"),
        ("." * 64, "64 lowercase hex"),
    ],
)
def test_an_unknown_or_malformed_name_is_refused_with_404(kept: Harness, name: str, why: str) -> None:
    reply = kept.client.get(f"/api/fraud-proofs/{name}")
    assert reply.status_code == 404, reply.text
    body = reply.json()
    assert body["error"] == "not_found" and why in body["detail"]


def test_a_file_no_row_lists_is_not_served(kept: Harness) -> None:
    """An orphan (written, its row never committed or already pruned) is not served."""
    directory = kept.config.fraud_proof_dir
    assert directory is not None
    orphan = fraudproofs.write_proof(directory, b"an orphan's bytes")
    listed = _keep(kept, b"a listed proof", 1)
    reply = kept.client.get(f"/api/fraud-proofs/{orphan}")
    assert reply.status_code == 404 and reply.json()["error"] == "not_found"
    assert kept.client.get(f"/api/fraud-proofs/{listed}").content == b"a listed proof"


def test_a_path_out_of_the_directory_finds_nothing(kept: Harness) -> None:
    for path in ("..%2F..%2Fetc%2Fpasswd", "..%2Ffp%2F" + "0" * 64 + ".proof", "%2E%2E"):
        assert kept.client.get(f"/api/fraud-proofs/{path}").status_code == 404


def test_a_verifier_without_a_directory_lists_but_serves_none(harness: Harness) -> None:
    assert harness.client.get("/api/fraud-proofs").json() == {"proofs": [], "served": False}
    reply = harness.client.get(f"/api/fraud-proofs/{'0' * 64}")
    assert reply.status_code == 404
    assert reply.json() == {
        "detail": "this verifier process keeps no fraud proofs (no fraud-proof directory)",
        "error": "not_held",
    }
    assert harness.client.get("/api/fraud-proofs/x").json()["error"] == "not_found"
