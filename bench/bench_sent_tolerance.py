"""What a replica sent on against what its replayed step computes: where honest payloads land
against verifier.segmentcheck.SENT_TOLERANCE, and where the lies land (issue 17).

A segment check decodes each payload a step sent on (its output forward, the gradient of its input
back) and holds it to the replay's tensor r relative to what the run's codec does to r itself
(``compare_sent``: the error energy against the codec's own, the norm against the codec's coding
of r, and the fixed limits it replaced). An honest payload differs from r by the codec's rounding
and by the precision the sender trained in; the lies are coded with the honest encoder. Two parts:

1. The codecs alone: Gaussian tensors (activations with 20× outlier channels), the sender 0.4% from
   the replay (the precision drift measured in part 2), every wire codec, and the lies.
2. Real segments: stages 0 and 1 of 2 trained in one process with the real inner steps (DiLoCo,
   ``remote_loss``, ``stage_inner_step``) and the codec at the boundary, warmed up in fp32; then
   from one state the sender trains k steps in fp32 or bf16 autocast, and the verifier replays
   each stage in CPU fp32 on what it recorded, as ``segmentcheck.replay_segment`` does. Per step,
   the honest payload and the lies (rescaled; computed with the segment's start weights, "stale"
   by j steps at step j) against the replay.

Each cell: the largest share of a limit an honest payload used (energy, norm), or the lies'
refusals. Torch threads: 1.

    .venv/bin/python bench/bench_sent_tolerance.py [--model test|tiny] [--samples 12] [--quick]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from common import bench_dataset, fresh_clone_text, quick_dataset
from torch import Tensor

from neuroshard.node import actcodec
from neuroshard.node.actcodec import CODECS
from neuroshard.node.device import Placement
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig, copy_into_parameters, flat_parameters
from neuroshard.node.model import MODEL_SIZES, ModelConfig, build_stage, cross_entropy_loss
from neuroshard.node.pipeline import remote_loss, stage_inner_step
from neuroshard.node.replay import InnerState, capture_inner_state, install_inner_state
from neuroshard.verifier.segmentcheck import SENT_TOLERANCE, SentComparison, compare_sent

SCALES = (1.02, 1.05, 1.10)
DRIFT = 0.004
"""Part 1's sender-to-replay distance (relative): bf16 autocast's measured in part 2 was 0.47% (tiny)
to 0.65% (the test model)."""

# --- 1. the codecs alone ----------------------------------------------------------------------


def _tensor(seed: int, shape: tuple[int, ...], gradient: bool) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if gradient:
        return x * 1e-3
    x[..., :4] *= 20.0  # outlier channels
    return x


def codecs_alone(seeds: int, shape: tuple[int, ...]) -> None:
    print(f"1. the codecs alone, {seeds} seeds of {shape}, the sender {DRIFT:.1%} from the replay")
    print(
        f"{'codec':<11} {'kind':<5} {'honest: energy, norm':>21}   refused of {seeds}: "
        + "  ".join(f"x{s:.2f}" for s in SCALES)
        + "  other"
    )
    for name, codec in CODECS.items():
        for kind, fmt in (("act", codec.forward), ("grad", codec.backward)):
            honest = [0.0, 0.0]
            refused = [0] * (len(SCALES) + 1)
            for seed in range(seeds):
                r = _tensor(seed, shape, kind == "grad")
                noise = torch.randn(shape, generator=torch.Generator().manual_seed(1000 + seed))
                sender = r + DRIFT * r.norm() / r.numel() ** 0.5 * noise
                c = compare_sent(actcodec.round_trip(sender, fmt), r, fmt)
                honest = [
                    max(honest[0], c.excess / c.excess_limit),
                    max(honest[1], abs(c.norm_ratio - 1) / c.norm_limit),
                ]
                lies = [s * sender for s in SCALES] + [_tensor(seed + 100, shape, kind == "grad")]
                for i, lie in enumerate(lies):
                    refused[i] += not compare_sent(actcodec.round_trip(lie, fmt), r, fmt).ok
            print(
                f"{name:<11} {kind:<5} {honest[0]:>10.2f} {honest[1]:>9.2f}   "
                + "  ".join(f"{n:>5}" for n in refused)
            )


# --- 2. real segments -------------------------------------------------------------------------


@dataclass
class Pair:
    """Stages 0 and 1 of 2 at one moment: weights and inner optimizer state of each."""

    theta: tuple[Tensor, Tensor]
    inner: tuple[InnerState, InnerState]
    step: int


def _engines(
    cfg: ModelConfig, diloco: DiLoCoConfig, pair: Pair, placement: Placement, loss_fn: Callable | None
) -> tuple[DiLoCo, DiLoCo]:
    engines = []
    for stage in (0, 1):
        kwargs = {"loss_fn": loss_fn} if stage == 0 and loss_fn is not None else {}
        engine = DiLoCo(build_stage(cfg, stage, 2), diloco, placement=placement, **kwargs)
        copy_into_parameters(pair.theta[stage], engine.params)
        install_inner_state(engine, pair.inner[stage])
        engine.steps_in_round = pair.step
        engines.append(engine)
    return engines[0], engines[1]


def _snapshot(first: DiLoCo, last: DiLoCo) -> Pair:
    inner = [capture_inner_state(e) for e in (first, last)]
    assert inner[0] is not None and inner[1] is not None
    return Pair(
        (flat_parameters(first.params), flat_parameters(last.params)),
        (inner[0], inner[1]),
        first.steps_in_round,
    )


@dataclass
class Step:
    """One inner step of a segment as the sender took it."""

    batch: tuple[Tensor, Tensor]
    hidden: Tensor  # what stage 0's step computed (before the codec)
    received: Tensor  # what stage 1 decoded and trained on
    grad: Tensor  # what stage 1's step computed for its input (before the codec)
    grad_received: Tensor  # what stage 0 decoded and stepped with
    stale_hidden: Tensor  # stage 0's output at the segment's start weights, the same input
    stale_grad: Tensor  # stage 1's input gradient at its start weights, the same input


def sender_segment(
    cfg: ModelConfig,
    diloco: DiLoCoConfig,
    pair: Pair,
    codec: str,
    batches: list[tuple[Tensor, Tensor]],
    precision: str,
) -> list[Step]:
    """k inner steps of both stages from `pair` in `precision` autocast, the codec between them."""
    fmt = CODECS[codec]
    placement = Placement(device=torch.device("cpu"), precision=precision)
    box: dict[str, Tensor] = {}

    def downstream(hidden: Tensor, labels: Tensor) -> tuple[Tensor, float]:
        received = actcodec.round_trip(hidden, fmt.forward)
        grad, loss = stage_inner_step(last, received, labels, None)
        box.update(hidden=hidden.clone(), received=received, grad=grad)
        box["grad_received"] = actcodec.round_trip(grad, fmt.backward)
        return box["grad_received"], loss

    first, last = _engines(cfg, diloco, pair, placement, remote_loss(downstream))
    frozen0, frozen1 = _engines(cfg, diloco, pair, placement, None)
    steps: list[Step] = []
    for x, y in batches:
        with torch.no_grad(), placement.autocast():
            stale_hidden = frozen0.model(x).float()
        first.inner_step(x, y)
        stale_in = box["received"].clone().requires_grad_(True)
        with placement.autocast():
            cross_entropy_loss(frozen1.model(stale_in), y).backward()
        assert stale_in.grad is not None
        frozen1.model.zero_grad(set_to_none=True)
        steps.append(
            Step(
                (x, y),
                box["hidden"],
                box["received"],
                box["grad"],
                box["grad_received"],
                stale_hidden,
                stale_in.grad.float(),
            )
        )
    return steps


def replayed_segment(
    cfg: ModelConfig, diloco: DiLoCoConfig, pair: Pair, steps: list[Step]
) -> list[tuple[Tensor, Tensor]]:
    """The verifier's replays in CPU fp32, each stage from its start on what it recorded:
    (stage 0's output, stage 1's input gradient) per step."""
    outputs: list[Tensor] = []
    recorded = iter([s.grad_received for s in steps])

    def downstream(hidden: Tensor, labels: Tensor) -> tuple[Tensor, float]:
        outputs.append(hidden.clone())
        return next(recorded), 0.0

    first, last = _engines(cfg, diloco, pair, Placement.cpu(), remote_loss(downstream))
    grads = []
    for s in steps:
        first.inner_step(*s.batch)
        grads.append(stage_inner_step(last, s.received, s.batch[1], None)[0])
    return list(zip(outputs, grads, strict=True))


def real_segments(args: argparse.Namespace) -> None:
    dataset = quick_dataset() if args.quick else bench_dataset(fresh_clone_text(), vocab_size=4096)
    tokens = torch.cat([dataset.source.fetch(info).long() for info in dataset.manifest.shards[1:]])
    vocab = dataset.tokenizer.vocab_size
    if args.model == "test":  # tests/verifier/test_segmentcheck.py's model and micro-batch
        cfg, b, t = (
            ModelConfig(vocab_size=vocab, dim=32, n_layers=3, n_heads=2, ffn_dim=64, max_seq_len=16),
            2,
            16,
        )
    else:
        cfg, b, t = ModelConfig(vocab_size=vocab, **MODEL_SIZES[args.model]), 4, 64
    diloco = DiLoCoConfig(inner_steps=1_000_000, warmup_steps=20, total_steps=10_000_000)
    g = torch.Generator().manual_seed(0)

    def batch() -> tuple[Tensor, Tensor]:
        starts = torch.randint(0, tokens.numel() - t - 1, (b,), generator=g)
        rows = tokens[starts[:, None] + torch.arange(t + 1)]
        return rows[:, :-1], rows[:, 1:]

    warm = CODECS["fitted43"]
    last = DiLoCo(build_stage(cfg, 1, 2), diloco)

    def downstream(hidden: Tensor, labels: Tensor) -> tuple[Tensor, float]:
        grad, loss = stage_inner_step(last, actcodec.round_trip(hidden, warm.forward), labels, None)
        return actcodec.round_trip(grad, warm.backward), loss

    first = DiLoCo(build_stage(cfg, 0, 2), diloco, loss_fn=remote_loss(downstream))
    codecs = ["bf16", "int8", "fitted43"] if args.quick else list(CODECS)
    print(
        f"\n2. real segments: model {args.model} ({b}x{t}x{cfg.dim} values a payload), k = {args.k}, "
        f"{args.samples} samples {args.every} steps apart after {args.warm} fp32 steps; codecs {', '.join(codecs)}"
    )
    cells: dict[tuple[str, str, str, str], list[SentComparison]] = defaultdict(list)
    drift = 0.0
    start = time.perf_counter()
    for step in range(args.warm + args.samples * args.every):
        if step >= args.warm and (step - args.warm) % args.every == 0:
            pair = _snapshot(first, last)
            batches = [batch() for _ in range(args.k)]
            for name in codecs:
                codec = CODECS[name]
                for precision in ("fp32", "bf16"):
                    steps = sender_segment(cfg, diloco, pair, name, batches, precision)
                    for j, (s, (hr, gr)) in enumerate(
                        zip(steps, replayed_segment(cfg, diloco, pair, steps), strict=True)
                    ):
                        for kind, sent, r, fmt, stale in (
                            ("act", s.hidden, hr, codec.forward, s.stale_hidden),
                            ("grad", s.grad, gr, codec.backward, s.stale_grad),
                        ):
                            drift = max(drift, float((sent - r).norm() / r.norm()))
                            lies = {"honest": sent, **{f"x{f:.2f}": f * sent for f in SCALES}}
                            if j > 0:
                                lies[f"stale {j}"] = stale
                            for lie, tensor in lies.items():
                                key = (name, precision, kind, lie)
                                cells[key].append(compare_sent(actcodec.round_trip(tensor, fmt), r, fmt))
            print(
                f"  sample {(step - args.warm) // args.every + 1}/{args.samples} ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
        first.inner_step(*batch())
    print(f"largest sender-to-replay distance (relative, before the codec): {drift:.4f}")
    lies = ["honest", *(f"x{f:.2f}" for f in SCALES), *(f"stale {j}" for j in range(1, args.k))]
    print(
        f"{'codec':<11} {'sender':<6} {'kind':<5} {'honest: energy, norm':>21}   refused: "
        + "  ".join(lies[1:])
    )
    for name in codecs:
        for precision in ("fp32", "bf16"):
            for kind in ("act", "grad"):
                honest = cells[(name, precision, kind, "honest")]
                energy = max(c.excess / c.excess_limit for c in honest)
                norm = max(abs(c.norm_ratio - 1) / c.norm_limit for c in honest)
                bad = sum(not c.ok for c in honest)
                refused = [cells[(name, precision, kind, lie)] for lie in lies[1:]]
                counts = "  ".join(f"{sum(not c.ok for c in cs):>3}/{len(cs):<3}" for cs in refused)
                flag = f"  ({bad} HONEST REFUSED)" if bad else ""
                print(f"{name:<11} {precision:<6} {kind:<5} {energy:>10.2f} {norm:>9.2f}   {counts}{flag}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=5, help="part 1's tensors")
    p.add_argument("--shape", default="8,128,128", help="part 1's micro-batch B,T,C")
    p.add_argument("--model", default="test", choices=["test", *MODEL_SIZES], help="part 2's model")
    p.add_argument("--samples", type=int, default=12, help="part 2's segments per codec and precision")
    p.add_argument("--k", type=int, default=4, help="part 2's steps a segment")
    p.add_argument("--warm", type=int, default=40, help="part 2's fp32 steps before the first sample")
    p.add_argument("--every", type=int, default=10, help="part 2's steps between samples")
    p.add_argument("--quick", action="store_true", help="a smoke run (CI): 2 seeds, 2 samples")
    args = p.parse_args()
    if args.quick:
        args.seeds, args.shape, args.samples, args.warm, args.every, args.k = 2, "2,32,64", 2, 5, 3, 2
    torch.set_num_threads(1)
    tol = SENT_TOLERANCE
    print(
        f"SENT_TOLERANCE: energy <= (1 + {tol.energy_slack} + {tol.energy_spread} s_e)(codec's + {tol.drift}^2 |r|^2), "
        f"|norm - 1| <= {tol.norm_floor} + {tol.norm_spread} s_n; cells: an honest payload's largest share of each limit"
    )
    codecs_alone(args.seeds, tuple(int(x) for x in args.shape.split(",")))
    real_segments(args)


if __name__ == "__main__":
    main()
