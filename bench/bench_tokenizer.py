"""Encode throughput: our BPETokenizer vs a plain HF `tokenizers` Tokenizer with the same merges.

Both sides run the same compiled BPE with the same vocabulary, merges and pre-tokenizer,
and must return identical ids. The baseline is what a user of HF tokenizers writes:
one `Tokenizer.encode(text)` on the whole text (single-threaded: HF parallelises over
a batch, not within one sequence). Ours is `BPETokenizer.encode`: the text cut at
pre-token boundaries and sent through `encode_batch_fast` on the engine's thread pool.
Repeats alternate (ours, HF, HF, ours, ...) so drift in machine speed hits both alike.

    .venv/bin/python bench/bench_tokenizer.py [--text FILE] [--vocab-size 8192] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

# common imports the tokenizers package, which is fine: the engine's pool size is read when it
# first runs (main sets RAYON_NUM_THREADS before that), not at import.
from common import CACHE_DIR, DEFAULT_TEXT, parse_with_quick, quick_text

if TYPE_CHECKING:  # imported for real inside main(), after the thread settings are in place
    from tokenizers import Tokenizer

    from neuroshard.tokenizer import BPETokenizer


@dataclass
class Timings:
    """Wall and CPU seconds of each timed repeat of one encoder."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def row(self, name: str, megabytes: float) -> str:
        median = megabytes / statistics.median(self.wall)
        best = megabytes / min(self.wall)
        busy = sum(self.cpu) / sum(self.wall)  # ~ number of cores kept busy
        return f"{name:<34} {median:>10.2f} {best:>10.2f} {busy:>10.2f}"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="UTF-8 text to train on and encode")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per encoder (after one warm-up)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="HF engine thread pool size")
    return parse_with_quick(p, text=quick_text(), vocab_size=512, repeats=1)


def main() -> int:
    args = parse_args()
    # The pool size is read once, when the engine first runs; set it before importing tokenizers.
    # (Rayon reads RAYON_NUM_THREADS; RAYON_RS_NUM_THREADS is not read by tokenizers 0.23.)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from neuroshard.tokenizer.bpe import chunk_text

    text = args.text.read_text(encoding="utf-8")
    megabytes = len(text.encode("utf-8")) / 1e6
    ours = cached_tokenizer(text, args.vocab_size)
    hf = plain_hf_tokenizer(ours)

    ours_ids = ours.encode(text)  # warm-up, and the equality check
    hf_ids = hf.encode(text, add_special_tokens=False).ids
    one_call_ids = ours.engine.encode_batch_fast([text], add_special_tokens=False)[0].ids
    assert ours_ids == hf_ids == one_call_ids, "ids differ between our encode and the HF baseline"

    encoders: dict[str, Callable[[], object]] = {
        "ours: BPETokenizer.encode": lambda: ours.encode(text),
        "HF: Tokenizer.encode (baseline)": lambda: hf.encode(text, add_special_tokens=False).ids,
        "(ours, unchunked: 1 engine call)": lambda: (
            ours.engine.encode_batch_fast([text], add_special_tokens=False)[0].ids
        ),
    }
    timings = {name: Timings() for name in encoders}
    for repeat in range(args.repeats):
        order = list(encoders) if repeat % 2 == 0 else list(reversed(encoders))
        for name in order:
            wall, cpu = time.perf_counter(), time.process_time()
            encoders[name]()
            timings[name].wall.append(time.perf_counter() - wall)
            timings[name].cpu.append(time.process_time() - cpu)

    print(
        f"text: {args.text} ({megabytes:.2f} MB), {len(ours_ids):,} tokens, "
        f"{megabytes * 1e6 / len(ours_ids):.2f} bytes/token"
    )
    print(f"tokenizer: vocab_size={ours.vocab_size} sha256={ours.sha256[:16]}… (identical ids on both sides)")
    print(
        f"threads: ours = engine pool of {args.threads} (RAYON_NUM_THREADS={args.threads}) over "
        f"{len(chunk_text(text))} chunks; HF baseline = 1 (one sequence is encoded on the calling thread)"
    )
    print(
        f"machine: {os.cpu_count()} cores, 1-min load average {os.getloadavg()[0]:.2f} "
        "(other processes on the cores skew both sides)"
    )
    print(
        f"{'encoder':<34} {'median MB/s':>10} {'best MB/s':>10} {'cpu/wall':>10}   ({args.repeats} repeats)"
    )
    for name, t in timings.items():
        print(t.row(name, megabytes))
    ours_t, hf_t = timings["ours: BPETokenizer.encode"], timings["HF: Tokenizer.encode (baseline)"]
    median_ratio = statistics.median(hf_t.wall) / statistics.median(ours_t.wall)
    best_ratio = min(hf_t.wall) / min(ours_t.wall)
    print(f"ratio ours/HF: {median_ratio:.2f}x (median), {best_ratio:.2f}x (best)  [target >= 1.0]")
    return 0 if median_ratio >= 1.0 or args.quick else 1  # --quick's text is too small to judge


def cached_tokenizer(text: str, vocab_size: int) -> BPETokenizer:
    """Train on `text` once and keep the result under /tmp, keyed by the text's hash and vocab_size."""
    from neuroshard.tokenizer import BPETokenizer

    path = CACHE_DIR / f"tokenizer-{hashlib.sha256(text.encode()).hexdigest()[:12]}-v{vocab_size}.json"
    if path.exists():
        return BPETokenizer.load(path)
    start = time.perf_counter()
    tokenizer = BPETokenizer.train([text], vocab_size)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tokenizer.save(path)
    print(f"(trained vocab {tokenizer.vocab_size} in {time.perf_counter() - start:.1f}s, cached at {path})")
    return tokenizer


def plain_hf_tokenizer(ours: BPETokenizer) -> Tokenizer:
    """A Tokenizer assembled as the HF docs describe, from our merges, with default BPE options."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from neuroshard.tokenizer import BYTE_OFFSET, SPLIT_PATTERN
    from neuroshard.tokenizer.bpe import byte_alphabet

    alphabet = byte_alphabet()  # ByteLevel's character per byte (tests/tokenizer check it against HF)

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {spell(ours.token_bytes(i)): i for i in range(BYTE_OFFSET, ours.vocab_size)}
    merges = [(spell(ours.token_bytes(a)), spell(ours.token_bytes(b))) for a, b in ours.merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


if __name__ == "__main__":
    sys.exit(main())
