"""Replay tolerance across precisions: how far honest replays land from a claimed Δ, and the lies.

A node on a GPU trains with bf16 autocast; the verifier replays on its CPU in fp32
(verifier.spotcheck.replay_inner_steps). Bit-equality is gone, so the spot check's acceptance
(cosine and norm ratio, SpotCheckConfig) must come from measurements: this benchmark gives the
distributions of honest replays (same precision, and bf16 claimed against an fp32 replay and
the reverse) and of the lies the verifier already catches, replayed the verifier's way (fp32):

- scaled Δ: the honest bf16 Δ claimed × f (adversary.work_lies.ScaledDeltaTrainer, f = 1.25; also
  1.10 and 1.05 to find the edge);
- other data: bf16 training on windows of the assigned shards in an order seeded by another
  string, claiming the assigned spans (adversary.work_lies.UnassignedDataTrainer);
- skipped steps: the first ¾ (and ½) of the claimed batches trained, all of them claimed;
- made-up Δ: Gaussian noise with the honest Δ's norm (no work at all).

(Made-up losses are not a Δ lie: receipts' losses are self-reported and never compared by the
replay; the verifier measures the loss itself, verifier.evaluator.)

Every replica trains a real data set's assigned batches with the run's DiLoCo (AdamW moments
carried across rounds, committed at each round's start as node.replay does). Each (seed, round)
starts from the fp32 chain's state, so every claim and replay of it starts from the same θ_round
and inner state. A second chain trains the same tokens in bf16 from θ₀: held-out loss of both
after every round (what bf16 does to the model, not only to one Δ). Also an H sweep (one seed):
cross-precision agreement as the round grows longer. Torch threads: 1 (as the verifier).

`--claim-device cuda` trains every bf16 claim (and the bf16 chain) on the GPU with bf16 autocast,
as a contributor's node does, and adds a row for the GPU in fp32 (TF32 matmuls, the node's
default there); the verifier's replays stay on the CPU in fp32.

    .venv/bin/python bench/bench_replay_tolerance.py [--seeds 3] [--rounds 3] [--inner-steps 30]
    python bench/bench_replay_tolerance.py --claim-device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from common import DEFAULT_TEXT, bench_dataset, parse_with_quick, quick_dataset
from torch import Tensor

from neuroshard.adversary.work_lies import DELTA_FACTOR
from neuroshard.data import BatchStream, Dataset, assign_shards
from neuroshard.node.device import Placement, resolve_device
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig, copy_into_parameters, flat_parameters
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.replay import InnerState, capture_inner_state, install_inner_state
from neuroshard.verifier.evaluate import measure_loss
from neuroshard.verifier.replaycheck import CALIBRATED_TOLERANCE
from neuroshard.verifier.spotcheck import SpotCheckConfig, compare_deltas, replay_inner_steps

FP32 = Placement.cpu()
Batches = list[tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Start:
    round: int
    theta: Tensor
    inner: InnerState


def train(
    model_cfg: ModelConfig, diloco_cfg: DiLoCoConfig, start: Start, batches: Batches, placement: Placement
) -> Tensor:
    """Δ of H inner steps on `batches` from `start` at `placement` (replay_inner_steps with a placement)."""
    model = build_stage(model_cfg, 0, 1)
    copy_into_parameters(start.theta, model.parameters())
    engine = DiLoCo(model, diloco_cfg, placement=placement)
    engine.round = start.round
    install_inner_state(engine, start.inner)
    for x, y in batches:
        engine.inner_step(x, y)
    return engine.pseudo_gradient()


def streams(
    dataset: Dataset, wallet: str, held_out: int, batch: int, seq: int
) -> tuple[BatchStream, BatchStream]:
    """The wallet's assigned stream, and the same shards and positions in another window order."""
    order = assign_shards(wallet, dataset.manifest, exclude=(held_out,))
    make = lambda seed: BatchStream(  # noqa: E731
        source=dataset.source,
        manifest=dataset.manifest,
        order=order,
        seed=seed,
        batch_size=batch,
        seq_len=seq,
    )
    return make(wallet), make(f"{wallet}:not-assigned")


def summary(values: list[float]) -> str:
    return f"{min(values):.6f} / {statistics.median(values):.6f} / {max(values):.6f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--seeds", type=int, default=3, help="replicas (wallets), each its own data")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=30)
    parser.add_argument("--sweep", default="30,100,300", help="H values of the round-length sweep (round 1)")
    parser.add_argument("--sweep-seeds", type=int, default=2)
    parser.add_argument("--skip-main", action="store_true", help="only the round-length sweep")
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument(
        "--claim-device", default="cpu", help="where the bf16 claims train: cpu (autocast), cuda, cuda:N"
    )
    parser.add_argument(
        "--segments", default="", help="segment lengths k of the segment sweep (e.g. 5,10,25,50; empty: none)"
    )
    parser.add_argument("--segment-samples", type=int, default=8, help="segments per k and seed")
    parser.add_argument("--segment-warmup", type=int, default=100, help="fp32 steps before the first segment")
    parser.add_argument(
        "--claim-precision",
        choices=("bf16", "fp16"),
        default="bf16",
        help="the segment sweep's honest claims",
    )
    args = parse_with_quick(
        parser,
        seeds=1,
        rounds=1,
        inner_steps=3,
        sweep="2",
        sweep_seeds=1,
        segments="2",
        segment_samples=2,
        segment_warmup=2,
        model_size="micro",
        batch_size=2,
        seq_len=32,
    )
    torch.set_num_threads(1)
    claim_device = resolve_device(args.claim_device)
    BF16 = Placement(device=claim_device, precision="bf16")
    TF32 = Placement(device=claim_device, precision="fp32") if claim_device.type != "cpu" else None
    started = time.perf_counter()
    dataset = quick_dataset() if args.quick else bench_dataset(args.text)
    model_cfg = ModelConfig.named(args.model_size, vocab_size=dataset.tokenizer.vocab_size)
    h = args.inner_steps
    diloco_cfg = DiLoCoConfig(inner_steps=h, warmup_steps=min(20, h), total_steps=20_000)
    held_out = dataset.manifest.shards[-1].id
    held_tokens = dataset.source.fetch(dataset.manifest.shard(held_out))
    print(
        f"model {args.model_size}, batch {args.batch_size}x{args.seq_len}, H={h}, {args.seeds} seeds x "
        f"{args.rounds} rounds, torch threads 1, held-out shard {held_out}; claims trained on "
        f"{BF16.describe()}, replays on the CPU in fp32"
    )
    rows: dict[str, list[tuple[float, float]]] = {}
    rel_err: list[float] = []
    held: list[tuple[int, int, float, float]] = []

    def add(name: str, claimed: Tensor, replayed: Tensor) -> None:
        r = compare_deltas(claimed, replayed, SpotCheckConfig(min_cosine=-1.0, norm_tolerance=1e9))
        rows.setdefault(name, []).append((r.cosine, r.norm_ratio))

    for seed in range(0 if args.skip_main else args.seeds):
        wallet = f"replica-{seed}"
        assigned, other = streams(dataset, wallet, held_out, args.batch_size, args.seq_len)
        chain = DiLoCo(build_stage(model_cfg, 0, 1), diloco_cfg)
        chain16 = DiLoCo(build_stage(model_cfg, 0, 1), diloco_cfg, placement=BF16)
        gen = torch.Generator().manual_seed(seed)
        for r in range(args.rounds):
            inner = capture_inner_state(chain)
            assert inner is not None
            start = Start(r, chain.theta_round.detach().clone(), inner)
            batches = [assigned.next_batch() for _ in range(h)]
            elsewhere = [other.next_batch() for _ in range(h)]
            for x, y in batches:
                chain.inner_step(x, y)
                chain16.inner_step(x, y)
            d32 = chain.pseudo_gradient()
            d16 = train(model_cfg, diloco_cfg, start, batches, BF16)
            replay32 = replay_inner_steps(
                model_cfg, diloco_cfg, start.theta, batches, round_=r, inner_state=start.inner
            )
            replay16 = train(model_cfg, diloco_cfg, start, batches, BF16)
            add("honest fp32, replay fp32", d32, replay32)
            add("honest bf16, replay bf16", d16, replay16)
            add("honest bf16, replay fp32", d16, replay32)
            add("honest fp32, replay bf16", d32, replay16)
            if TF32 is not None:
                add(
                    f"honest {TF32.describe()}, replay fp32",
                    train(model_cfg, diloco_cfg, start, batches, TF32),
                    replay32,
                )
            rel_err.append(float((d16 - d32).norm() / d32.norm()))
            for f in (DELTA_FACTOR, 1.10, 1.05):
                add(f"lie: scaled Δ x{f:.2f} (bf16)", f * d16, replay32)
            add("lie: other data (bf16)", train(model_cfg, diloco_cfg, start, elsewhere, BF16), replay32)
            for share in (0.75, 0.5):
                trained = train(model_cfg, diloco_cfg, start, batches[: round(share * h)], BF16)
                add(f"lie: {1 - share:.0%} of steps skipped (bf16)", trained, replay32)
            noise = torch.randn(d16.shape, generator=gen)
            add("lie: made-up Δ (noise, honest norm)", noise * d16.norm() / noise.norm(), replay32)
            chain.outer_step(d32)
            chain16.outer_step(chain16.pseudo_gradient())
            losses = []
            for engine in (chain, chain16):
                model = build_stage(model_cfg, 0, 1)
                copy_into_parameters(engine.theta_round.detach(), model.parameters())
                losses.append(measure_loss(model, held_tokens, 8, args.seq_len, max_batches=8).loss)
            held.append((seed, r, losses[0], losses[1]))
            print(f"  seed {seed} round {r}: done ({time.perf_counter() - started:.0f} s)", flush=True)

    sweep: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for hs in [int(v) for v in args.sweep.split(",") if v]:
        cfg = DiLoCoConfig(inner_steps=hs, warmup_steps=min(20, hs), total_steps=20_000)
        for seed in range(args.sweep_seeds):
            assigned, other = streams(dataset, f"replica-{seed}", held_out, args.batch_size, args.seq_len)
            engine = DiLoCo(build_stage(model_cfg, 0, 1), cfg)
            for x, y in [assigned.next_batch() for _ in range(hs)]:  # round 0 warms AdamW's moments up
                engine.inner_step(x, y)
                other.next_batch()
            engine.outer_step(engine.pseudo_gradient())
            inner = capture_inner_state(engine)
            assert inner is not None
            start = Start(1, engine.theta_round.detach().clone(), inner)
            batches = [assigned.next_batch() for _ in range(hs)]
            elsewhere = [other.next_batch() for _ in range(hs)]
            replay32 = replay_inner_steps(
                model_cfg, cfg, start.theta, batches, round_=1, inner_state=start.inner
            )
            claims = {
                "honest bf16": train(model_cfg, cfg, start, batches, BF16),
                "other data (bf16)": train(model_cfg, cfg, start, elsewhere, BF16),
                "25% skipped (bf16)": train(model_cfg, cfg, start, batches[: round(0.75 * hs)], BF16),
            }
            for name, claimed in claims.items():
                result = compare_deltas(
                    claimed, replay32, SpotCheckConfig(min_cosine=-1.0, norm_tolerance=1e9)
                )
                sweep.setdefault((hs, name), []).append((result.cosine, result.norm_ratio))
            print(f"  sweep H={hs} seed {seed}: done ({time.perf_counter() - started:.0f} s)", flush=True)

    if rows:
        old, new = SpotCheckConfig(), CALIBRATED_TOLERANCE
        print(
            f"\nclaimed vs replayed Δ, {len(rows['honest fp32, replay fp32'])} rounds each; cosine and norm ratio min / median / max"
        )
        print(
            f"| case | cosine | norm ratio | passes old ({old.min_cosine}, ±{old.norm_tolerance}) | passes new ({new.min_cosine}, ±{new.norm_tolerance}) |"
        )
        print("|---|---|---|---|---|")
        for name, values in rows.items():
            cos, ratio = [c for c, _ in values], [n for _, n in values]
            passes = [
                sum(c >= cfg.min_cosine and abs(n - 1) <= cfg.norm_tolerance for c, n in values)
                for cfg in (old, new)
            ]
            print(
                f"| {name} | {summary(cos)} | {summary(ratio)} | {passes[0]}/{len(values)} | {passes[1]}/{len(values)} |"
            )
        print(
            f"\nbf16 vs fp32 Δ from the same start and tokens: relative error ‖Δ16−Δ32‖/‖Δ32‖ {summary(rel_err)}"
        )
        print("| seed | round | held-out loss fp32 chain | bf16 chain | bf16 − fp32 |")
        print("|---|---|---|---|---|")
        for seed, r, a, b in held:
            print(f"| {seed} | {r} | {a:.4f} | {b:.4f} | {b - a:+.4f} |")
    print(
        f"\nby round length (round 1, {args.sweep_seeds} seeds), fp32 replay; cosine and norm ratio min / median / max"
    )
    print("| H | claim | cosine | norm ratio |")
    print("|---|---|---|---|")
    for (hs, name), values in sweep.items():
        cos, ratio = [c for c, _ in values], [n for _, n in values]
        print(f"| {hs} | {name} | {summary(cos)} | {summary(ratio)} |")
    if args.segments:
        segment_sweep(args, dataset, model_cfg, held_out, started)
    print(f"total {time.perf_counter() - started:.0f} s")
    dataset.source.close()


SEGMENT_SCALES = (1.01, 1.02, 1.05)


def segment_sweep(
    args: argparse.Namespace, dataset: Dataset, model_cfg: ModelConfig, held_out: int, started: float
) -> None:
    """Segment checks (issue 17): a replica trains in `--claim-precision` on the claim device from
    its own previous segment's end, as a node does mid-round; the verifier replays each segment's k
    steps on the CPU in fp32 from that committed start. Per k: the honest claims and the lies."""
    claim = Placement(device=resolve_device(args.claim_device), precision=args.claim_precision)
    ks = [int(v) for v in args.segments.split(",") if v]
    out: dict[tuple[int, str], list[tuple[float, float]]] = {}
    total = max(ks) * args.segment_samples
    for seed in range(args.sweep_seeds):
        assigned, other = streams(dataset, f"segment-{seed}", held_out, args.batch_size, args.seq_len)
        cfg = DiLoCoConfig(inner_steps=args.segment_warmup + total, warmup_steps=20, total_steps=20_000)
        warm = DiLoCo(build_stage(model_cfg, 0, 1), cfg)
        for _ in range(args.segment_warmup):  # past the lr warm-up, AdamW's moments filled
            warm.inner_step(*assigned.next_batch())
        for k in ks:
            engine = DiLoCo(build_stage(model_cfg, 0, 1), cfg, placement=claim)
            copy_into_parameters(flat_parameters(warm.params), engine.params)
            engine.steps_in_round = warm.steps_in_round
            install_inner_state(engine, _inner(warm))
            gen = torch.Generator().manual_seed(seed)
            for _ in range(args.segment_samples):
                theta, inner, step = flat_parameters(engine.params), _inner(engine), engine.steps_in_round
                batches = [assigned.next_batch() for _ in range(k)]
                elsewhere = [other.next_batch() for _ in range(k)]
                for x, y in batches:
                    engine.inner_step(x, y)
                claimed = flat_parameters(engine.params) - theta
                replayed = _segment(model_cfg, cfg, theta, inner, step, batches, FP32) - theta

                kept = k - max(1, round(0.2 * k))
                noise = torch.randn(claimed.shape, generator=gen)
                claims = {
                    f"honest {claim.describe()}": claimed,
                    **{f"lie: update x{f:.2f}": f * claimed for f in SEGMENT_SCALES},
                    "lie: other data": _segment(model_cfg, cfg, theta, inner, step, elsewhere, FP32) - theta,
                    f"lie: {k - kept} of {k} steps skipped": (
                        _segment(model_cfg, cfg, theta, inner, step, batches[:kept], FP32) - theta
                    ),
                    "lie: made-up update (honest norm)": noise * claimed.norm() / noise.norm(),
                }
                for name, delta in claims.items():
                    r = compare_deltas(delta, replayed, SpotCheckConfig(min_cosine=-1.0, norm_tolerance=1e9))
                    out.setdefault((k, name), []).append((r.cosine, r.norm_ratio))
            print(f"  segments k={k} seed {seed}: done ({time.perf_counter() - started:.0f} s)", flush=True)
    print(
        f"\nsegments ({args.sweep_seeds} seeds x {args.segment_samples} consecutive segments per k, after "
        f"{args.segment_warmup} fp32 steps), claims trained on {claim.describe()}, replayed on the CPU in "
        "fp32 from the committed start; cosine and norm ratio min / median / max"
    )
    print("| k | claim | cosine | norm ratio | max abs(norm ratio - 1) |")
    print("|---|---|---|---|---|")
    for (k, name), values in out.items():
        cos, ratio = [c for c, _ in values], [n for _, n in values]
        worst = max(abs(n - 1) for n in ratio)
        print(f"| {k} | {name} | {summary(cos)} | {summary(ratio)} | {worst:.5f} |")


def _inner(engine: DiLoCo) -> InnerState:
    inner = capture_inner_state(engine)
    assert inner is not None
    return inner


def _segment(
    model_cfg: ModelConfig,
    cfg: DiLoCoConfig,
    theta: Tensor,
    inner: InnerState,
    step: int,
    batches: Batches,
    placement: Placement,
) -> Tensor:
    """The weights after `batches` from (theta, inner) at inner step `step` of round 0 (the
    verifier's replay sets the round and step the same way, verifier.segmentcheck)."""
    engine = DiLoCo(build_stage(model_cfg, 0, 1), cfg, placement=placement)
    copy_into_parameters(theta, engine.params)
    engine.steps_in_round = step
    install_inner_state(engine, inner)
    for x, y in batches:
        engine.inner_step(x, y)
    return flat_parameters(engine.params)


if __name__ == "__main__":
    main()
