"""Every attack on the real wire: 4 honest `neuroshard-node` processes + 1 `neuroshard-adversary --attack NAME`.

For each attack this runs `neuroshard-swarm --nodes 5 --byzantine 1 --attack NAME` (the
partitioned round over signed HTTP, int8, per-part screening + the default robust rule) and
reads the round lines: in how many honest round records the attacker was refused (and with
which reason: a part's screening verdict, a refused commitment, a proven cheat), how many
honest contributions were refused, whether the honest replicas agreed on θ every round, and
their loss in the first and last round — next to a clean run of the 4 honest nodes alone.
copy, equivocate and nan are not mounted in the partitioned round (adversary/contributions.py):
their attacker sends its honest Δ. The adaptive families (``attacks.ADAPTIVE``) run at the
realistic knowledge level: the attacker commits to the largest parameter its own estimate says
passes the per-part screening (honest Δ in round 0, before any aggregate is revealed).

    .venv/bin/python bench/bench_swarm_attacks.py [--rounds 5] [--inner-steps 20] [--attacks sign_flip,scale]
    .venv/bin/python bench/bench_swarm_attacks.py --rounds 1 --repeat 5 --attacks sign_flip --no-clean  # round 0 only
    .venv/bin/python bench/bench_swarm_attacks.py --attacks alie_search,edge,mimic,ipm_search,minmax_std
    .venv/bin/python bench/bench_swarm_attacks.py --anchor-floor 0.1 --attacks sign_flip,alie_search,edge,minsum_sign
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from common import BENCH_KEY, DEFAULT_TEXT, bench_dataset, parse_with_quick, quick_dataset

from neuroshard.adversary.attacks import ATTACKS
from neuroshard.node.wallet import Wallet
from neuroshard.testing.ports import free_port_block

ROUND = re.compile(r"^\[(\d+)\] p2p round=(\d+) (.*)$")
LOSS = re.compile(r"^\[(\d+)\] step=\d+ round=\d+ loss=([0-9.]+) ")
EXCHANGE = re.compile(r"exchange ([0-9.]+)(?: \(commit ([0-9.]+)\))?")
"""The round line's exchange seconds (the whole partitioned round) and the commit phase's share."""
AGREE = re.compile(r"^\[swarm\] round \d+: (\d+)/(\d+) (?:honest )?nodes agree")


def run(dataset: str, attack: str | None, args: argparse.Namespace) -> str:
    swarm = Path(sys.executable).with_name("neuroshard-swarm")
    nodes = 4 if attack is None else 5
    with tempfile.TemporaryDirectory() as home:
        command = [
            str(swarm), "--nodes", str(nodes), "--home", home, "--threads", "1",
            "--inner-steps", str(args.inner_steps), "--max-steps", str(args.rounds * args.inner_steps),
            "--data", dataset, "--publisher-key", bytes(BENCH_KEY.verify_key).hex(),
            "--base-port", str(args.base_port), "--verifier-port", str(args.base_port - 1),
            *([] if attack is None else ["--byzantine", "1", "--attack", attack]),
            "--", "--model-size", "micro", "--batch-size", "4", "--seq-len", "64",
            "--log-every", str(args.inner_steps), "--min-peers", str(nodes - 1), "--warmup-steps", "0",
            *([] if args.anchor_floor is None else ["--anchor-floor", str(args.anchor_floor)]),
        ]  # fmt: skip
        out = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            sys.exit(f"swarm failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-2000:]}")
        keys = [
            Wallet.from_token((Path(home) / "swarm" / f"node{i}" / "token").read_text().strip())
            for i in range(nodes)
        ]
    bad = keys[-1].public_key_hex[:12] if attack is not None else None
    return summarise(out.stdout.splitlines(), bad, args.rounds)


def summarise(lines: list[str], bad: str | None, rounds: int) -> str:
    records = [
        (int(m[1]), m[3]) for line in lines if (m := ROUND.match(line)) and (bad is None or int(m[1]) < 4)
    ]
    aggregated = [text for _, text in records if not text.startswith("late")]
    caught: Counter[str] = Counter()
    for text in aggregated:
        if bad is None:
            continue
        # A screening verdict names the part it was reached on: "part 3: norm_ratio: ...".
        if m := re.search(rf"rejected {bad}: (?:part \d+: )?([a-z_0-9]+)", text):
            caught[m[1]] += 1
        elif f"equivocator {bad}" in text:
            caught["equivocation"] += 1
    honest_refused = sum(len(re.findall(r"rejected ", t)) for t in aggregated) - sum(
        1 for t in aggregated if bad and f"rejected {bad}" in t
    )
    agreed = [m for line in lines if (m := AGREE.match(line))]
    full = sum(a == b for a, b in (m.groups() for m in agreed))
    losses: dict[int, list[float]] = {}
    for line in lines:
        if (m := LOSS.match(line)) and (bad is None or int(m[1]) < 4):
            losses.setdefault(int(m[1]), []).append(float(m[2]))
    first = statistics.mean(v[0] for v in losses.values())
    last = statistics.mean(v[-1] for v in losses.values())
    reasons = ", ".join(f"{k} {v}" for k, v in caught.most_common()) or "-"
    n = len(aggregated)
    timings = [m for text in aggregated if (m := EXCHANGE.search(text))]
    exchange = statistics.median(float(m[1]) for m in timings)
    commit = statistics.median(float(m[2] or 0) for m in timings)
    return (
        f"| {sum(caught.values())}/{n} | {reasons} | {honest_refused} | {full}/{len(agreed)} | "
        f"{first:.3f} → {last:.3f} | {exchange:.2f} ({commit:.2f}) |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--repeat", type=int, default=1, help="runs per attack (one table row each)")
    parser.add_argument("--no-clean", action="store_true", help="skip the run of the 4 honest nodes alone")
    parser.add_argument(
        "--anchor-floor",
        type=float,
        default=None,
        help="anchor every round after the first (neuroshard-node --anchor-floor; a network.toml's "
        "default is 0.1): the nodes take no network definition, so none unless given",
    )
    parser.add_argument(
        "--base-port",
        type=int,
        default=47300,
        help="first port of the swarm's nodes (its verifier: the one below)",
    )
    # --quick (CI) takes free ports: the fixed default may be held by another run on the machine.
    quick_ports = free_port_block(7)
    args = parse_with_quick(
        parser, rounds=2, inner_steps=3, attacks="sign_flip", no_clean=True, base_port=quick_ports + 1
    )
    dataset = (quick_dataset() if args.quick else bench_dataset(DEFAULT_TEXT)).location
    print(f"text: {'the quick text' if args.quick else DEFAULT_TEXT}")
    anchored = "" if args.anchor_floor is None else f", anchored from round 1 (floor {args.anchor_floor})"
    print(f"micro model, batch 4x64, H={args.inner_steps}, {args.rounds} rounds, 1 thread per node{anchored}")
    print(
        "| attack | honest records refusing it | by reason | honest contributions refused | rounds honest agree "
        "| honest loss first → last round | exchange s, median (commit phase) |"
    )
    print("|---|---|---|---|---|---|---|")
    if not args.no_clean:
        print(f"| none (4 honest alone) {run(dataset, None, args)}", flush=True)
    for attack in filter(None, args.attacks.split(",")):  # --attacks "": the clean run only
        for _ in range(args.repeat):
            print(f"| {attack} {run(dataset, attack, args)}", flush=True)


if __name__ == "__main__":
    main()
