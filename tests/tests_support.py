"""Helpers shared by tests (importable: tests/ is on sys.path through pytest's pythonpath)."""

from neuroshard.data.corpus import read_documents, stdlib_source_files


def small_corpus(max_bytes: int = 400_000) -> list[str]:
    """A few hundred KB of real text every machine with Python has: standard-library source."""
    return list(read_documents(stdlib_source_files(), max_bytes))
