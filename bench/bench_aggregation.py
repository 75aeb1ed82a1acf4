"""Every aggregation rule side by side with ByzFL's implementation of it: speed and outputs.

ByzFL (Allouah et al., EPFL; ``pip install byzfl``, or ``pip install -e .[bench]``) is installed
for this benchmark only. Its package ``__init__`` imports its training benchmark, which needs
torchvision; only its aggregators are loaded here (``load_byzfl``), so torchvision is not needed.

n = 16 contributions of d = 10M float32 (--quick: d = 100k), one torch thread, the rules
interleaved (ours, theirs, ours, …) in every repeat so a change in machine load hits both, median
seconds per call. Our rules are bit-identical under any permutation of the rows and, for the
coordinate-wise ones, per part; ByzFL's are plain torch (torch.sort, torch.mean, cdist), which
makes no such promise. Outputs are compared: max |ours − theirs| / max |theirs| (at d = 10M,
ByzFL's float32 ``cdist`` is off by up to 1.6% in squared distance, ours — a float64 Gram matrix —
by 3e-12, so the two NNMs pick different neighbours for 2 of 16 rows and differ by ~9%). Where the
algorithms differ by design the table says so (the geometric median: ours iterates Weiszfeld from
the coordinate median until it moves < 1e-6 of the spread, ByzFL runs T = 3 smoothed steps from 0;
centered clipping: ByzFL clips around 0 with τ = 100 by default, so both are given the same
center and τ here).

    .venv/bin/python bench/bench_aggregation.py             # n = 16, d = 10M, 5 repeats
    .venv/bin/python bench/bench_aggregation.py --quick     # d = 100k, 2 repeats (CI: runs without ByzFL too)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from common import parse_with_quick
from torch import Tensor

from neuroshard.node import aggregation


def load_byzfl() -> tuple[Any, Any] | None:
    """ByzFL's ``aggregators`` and ``preaggregators`` modules, without its package ``__init__``
    (which imports torchvision for its own training benchmark); None if ByzFL is not installed."""
    spec = importlib.util.find_spec("byzfl")
    if spec is None or not spec.submodule_search_locations:
        return None
    if "byzfl" not in sys.modules:
        package = types.ModuleType("byzfl")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["byzfl"] = package
    aggregators = importlib.import_module("byzfl.aggregators.aggregators")
    preaggregators = importlib.import_module("byzfl.aggregators.preaggregators")
    return aggregators, preaggregators


def cases(
    stack: Tensor, f: int, byzfl: tuple[Any, Any] | None
) -> dict[str, tuple[Callable[[], Tensor], Callable[[], Tensor] | None, str]]:
    """rule → (ours, ByzFL's or None, note)."""
    center = aggregation.coordinate_median(stack)
    tau = float(torch.linalg.vector_norm(stack - center, dim=1).median())
    ours: dict[str, Callable[[], Tensor]] = {
        "mean": lambda: aggregation.mean(stack),
        "trimmed_mean": lambda: aggregation.trimmed_mean(stack, f),
        "median": lambda: aggregation.coordinate_median(stack),
        "krum": lambda: aggregation.krum(stack, f),
        "multi_krum": lambda: aggregation.multi_krum(stack, f),
        "geometric_median": lambda: aggregation.geometric_median(stack),
        "centered_clip": lambda: aggregation.centered_clip(stack, center, tau, iters=1),
        "nnm": lambda: aggregation.nnm(stack, f),
    }
    notes = dict.fromkeys(ours, "")
    notes["geometric_median"] = "different stopping rule and start (module docstring)"
    if byzfl is None:
        return {name: (fn, None, "ByzFL not installed") for name, fn in ours.items()}
    agg, pre = byzfl
    theirs: dict[str, Callable[[], Tensor]] = {
        "mean": lambda: agg.Average()(stack),
        "trimmed_mean": lambda: agg.TrMean(f=f)(stack),
        "median": lambda: agg.Median()(stack),
        "krum": lambda: agg.Krum(f=f)(stack),
        "multi_krum": lambda: agg.MultiKrum(f=f)(stack),
        "geometric_median": lambda: agg.GeometricMedian()(stack),
        "centered_clip": lambda: _byzfl_cc(agg, stack, center, tau),
        "nnm": lambda: pre.NNM(f=f)(stack),
    }
    return {name: (ours[name], theirs[name], notes[name]) for name in ours}


def _byzfl_cc(agg: Any, stack: Tensor, center: Tensor, tau: float) -> Tensor:
    rule = agg.CenteredClipping(L=1, tau=tau)
    rule.m = center.clone()  # its constructor's type check refuses any m (``not A or not B``)
    return rule(stack)


def timed(fn: Callable[[], Tensor]) -> tuple[float, Tensor]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def difference(ours: Tensor, theirs: Tensor) -> float:
    theirs = torch.as_tensor(theirs, dtype=ours.dtype)
    if ours.shape != theirs.shape:
        return float("nan")
    scale = float(theirs.abs().max()) or 1.0
    return float((ours - theirs).abs().max()) / scale


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--d", type=int, default=10_000_000)
    parser.add_argument(
        "--f", type=int, default=3, help="tolerated Byzantine rows (trimmed per side, Krum's f)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rules", default="", help="comma-separated subset (default: all)")
    args = parse_with_quick(parser, d=100_000, repeats=2)
    torch.set_num_threads(1)
    byzfl = load_byzfl()
    gen = torch.Generator().manual_seed(0)
    mu = torch.randn(args.d, generator=gen)
    stack = mu + 0.8 * torch.randn(args.n, args.d, generator=gen)  # (n, d), DiLoCo-like spread
    table = cases(stack, args.f, byzfl)
    names = [r for r in args.rules.split(",") if r] or list(table)
    version = getattr(sys.modules.get("byzfl.aggregators.aggregators"), "__name__", None)
    print(
        f"n = {args.n}, d = {args.d:,}, f = {args.f}, 1 thread, {args.repeats} interleaved repeats; ByzFL: {'loaded' if version else 'not installed'}"
    )
    seconds: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in names}
    outputs: dict[str, tuple[Tensor, Tensor | None]] = {}
    for repeat in range(args.repeats):
        for name in names:
            ours, theirs, _ = table[name]
            order = (
                [("ours", ours), ("theirs", theirs)]
                if repeat % 2 == 0
                else [("theirs", theirs), ("ours", ours)]
            )
            results: dict[str, Tensor] = {}
            for who, fn in order:
                if fn is None:
                    continue
                t, out = timed(fn)
                seconds[name][0 if who == "ours" else 1].append(t)
                results[who] = out
            outputs[name] = (results["ours"], results.get("theirs"))
    print("\n| rule | ours s (median) | ByzFL s (median) | speed vs ByzFL | max abs diff / max abs | note |")
    print("|---|---|---|---|---|---|")
    for name in names:
        ours_s, theirs_s = seconds[name]
        o = statistics.median(ours_s)
        t = statistics.median(theirs_s) if theirs_s else float("nan")
        a, b = outputs[name]
        diff = difference(a, b) if b is not None else float("nan")
        print(f"| {name} | {o:.3f} | {t:.3f} | {t / o:.2f}× | {diff:.2e} | {table[name][2]} |", flush=True)


if __name__ == "__main__":
    main()
