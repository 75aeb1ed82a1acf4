"""Screening cost at a real stage size: `screen_round` against one bare `torch.median` call.

A closed round of the `small` stage (29.5M values) with 5 contributions: honest-looking Δs
(a shared direction plus per-replica noise, like DiLoCo pseudo-gradients against one θ) and one
sign-flipped. Each repeat times, interleaved on the same stack:

- ours: ``validation.screen_round`` — structural checks, reference median, statistics,
  copy check, verdicts;
- baseline: one ``torch.median(stack, dim=0)``, the bare cost of the reference alone;
- the aggregation rule the network applies afterwards (``aggregate("default")``, the
  coordinate median below 5 rows, centered clipping from it from 5; the trimmed mean until
  2026-11-27), with τ the median distance and one iteration, and as a network.toml gets it
  since 2026-12-06 (``aggregation.DEFAULT_CLIPPING``: τ × 1.25, 3 iterations).

    .venv/bin/python bench/bench_screening.py [--numel 29_500_000] [--rows 5] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from common import parse_with_quick

from neuroshard.node.aggregation import DEFAULT_CLIPPING, aggregate, network_rule
from neuroshard.node.validation import screen_round


def round_of(numel: int, rows: int, seed: int) -> dict[str, torch.Tensor]:
    """`rows` contributions: rows − 1 honest-looking, the last one sign-flipped."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=gen)
    deltas = {f"w{i}": common + 0.8 * torch.randn(numel, generator=gen) for i in range(rows - 1)}
    deltas[f"w{rows - 1}"] = -deltas["w0"]
    return deltas


def timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=29_500_000, help="values per contribution (small: 29.5M)")
    p.add_argument("--rows", type=int, default=5, help="contributions in the round")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = parse_with_quick(p, numel=200_000, repeats=1)
    torch.set_num_threads(args.threads)
    deltas = round_of(args.numel, args.rows, seed=0)
    stack = torch.stack(list(deltas.values()))
    verdicts = screen_round(deltas, (args.numel,))
    refused = sorted(w for w, v in verdicts.items() if not v.ok)
    print(f"verdicts: refused {refused} ({', '.join(verdicts[w].code for w in refused)})")
    network_default = network_rule("default", 0, DEFAULT_CLIPPING)
    times: dict[str, list[float]] = {
        "screen_round": [],
        "torch.median": [],
        "aggregate(default)": [],
        "network.toml default": [],
    }
    for _ in range(args.repeats):
        times["screen_round"].append(timed(lambda: screen_round(deltas, (args.numel,))))
        times["torch.median"].append(timed(lambda: torch.median(stack, dim=0)))
        times["aggregate(default)"].append(timed(lambda: aggregate("default", stack)))
        times["network.toml default"].append(timed(lambda: network_default(stack)))
    print(
        f"{args.rows} contributions x {args.numel:,} values, {args.threads} torch thread(s), "
        f"{args.repeats} interleaved repeats, load average {os.getloadavg()[0]:.2f} at the end"
    )
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        print(f"  {name:20s} median {medians[name]:6.2f} s  (min {min(ts):.2f}, max {max(ts):.2f})")
    print(f"screen_round / torch.median = {medians['screen_round'] / medians['torch.median']:.3f}")


if __name__ == "__main__":
    main()
