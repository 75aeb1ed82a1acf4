"""A lone replica's outer step, where the model lives vs on the CPU, side by side.

The node's outer step (`DiLoCo.local_outer_step`: Δ = θ_round − θ_local, the finiteness check,
the Nesterov step, θ back into the model, θ_round and the momentum refreshed on the CPU) runs
on CUDA where the model is, because `outer_sgd_step` rounds every operation once and so gives
the CPU's bits there. The baseline is the same engine with the step forced onto the CPU path (Δ
off the device, `outer_sgd_step` in CPU memory, θ back onto the device): where the step ran
before (with torch.optim.SGD's step then, of about the same cost).
Both start from the same weights and take the same perturbed "inner" weights each round; after
every round the bench checks that both hold the same θ_round bits, so it is also a check of
cross-device agreement at the model's real size. Rounds alternate (ours, baseline, ...).

    .venv/bin/python bench/bench_outer_step.py --device cuda --model-size 125m --threads 8
    .venv/bin/python bench/bench_outer_step.py                      # CPU: both paths the same
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import parse_with_quick

from neuroshard.node.device import resolve
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, Transformer


class HostOuterStep(DiLoCo):
    """The outer step on the CPU whatever the placement (the baseline)."""

    @property
    def _outer_on_device(self) -> bool:
        return False


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def perturb(engine: DiLoCo, round_: int) -> None:
    """Stand-in for H inner steps: a small, seeded move of every weight, the same for both engines."""
    gen = torch.Generator(device=engine.params[0].device).manual_seed(round_)
    for p in engine.params:
        p.add_(torch.randn(p.shape, generator=gen, device=p.device) * 1e-3)


def timed_round(engine: DiLoCo, round_: int) -> float:
    perturb(engine, round_)
    device = engine.params[0].device
    synchronize(device)
    start = time.perf_counter()
    engine.local_outer_step()
    synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, mps")
    parser.add_argument("--model-size", default="125m")
    parser.add_argument("--vocab-size", type=int, default=32_768)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parse_with_quick(parser, model_size="micro", rounds=2, vocab_size=256)
    torch.set_num_threads(args.threads)
    placement = resolve(args.device, "auto")
    config = ModelConfig.named(args.model_size, vocab_size=args.vocab_size)
    diloco = DiLoCoConfig(inner_steps=100)
    torch.manual_seed(0)
    model = Transformer(config)
    twin = Transformer(config)
    twin.load_state_dict(model.state_dict())
    ours, baseline = (
        DiLoCo(model, diloco, placement=placement),
        HostOuterStep(twin, diloco, placement=placement),
    )
    n = ours.theta_round.numel()
    print(
        f"model {args.model_size} ({n:,} params), device {placement.describe()}, torch threads {args.threads}, "
        f"outer step on the device: {ours._outer_on_device}"
    )
    times: dict[str, list[float]] = {"ours": [], "baseline": []}
    for r in range(args.rounds):
        times["ours"].append(timed_round(ours, r))
        times["baseline"].append(timed_round(baseline, r))
        same = ours.weights_hash() == baseline.weights_hash()
        print(
            f"  round {r}: ours {times['ours'][-1]:.3f} s, baseline {times['baseline'][-1]:.3f} s, "
            f"θ_round bits equal: {same}"
        )
        if not same:
            raise SystemExit(
                "the two paths disagree on θ_round: the outer step is not bit-identical across devices"
            )
    # The first round of each uploads θ_round and the momentum or builds them: report the rest.
    steady = {k: v[1:] or v for k, v in times.items()}
    o, b = statistics.median(steady["ours"]), statistics.median(steady["baseline"])
    print(
        f"median after round 0: ours {o:.3f} s, baseline (CPU outer step) {b:.3f} s, baseline/ours = {b / o:.1f}x"
    )


if __name__ == "__main__":
    main()
