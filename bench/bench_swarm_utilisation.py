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

from common import BENCH_KEY, DEFAULT_TEXT, bench_dataset

UTILISATION = re.compile(r"^\[(\d+)\] compute utilisation=([0-9.]+) \(([0-9.]+) s of ([0-9.]+) s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=100, help="H (neuroshard-node's default is 100)")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--model-size", default="tiny")
    args = parser.parse_args()

    dataset = bench_dataset(DEFAULT_TEXT)
    swarm = Path(sys.executable).with_name("neuroshard-swarm")
    with tempfile.TemporaryDirectory() as home:
        command = [
            str(swarm), "--nodes", str(args.nodes), "--max-steps", str(args.max_steps),
            "--inner-steps", str(args.inner_steps), "--home", home, "--threads", "1",
            "--data", dataset.location, "--publisher-key", bytes(BENCH_KEY.verify_key).hex(),
            "--", "--model-size", args.model_size, "--batch-size", "8", "--seq-len", "128",
        ]  # fmt: skip
        out = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"swarm failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-2000:]}")
    agreed = re.findall(r"\[swarm\] round (\d+): (\d+)/(\d+) nodes agree", out.stdout)
    rows = [m.groups() for line in out.stdout.splitlines() if (m := UTILISATION.match(line))]
    print(
        f"{args.nodes} nodes x 1 thread on this machine's cores, model {args.model_size}, batch 8x128, "
        f"H={args.inner_steps}, {args.max_steps} steps; rounds with full hash agreement: "
        f"{sum(a == b for _, a, b in agreed)}/{len(agreed)}"
    )
    for node, util, inner, wall in sorted(rows):
        print(f"  node {node}: utilisation {float(util):.3f} ({inner} s of {wall} s wall in inner steps)")
    median = statistics.median(float(u) for _, u, _, _ in rows)
    print(f"median compute utilisation = {median:.3f} (target >= 0.95 at the default H)")


if __name__ == "__main__":
    main()
