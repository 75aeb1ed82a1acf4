"""Shared set-up for benchmarks: the text they train on, a published data set built from it
(cached on disk), free ports, and the --quick mode CI runs.

The text: ../shared/data/austen.txt (4 MB of English, the text bench/RESULTS.md was measured
on) when this checkout sits beside it; otherwise, as on a fresh clone, the Python standard
library's source, the corpus the embedded default builds its data set from (data.corpus),
written once to /tmp. Every benchmark prints the text it used.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nacl.signing import SigningKey

from neuroshard.data import Dataset, open_dataset
from neuroshard.data.corpus import read_documents, stdlib_source_files
from neuroshard.data.files import file_sha256
from neuroshard.data.manifest import MANIFEST_FORMAT, MANIFEST_NAME
from neuroshard.data.publish import TOKENIZER_NAME, publish_shards
from neuroshard.tokenizer import BPETokenizer

SHARED_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "austen.txt"
CACHE_DIR = Path("/tmp/neuroshard-bench")
CORPUS_BYTES = 4_000_000
"""About austen.txt's size, so a benchmark's work is comparable whichever text it got."""
QUICK_BYTES = 150_000
"""--quick text: enough for a tokenizer of a few hundred merges and a handful of small shards."""


def _stdlib_text(max_bytes: int) -> Path:
    """The standard library's source as one text file (one paragraph-separated document per
    module), built once per Python version and size: what a fresh clone has on any machine."""
    version = "".join(map(str, sys.version_info[:3]))
    path = CACHE_DIR / f"stdlib-py{version}-{max_bytes}.txt"
    if not path.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        text = "\n\n".join(read_documents(stdlib_source_files(), max_bytes))
        tmp = path.with_suffix(f".tmp{time.monotonic_ns()}")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)  # atomic: two benchmarks starting at once both read a whole file
    return path


DEFAULT_TEXT = SHARED_TEXT if SHARED_TEXT.exists() else _stdlib_text(CORPUS_BYTES)
"""The benchmarks' text (module docstring): austen.txt beside the checkout, else the stdlib source."""
BENCH_KEY = SigningKey(hashlib.sha256(b"neuroshard bench publisher").digest())
"""A fixed, public key: benchmark data sets are throwaway and need no secret."""


def bench_dataset(text_path: Path, vocab_size: int = 4096, shard_tokens: int = 250_000) -> Dataset:
    """Tokenizer + shards for `text_path` under /tmp, built once and reused by later runs."""
    tag = f"{file_sha256(text_path)[:12]}-m{MANIFEST_FORMAT}-v{vocab_size}-s{shard_tokens}"
    directory = CACHE_DIR / tag
    if not (directory / MANIFEST_NAME).exists():
        # Built beside its place and renamed into it: benchmarks started at once (the tests run
        # them on parallel workers) never read a half-written set, and the loser of the race
        # throws its copy away.
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f".{tag}-", dir=CACHE_DIR))
        text = text_path.read_text(encoding="utf-8")
        start = time.perf_counter()
        tokenizer = BPETokenizer.train([text[:1_500_000]], vocab_size)
        tokenizer.save(building / TOKENIZER_NAME)
        # One document per paragraph, so EOS marks real boundaries.
        publish_shards(text.split("\n\n"), out=building, key=BENCH_KEY, shard_tokens=shard_tokens)
        if directory.exists() and not (directory / MANIFEST_NAME).exists():
            shutil.rmtree(directory, ignore_errors=True)  # a partial set an interrupted run left
        try:
            building.rename(directory)
        except OSError:  # another run got there first
            shutil.rmtree(building)
            if not (directory / MANIFEST_NAME).exists():
                raise
        print(f"(built bench data set {directory} in {time.perf_counter() - start:.1f}s)")
    return open_dataset(directory, bytes(BENCH_KEY.verify_key))


def fresh_clone_text(max_bytes: int = CORPUS_BYTES) -> Path:
    """The text every checkout can build, with or without ../shared/data: the standard library's
    source (the embedded default's corpus). For benchmarks whose numbers must not depend on what
    sits beside the checkout."""
    return _stdlib_text(max_bytes)


def quick_text() -> Path:
    """The --quick modes' text: the first QUICK_BYTES of the standard library's source."""
    return _stdlib_text(QUICK_BYTES)


def quick_dataset() -> Dataset:
    """The --quick modes' data set: quick_text() with a 512-token vocabulary in 20k-token shards."""
    return bench_dataset(quick_text(), vocab_size=512, shard_tokens=20_000)


def parse_with_quick(parser: argparse.ArgumentParser, **quick: Any) -> argparse.Namespace:
    """parse_args with a --quick flag: the same code on `quick` settings (tiny text, few steps,
    one repeat), seconds long. CI runs every benchmark this way so a broken one fails the build
    (tests/bench/test_quick.py); its numbers mean nothing."""
    parser.add_argument(
        "--quick", action="store_true", help="tiny settings, seconds long: checks the benchmark runs (CI)"
    )
    args = parser.parse_args()
    if args.quick:
        for name, value in quick.items():
            if not hasattr(args, name):
                raise AttributeError(f"--quick sets {name!r}, which {parser.prog} has no flag for")
            setattr(args, name, value)
    return args
