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
   trains on them as an honest one would, and answers with the gradient negated, or with zeros),
   against the clean run (share 0). Stage 1 is one model that trains on every micro-batch
   whoever answers (as its stage's rounds average every replica's work, the hostile one's
   included), so the figures measure what the answers do to stage 0 alone. Seeded; medians are
   not needed: every figure is deterministic.
3. how far honest answers to one micro-batch are apart: two stage-1 replicas from one start, one
   sent 1 micro-batch in `--skew` (the router sends most to the faster), answer the same held-out
   micro-batches through the default codec every so often; the smallest cosine and largest norm
   ratio of the whole micro-batch (what the audit compares, `node.pipeline.answers_disagree`),
   the smallest cosine of one sequence, and the loss gap; and, beside them, the first replica's
   answer under bf16 autocast against its fp32 one (same weights: what precision alone moves).
4. audits (`PipelineClient._audit`): the same hostile replica, 50× faster, drawn by the real
   router among two honest ones, answers with the gradient negated (every answer, or 1 in 8); a
   share of the answers is checked against another replica's with `answers_disagree` and the
   outvoted one banned through the router's `blamed`, doubling. Time is simulated: one driver step
   every `--step-s` seconds. Stage 1 is again one model; the answers to audit copies are computed
   from it without stepping it.

    .venv/bin/python bench/bench_pipeline_poison.py [--steps 300] [--seeds 2] [--shares 0,0.125,0.5,1]
        [--attacks negate,zeros] [--audit-rates 0,0.0625,0.25] [--step-s 0.5] [--json] [--quick]
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

from neuroshard.node.actcodec import DEFAULT_CODEC
from neuroshard.node.device import Placement
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.p2p.pipeline import NextStageRouter
from neuroshard.node.p2p.pipeline_wire import decode_gradient, encode_gradient
from neuroshard.node.pipeline import (
    AUDIT_MAX_NORM_RATIO,
    AUDIT_MIN_COSINE,
    answers_disagree,
    remote_loss,
    stage_inner_step,
)
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
    stage1 = DiLoCo(build_stage(cfg, 1, 2), diloco)
    draw = random.Random(seed + 99)

    def downstream(hidden: Tensor, labels: Tensor) -> tuple[Tensor, float]:
        grad, loss = stage_inner_step(stage1, hidden, labels, None)
        if draw.random() < share:
            return (-grad if attack == "negate" else torch.zeros_like(grad)), loss
        return grad, loss

    driver = DiLoCo(build_stage(cfg, 0, 2), diloco, loss_fn=remote_loss(downstream))
    for step in range(steps):
        driver.inner_step(*_batch(tokens.train, seed, step, b, t))
    return measure_loss([driver.model, stage1.model], tokens.held_out, b, t, max_batches=EVAL_BATCHES).loss


def _setup(tokens: Tokens, seed: int, steps: int, t: int) -> tuple[ModelConfig, DiLoCoConfig, DiLoCo]:
    cfg = ModelConfig.named("tiny", vocab_size=512, max_seq_len=t)
    cfg = ModelConfig(**{**cfg.to_dict(), "init_seed": seed})
    diloco = DiLoCoConfig(inner_steps=steps, warmup_steps=min(20, steps), total_steps=steps)
    return cfg, diloco, DiLoCo(build_stage(cfg, 1, 2), diloco)


def honest_spread(
    tokens: Tokens, seed: int, steps: int, b: int, t: int, every: int, skew: int
) -> list[dict[str, float]]:
    """Two honest stage-1 replicas, one start, the second sent 1 micro-batch in `skew`; every
    `every` steps their answers to 4 held-out micro-batches (each through the default codec)
    compared."""
    cfg, diloco, first = _setup(tokens, seed, steps, t)
    second = DiLoCo(copy.deepcopy(first.model), diloco)
    turn = [0]

    def downstream(hidden: Tensor, labels: Tensor) -> tuple[Tensor, float]:
        turn[0] += 1
        return stage_inner_step(second if turn[0] % skew == 0 else first, hidden, labels, None)

    def answer(replica: DiLoCo, hidden: Tensor, labels: Tensor, bf16: bool = False) -> tuple[Tensor, float]:
        placement = Placement(device=torch.device("cpu"), precision="bf16") if bf16 else None
        copied = DiLoCo(copy.deepcopy(replica.model), diloco, placement=placement)
        grad, loss = stage_inner_step(copied, hidden, labels, None)
        return decode_gradient(encode_gradient(grad, DEFAULT_CODEC), tuple(grad.shape), DEFAULT_CODEC), loss

    driver = DiLoCo(build_stage(cfg, 0, 2), diloco, loss_fn=remote_loss(downstream))
    rows = []
    for step in range(steps + 1):
        if step % every == 0:
            worst = {"step": float(step), "cosine": 1.0, "seq_cosine": 1.0, "ratio": 1.0, "loss_gap": 0.0,
                     "bf16_cosine": 1.0}  # fmt: skip
            for probe in range(4):
                ids, labels = _batch(tokens.held_out, seed, 10_000 + probe, b, t)
                with torch.no_grad():
                    hidden = driver.model(ids)
                (ga, la), (gb, lb) = answer(first, hidden, labels), answer(second, hidden, labels)
                a, bb = ga.flatten(1), gb.flatten(1)
                na, nb = a.norm(dim=1), bb.norm(dim=1)
                seq = float(((a * bb).sum(1) / (na * nb)).min())
                cos = float((a * bb).sum() / (a.norm() * bb.norm()))
                whole = float(max(a.norm() / bb.norm(), bb.norm() / a.norm()))
                worst["cosine"] = min(worst["cosine"], cos)
                worst["seq_cosine"] = min(worst["seq_cosine"], seq)
                worst["ratio"] = max(worst["ratio"], whole)
                worst["loss_gap"] = max(worst["loss_gap"], abs(la - lb) / min(la, lb))
                g16, _ = answer(first, hidden, labels, bf16=True)
                bf16_cos = float((ga * g16).sum() / (ga.norm() * g16.norm()))
                worst["bf16_cosine"] = min(worst["bf16_cosine"], bf16_cos)
            rows.append(worst)
        if step < steps:
            driver.inner_step(*_batch(tokens.train, seed, step, b, t))
    return rows


HONEST = ("aa" * 32, "bb" * 32)


def audited_loss(
    tokens: Tokens, rate: float, poison_every: int, seed: int, steps: int, b: int, t: int, step_s: float
) -> tuple[float, float, int]:
    """(held-out loss, share of the driver's steps that used a negated gradient, times the hostile
    replica was outvoted) with the hostile replica drawn by the router and a share `rate` of the
    answers audited; it negates one answer in `poison_every`."""
    cfg, diloco, stage1 = _setup(tokens, seed, steps, t)
    router = NextStageRouter(ban_s=30.0, busy_s=0.2, rng=random.Random(seed))
    draw = random.Random(seed + 7)
    clock = [0.0]
    used_poison = [0]
    caught = [0]
    answered = [0]
    falsified: set[str] = set()
    """Who negated its answer to the micro-batch in progress."""

    def ask(wallet: str, hidden: Tensor, labels: Tensor, audit: bool = False) -> tuple[Tensor, float]:
        # An audit copy trains the replica asked, whose Δ its stage's round averages with the
        # others': a throwaway copy here, so the one stage-1 model steps once per micro-batch.
        replica = DiLoCo(copy.deepcopy(stage1.model), diloco) if audit else stage1
        grad, loss = stage_inner_step(replica, hidden, labels, None)
        router.succeeded(wallet, tokens=50_000 if wallet == HOSTILE else 1000, seconds=1.0)
        if wallet != HOSTILE:
            return grad, loss
        answered[0] += 1
        if answered[0] % poison_every:
            return grad, loss
        falsified.add(wallet)
        return -grad, loss

    def downstream(hidden: Tensor, labels: Tensor) -> tuple[Tensor, float]:
        everyone = [*HONEST, HOSTILE]
        falsified.clear()
        pick = router.choose(everyone, clock[0])
        assert pick is not None  # the honest replicas are never banned here
        answers = {pick: ask(pick, hidden, labels)}
        if draw.random() < rate:
            others = [w for w in router.ranking(everyone, clock[0]) if w != pick]
            draw.shuffle(others)
            for wallet in others[:2]:
                answers[wallet] = ask(wallet, hidden, labels, audit=True)
                if len(answers) == 2 and answers_disagree(answers[pick][0], answers[wallet][0]) is None:
                    break
            if HOSTILE in answers and len(answers) == 3:
                honest_ones = [w for w in answers if w != HOSTILE]
                if answers_disagree(answers[honest_ones[0]][0], answers[honest_ones[1]][0]) is None and all(
                    answers_disagree(answers[HOSTILE][0], answers[w][0]) is not None for w in honest_ones
                ):
                    router.blamed(HOSTILE, clock[0])
                    caught[0] += 1
                    pick = honest_ones[0]
        used_poison[0] += pick in falsified
        return answers[pick]

    driver = DiLoCo(build_stage(cfg, 0, 2), diloco, loss_fn=remote_loss(downstream))
    for step in range(steps):
        clock[0] = step * step_s
        driver.inner_step(*_batch(tokens.train, seed, step, b, t))
    loss = measure_loss([driver.model, stage1.model], tokens.held_out, b, t, max_batches=EVAL_BATCHES).loss
    return loss, used_poison[0] / steps, caught[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--shares", default="0,0.125,0.5,1")
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--audit-rates", default="0,0.0625,0.25")
    parser.add_argument("--step-s", type=float, default=0.5, help="simulated seconds per driver step")
    parser.add_argument("--spread-every", type=int, default=50)
    parser.add_argument(
        "--skew", type=int, default=8, help="section 3: the second replica gets 1 micro-batch in this"
    )
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object last")
    args = parse_with_quick(
        parser,
        steps=10,
        seeds=1,
        shares="0,1",
        attacks="zeros",
        seq_len=16,
        audit_rates="0,1",
        spread_every=5,
    )
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

    print(
        f"3. honest answers apart, tiny stage 1, two replicas from one start, the second sent 1 micro-batch "
        f"in {args.skew} ({args.steps} steps, each answer through {DEFAULT_CODEC}'s gradient code); the "
        f"audit's bounds: cosine >= {AUDIT_MIN_COSINE}, norm ratio <= {AUDIT_MAX_NORM_RATIO:g}"
    )
    print(
        f"   {'seed':>4} {'step':>5} {'min cos':>8} {'max ratio':>9} {'min cos, 1 sequence':>19} {'loss gap':>8} "
        f"{'bf16 vs fp32 cos':>16}"
    )
    spread: list[dict[str, float]] = []
    for seed in range(args.seeds):
        for row in honest_spread(
            tokens, seed, args.steps, args.batch, args.seq_len, args.spread_every, args.skew
        ):
            spread.append(row)
            print(
                f"   {seed:>4} {row['step']:>5.0f} {row['cosine']:>8.3f} {row['ratio']:>9.3f} "
                f"{row['seq_cosine']:>19.3f} {row['loss_gap']:>8.4f} {row['bf16_cosine']:>16.4f}",
                flush=True,
            )

    print(
        f"4. audits: a hostile replica 50x faster than 2 honest ones, negating its answers; "
        f"{args.steps} steps, one every {args.step_s:g} s (simulated), bans of 30 s doubling"
    )
    print(
        f"   {'negates':>8} {'audit rate':>10} {'mean loss':>10} {'÷ clean':>8} {'poisoned steps':>14} {'caught':>6}"
    )
    clean = statistics.fmean(losses[attacks[0]][0.0])
    audits: dict[str, dict[str, list[float]]] = {}
    for every, label in ((1, "all"), (8, "1 in 8")):
        for rate in sorted({float(x) for x in args.audit_rates.split(",")}):
            runs = [
                audited_loss(tokens, rate, every, seed, args.steps, args.batch, args.seq_len, args.step_s)
                for seed in range(args.seeds)
            ]
            loss = statistics.fmean(r[0] for r in runs)
            poisoned = statistics.fmean(r[1] for r in runs)
            caught = statistics.fmean(r[2] for r in runs)
            audits.setdefault(label, {})[str(rate)] = [loss, poisoned, caught]
            print(
                f"   {label:>8} {rate:>10g} {loss:>10.4f} {loss / clean:>8.3f} {poisoned:>14.3f} {caught:>6.1f}",
                flush=True,
            )
    if args.json:
        print(json.dumps({
            "routing": {str(n): share for n, share in routing.items()},
            "losses": {a: {str(s): v for s, v in by.items()} for a, by in losses.items()},
            "honest_spread": spread,
            "audits": audits,
        }))  # fmt: skip


if __name__ == "__main__":
    main()
