"""A hostile next-stage replica's gradients against a driver (issue 17, hostile neighbours; issue
19, membership): what one listed key that answers at once can do to a pipeline (README, "In a
pipeline": not closed).

A stage > 0 replica answers each micro-batch with ∂loss/∂hidden, which the sender's step applies.
Nothing but the overflow check (`node.pipeline`) holds that answer to anything at the time, and a
sender draws next-stage replicas ∝ their measured throughput, so a replica that answers at once,
computing nothing, draws nearly every micro-batch. This prints:

1. the share of a sender's micro-batches such a replica draws from the real `NextStageRouter`,
   answering 50× faster than n honest replicas (n = 1, 4, 16);
2. the held-out loss of stages 0 and 1 of the tiny model trained in-process for `--steps` inner
   steps when that share of the driver's micro-batches is answered by a hostile replica (it
   trains a copy of stage 1 on them, as an honest one would, and answers with the gradient
   negated, or with zeros), against the clean run (share 0). Seeded; medians are not needed:
   every figure is deterministic.

    .venv/bin/python bench/bench_pipeline_poison.py [--steps 300] [--seeds 2] [--shares 0,0.125,0.5,1]
        [--attacks negate,zeros] [--json] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time

import torch
from bench_pipeline import EVAL_BATCHES, Tokens, _batch, _tokens
from common import bench_dataset, fresh_clone_text, parse_with_quick, quick_dataset
from torch import Tensor

from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.p2p.pipeline import NextStageRouter
from neuroshard.node.pipeline import remote_loss, stage_inner_step
from neuroshard.verifier.evaluate import measure_loss

HOSTILE = "ff" * 32
ATTACKS = ("negate", "zeros")


def drawn_share(honest: int, draws: int = 20_000) -> float:
    """The share of draws a replica 50× faster than `honest` others gets from the sender's router."""
    router = NextStageRouter(ban_s=30.0, busy_s=0.2, rng=random.Random(0))
    wallets = [f"{i:064x}" for i in range(honest)]
    for wallet in wallets:
        router.succeeded(wallet, tokens=1000, seconds=1.0)
    router.succeeded(HOSTILE, tokens=50_000, seconds=1.0)
    candidates = [*wallets, HOSTILE]
    hits = sum(router.choose(candidates, 0.0) == HOSTILE for _ in range(draws))
    return hits / draws


def poisoned_loss(tokens: Tokens, share: float, attack: str, seed: int, steps: int, b: int, t: int) -> float:
    """Held-out loss of stages 0 and 1 after `steps` driver steps, `share` of them answered by the
    hostile replica with `attack`."""
    cfg = ModelConfig.named("tiny", vocab_size=512, max_seq_len=t)
    cfg = ModelConfig(**{**cfg.to_dict(), "init_seed": seed})
    diloco = DiLoCoConfig(inner_steps=steps, warmup_steps=min(20, steps), total_steps=steps)
    honest = DiLoCo(build_stage(cfg, 1, 2), diloco)
    hostile = DiLoCo(copy.deepcopy(honest.model), diloco)
    draw = random.Random(seed + 99)

    def downstream(hidden: Tensor, labels: Tensor) -> tuple[Tensor, float]:
        if draw.random() < share:
            grad, loss = stage_inner_step(hostile, hidden, labels, None)
            return (-grad if attack == "negate" else torch.zeros_like(grad)), loss
        return stage_inner_step(honest, hidden, labels, None)

    driver = DiLoCo(build_stage(cfg, 0, 2), diloco, loss_fn=remote_loss(downstream))
    for step in range(steps):
        driver.inner_step(*_batch(tokens.train, seed, step, b, t))
    return measure_loss([driver.model, honest.model], tokens.held_out, b, t, max_batches=EVAL_BATCHES).loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--shares", default="0,0.125,0.5,1")
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object last")
    args = parse_with_quick(parser, steps=10, seeds=1, shares="0,1", attacks="zeros", seq_len=16)
    torch.set_num_threads(args.threads)
    attacks = args.attacks.split(",")
    if not set(attacks) <= set(ATTACKS):
        parser.error(f"--attacks must be among {', '.join(ATTACKS)}")
    shares = sorted({float(x) for x in args.shares.split(",")} | {0.0})

    print(
        "1. share of micro-batches a replica answering 50x faster draws (20,000 draws of the sender's router)"
    )
    routing = {n: drawn_share(n) for n in (1, 4, 16)}
    for n, share in routing.items():
        print(f"   {n:2d} honest replicas: {share:.3f}")

    dataset = quick_dataset() if args.quick else bench_dataset(fresh_clone_text(2_000_000), 512, 100_000)
    tokens = _tokens(dataset)
    print(
        f"2. held-out loss, tiny model, stages 0 and 1, {args.steps} inner steps, batch {args.batch} x {args.seq_len}"
    )
    losses: dict[str, dict[float, list[float]]] = {}
    for seed in range(args.seeds):
        clean = None
        for attack in attacks:
            for share in shares:
                if share == 0.0 and clean is not None:
                    loss = clean
                else:
                    start = time.monotonic()
                    loss = poisoned_loss(tokens, share, attack, seed, args.steps, args.batch, args.seq_len)
                    print(
                        f"   seed {seed} {attack:6} share {share:<5g} {loss:.4f} ({time.monotonic() - start:.0f} s)",
                        flush=True,
                    )
                    clean = loss if share == 0.0 else clean
                losses.setdefault(attack, {}).setdefault(share, []).append(loss)
    print(f"   {'attack':6} {'share':>6} {'mean loss':>10} {'÷ clean':>8}")
    for attack, by_share in losses.items():
        base = statistics.fmean(by_share[0.0])
        for share, values in by_share.items():
            print(
                f"   {attack:6} {share:>6g} {statistics.fmean(values):>10.4f} {statistics.fmean(values) / base:>8.3f}"
            )
    if args.json:
        print(json.dumps({
            "routing": {str(n): share for n, share in routing.items()},
            "losses": {a: {str(s): v for s, v in by.items()} for a, by in losses.items()},
        }))  # fmt: skip


if __name__ == "__main__":
    main()
