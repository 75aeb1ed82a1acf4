"""neuroshard-publish-tokenizer: writes tokenizer.json, extends it, refuses bad input with exit code 2."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from neuroshard.cli.publish_tokenizer import input_files, main, read_texts
from neuroshard.tokenizer import BPETokenizer

PROSE = "It is a truth universally acknowledged, that a single man in possession of a good fortune.\n" * 40
CODE = "def f(x: int) -> int:\n    return x * 2  # doubled\n" * 30


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text(PROSE, encoding="utf-8")
    (root / "sub" / "a.py").write_text(CODE, encoding="utf-8")
    (root / "notes.md").write_text("ignored: not *.txt or *.py", encoding="utf-8")
    return root


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_trains_and_writes_tokenizer_json(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "dist" / "v1"  # created if missing
    code, out, err = run(["--input", str(corpus), "--out", str(out_dir), "--vocab-size", "300"], capsys)
    assert code == 0, err
    path = out_dir / "tokenizer.json"
    tok = BPETokenizer.load(path)
    assert tok.vocab_size == 300
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert out.count("\n") == 1
    assert "vocab_size=300" in out and "next_merge_id=300" in out and f"sha256={digest}" in out
    assert tok.encode(CODE) == BPETokenizer.train([PROSE, CODE], 300).encode(CODE)  # b.txt, then sub/a.py


def test_extend_appends_merges(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--input", str(corpus), "--out", str(tmp_path), "--vocab-size", "280"], capsys)[0] == 0
    old = BPETokenizer.load(tmp_path / "tokenizer.json")
    extra = tmp_path / "extra.txt"
    extra.write_text("Mr. Darcy and Mr. Bingley walked to Netherfield. " * 20, encoding="utf-8")
    code, out, _ = run(["--input", str(extra), "--out", str(tmp_path), "--extend", "25"], capsys)
    assert code == 0
    new = BPETokenizer.load(tmp_path / "tokenizer.json")
    assert new.merges[:14] == old.merges and new.next_merge_id == 305
    assert "next_merge_id=305" in out


def test_max_bytes_caps_the_input_without_cutting_a_character(tmp_path: Path) -> None:
    path = tmp_path / "accents.txt"
    path.write_text("é" * 10, encoding="utf-8")  # 20 bytes
    assert list(read_texts([path], max_bytes=7)) == ["ééé"]
    assert list(read_texts([path, path], max_bytes=25)) == ["é" * 10, "éé"]


def test_directories_expand_sorted(corpus: Path) -> None:
    assert [p.relative_to(corpus).as_posix() for p in input_files([corpus])] == ["b.txt", "sub/a.py"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--input", "{tmp}/missing.txt", "--out", "{tmp}"], "missing.txt: no such file or directory"),
        (["--input", "{tmp}/latin1.txt", "--out", "{tmp}"], "latin1.txt: not UTF-8"),
        (["--input", "{tmp}/ok.txt", "--out", "{tmp}", "--vocab-size", "abc"], "invalid int value"),
        (
            ["--input", "{tmp}/ok.txt", "--out", "{tmp}", "--vocab-size", "100"],
            "--vocab-size 100 is below 266",
        ),
        (["--input", "{tmp}/ok.txt", "--out", "{tmp}", "--extend", "5"], "tokenizer.json does not exist"),
        (
            ["--input", "{tmp}/ok.txt", "--out", "{tmp}", "--extend", "5", "--vocab-size", "300"],
            "not allowed",
        ),
        (["--input", "{tmp}/ok.txt", "--out", "{tmp}", "--max-bytes", "0"], "--max-bytes 0"),
        (["--input", "{tmp}/ok.txt"], "--out"),
        (["--input", "{tmp}/ok.txt", "--out", "{tmp}", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    (tmp_path / "ok.txt").write_text(PROSE, encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    code, out, err = run([a.format(tmp=tmp_path) for a in argv], capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("neuroshard-publish-tokenizer: error:")
    assert message in err
    assert not (tmp_path / "tokenizer.json").exists()
