"""Compute utilisation of a loopback swarm: time in inner steps / wall time, per node.

DiLoCo's promise is that communication is rare: at the default H a replica should spend
nearly all its time computing. This runs `neuroshard-swarm` (real node processes on
127.0.0.1, the signed peer protocol, int8 contributions) and reads each node's closing
`compute utilisation=` line, which the trainer measures around its inner steps.

    .venv/bin/python bench/bench_swarm_utilisation.py [--nodes 4] [--inner-steps 100] [--max-steps 300]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import BENCH_KEY, DEFAULT_TEXT, bench_dataset, parse_with_quick, quick_dataset

from neuroshard.testing.ports import free_port_block

UTILISATION = re.compile(r"^\[(\d+)\] compute utilisation=([0-9.]+) \(([0-9.]+) s of ([0-9.]+) s")
BREAKDOWN = re.compile(r"^\[(\d+)\] time breakdown: (.*)$")
PART = re.compile(r"(\w+(?: \w+)*) (-?[0-9.]+) s")
"""One 'name seconds s' of a breakdown; names may have words ("final checkpoint 1.20 s")."""
ROUND = re.compile(
    # "exchange 0.17 (commit 0.05)": the commit phase's share of the partitioned round
    r"^\[(\d+)\] p2p round=(\d+) .*\(([0-9.]+) s: exchange ([0-9.]+)(?: \(commit [0-9.]+\))?, "
    r"step ([0-9.]+), vote ([0-9.]+)\)"
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=100, help="H (neuroshard-node's default is 100)")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument(
        "--round-close",
        default="majority",
        choices=("majority", "full"),
        help="the nodes' --round-close (full: every replica runs H steps, as before the majority rule)",
    )
    args = parse_with_quick(parser, nodes=2, inner_steps=4, max_steps=8)

    dataset = quick_dataset() if args.quick else bench_dataset(DEFAULT_TEXT)
    print(f"text: {'the quick text' if args.quick else DEFAULT_TEXT}")
    swarm = Path(sys.executable).with_name("neuroshard-swarm")
    base = free_port_block(args.nodes + 1)
    with tempfile.TemporaryDirectory() as home:
        command = [
            str(swarm), "--nodes", str(args.nodes), "--max-steps", str(args.max_steps),
            "--inner-steps", str(args.inner_steps), "--home", home, "--threads", "1",
            "--data", dataset.location, "--publisher-key", bytes(BENCH_KEY.verify_key).hex(),
            "--base-port", str(base), "--verifier-port", str(base + args.nodes),
            "--", "--model-size", args.model_size, "--batch-size", "8", "--seq-len", "128",
            "--round-close", args.round_close,
        ]  # fmt: skip
        out = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"swarm failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-2000:]}")
    agreed = re.findall(r"\[swarm\] round (\d+): (\d+)/(\d+) nodes agree", out.stdout)
    rows = [m.groups() for line in out.stdout.splitlines() if (m := UTILISATION.match(line))]
    print(
        f"{args.nodes} nodes x 1 thread on this machine's cores, model {args.model_size}, batch 8x128, "
        f"H={args.inner_steps}, {args.max_steps} steps, --round-close {args.round_close}; "
        f"rounds with full hash agreement: "
        f"{sum(a == b for _, a, b in agreed)}/{len(agreed)}"
    )
    for node, util, inner, wall in sorted(rows):
        print(f"  node {node}: utilisation {float(util):.3f} ({inner} s of {wall} s wall in inner steps)")
    print_breakdown(out.stdout)
    early = re.findall(r"^\[(\d+)\] round=\d+ closed early after (\d+) of", out.stdout, re.MULTILINE)
    print(
        f"rounds closed early (a majority of the stage had pushed): {len(early)}"
        + "".join(f"; node {node} after {steps} steps" for node, steps in early)
    )
    median = statistics.median(float(u) for _, u, _, _ in rows)
    print(f"median compute utilisation = {median:.3f} (target >= 0.95 at the default H)")


def print_breakdown(stdout: str) -> None:
    """Each node's time outside inner steps, by part (trainer.TrainResult.seconds), with its round
    hook split by the round reports: exchange, of which waiting for the slowest replica (a node's
    exchange time minus the shortest of that round, which is the exchange of the replica everyone
    waited for), decode/screen/aggregate/outer step, hash vote, and the rest of the hook (receipt)."""
    parts = {m[1]: dict(PART.findall(m[2])) for line in stdout.splitlines() if (m := BREAKDOWN.match(line))}
    reports = [m.groups() for line in stdout.splitlines() if (m := ROUND.match(line))]
    shortest: dict[str, float] = {}
    for _, r, _, exchange, _, _ in reports:
        shortest[r] = min(shortest.get(r, float("inf")), float(exchange))
    print("where the time outside inner steps went (seconds over the run):")
    for node, times in sorted(parts.items()):
        mine = [x for x in reports if x[0] == node]
        total, exchange, step, vote = (sum(float(x[i]) for x in mine) for i in (2, 3, 4, 5))
        waiting = sum(float(x[3]) - shortest[x[1]] for x in mine)
        receipt = float(times.get("round", 0.0)) - total
        print(
            f"  node {node}: {', '.join(f'{k} {float(v):.2f}' for k, v in times.items() if k != 'inner')}; "
            f"round = exchange {exchange:.2f} (waiting for the slowest {waiting:.2f}) + step {step:.2f} "
            f"+ vote {vote:.2f} + receipt/other {receipt:.2f}"
        )


if __name__ == "__main__":
    main()
