"""`neuroshard-check-proof`'s answers when it cannot read what it is given: exit 2 and one line
(real proofs, segment and sender, checked alone: tests/verifier/test_segmentcheck_live.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuroshard.cli import check_proof
from neuroshard.cli.check_proof import main
from neuroshard.testing.verifier import small_network
from neuroshard.verifier.segmentcheck import SENDER_PROOF_MAGIC


@pytest.fixture
def network(tmp_path: Path) -> Path:
    path = tmp_path / "network.json"
    path.write_bytes(small_network().canonical_bytes())
    return path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse errors
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, (out.out + out.err).strip()


def test_a_missing_proof_file(network: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run([str(tmp_path / "nope.proof"), "--network", str(network)], capsys)
    assert code == 2 and "cannot read" in out and "\n" not in out


def test_bytes_that_are_no_proof(network: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x.proof").write_bytes(b"not a proof at all")
    code, out = _run([str(tmp_path / "x.proof"), "--network", str(network)], capsys)
    assert code == 2 and "is not a segment fraud proof" in out


def test_a_missing_network(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x.proof").write_bytes(b"x")
    code, out = _run([str(tmp_path / "x.proof"), "--network", str(tmp_path / "none.toml")], capsys)
    assert code == 2 and "cannot read network definition" in out


@pytest.mark.parametrize("spans", ["[[1, 2]]", "not json", "[[1, 2, -3]]", '{"a": 1}'])
def test_bad_spans(network: Path, tmp_path: Path, spans: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run([str(tmp_path / "x.proof"), "--network", str(network), "--spans", spans], capsys)
    assert code == 2 and "--spans" in out


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--device", "cpu"], "--device and --precision go together"),
        (["--precision", "fp16"], "--device and --precision go together"),
        (["--operator-key", "ab" * 32], "--operator-key and --signature go together"),
        (["--signature", "cd" * 64], "--operator-key and --signature go together"),
        (["--operator-key", "xyz", "--signature", "cd" * 64], "--operator-key must be 64 hex"),
    ],
)
def test_flags_that_go_together(
    network: Path, tmp_path: Path, flags: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _run([str(tmp_path / "x.proof"), "--network", str(network), *flags], capsys)
    assert code == 2 and why in out and "\n" not in out, out


def test_a_definition_the_operator_did_not_sign_is_refused(
    network: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "x.proof").write_bytes(b"x")
    flags = ["--operator-key", "ab" * 32, "--signature", "cd" * 64]
    code, out = _run([str(tmp_path / "x.proof"), "--network", str(network), *flags], capsys)
    assert code == 2 and "not signed by the operator key" in out, out


def test_a_segment_proof_needs_the_definition(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x.proof").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    code, out = _run([str(tmp_path / "x.proof")], capsys)
    assert (
        code == 2
        and "not a sender fraud proof (no NSSENDER1 line); a segment fraud proof needs --network" in out
    )


def test_a_sender_proof_that_does_not_parse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Checked without a definition (a real one: tests/verifier/test_segmentcheck_live.py)."""
    (tmp_path / "s.proof").write_bytes(SENDER_PROOF_MAGIC + b'{"log": 1}')
    code, out = _run([str(tmp_path / "s.proof")], capsys)
    assert code == 2 and "is not a sender fraud proof" in out and "\n" not in out, out


@pytest.mark.parametrize(
    "flags", [["--spans", "[[1, 0, 8]]"], ["--device", "cpu", "--precision", "fp32"], ["--cache-dir", "/tmp"]]
)
def test_segment_flags_on_a_sender_proof_are_refused(
    tmp_path: Path, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "s.proof").write_bytes(SENDER_PROOF_MAGIC + b"{}")
    code, out = _run([str(tmp_path / "s.proof"), *flags], capsys)
    assert code == 2 and f"{flags[0]} apply to segment fraud proofs" in out, out


def test_a_sender_proof_over_its_bound_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(check_proof, "SENDER_PROOF_MAX_BYTES", 100)
    (tmp_path / "s.proof").write_bytes(SENDER_PROOF_MAGIC + b" " * 100)
    code, out = _run([str(tmp_path / "s.proof")], capsys)
    assert code == 2 and "holds more than the 100 bytes a sender proof can" in out, out
