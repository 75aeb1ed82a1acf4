"""Text sources for publishing: files and directories, and the embedded default corpus."""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst")


def expand_paths(paths: Sequence[Path]) -> list[Path]:
    """Files named directly, plus text files found under directories, in a stable sorted order."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input {path} does not exist")
    return files


def read_documents(files: Sequence[Path], max_bytes: int | None = None) -> Iterator[str]:
    """One document per file (UTF-8; files that are not UTF-8 are skipped), up to `max_bytes` in all."""
    total = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if max_bytes is not None and total + len(text) > max_bytes:
            return
        total += len(text)
        yield text


def stdlib_source_files() -> list[Path]:
    """The Python standard library's own source, present wherever Python is.

    Test suites are left out: they hold deliberately odd encodings and generated data
    that teach a small model little.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    return [p for p in sorted(root.rglob("*.py")) if not skip.intersection(p.relative_to(root).parts)]
