"""What a pipeline driver's gradient check costs per inner step (issue 17, hostile neighbours).

A stage-0 replica of a pipeline now steps through `pipeline.driver_inner_step`, which reads the
loss and takes one norm per parameter gradient before the update, so that a gradient from the next
stage that overflows the backward is refused (and its sender banned) instead of turning the
weights to NaN. The baseline is the step it replaced, `DiLoCo.queue_inner_step` (the loss read
after it, as `Trainer` does). Both run stage 0 of 2 with an in-process next stage that answers
at once with a fixed gradient, so the figure is the check against the local step alone (on a
real pipeline the network round trip dwarfs both). Ours and the baseline alternate step by step
on two copies of the same weights; medians over the steps. Torch threads: 1 (`--threads`).

A third column times the failure path once per size: a gradient of 3e38s refused and blamed,
then the honest one stepped (`_gradient_overflowed` runs the forward and a backward again).

    .venv/bin/python bench/bench_driver_check.py [--sizes micro,tiny,small] [--steps 40] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.pipeline import driver_inner_step, remote_loss


def _answer(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
    return torch.full_like(hidden, 1e-4), 3.0


def _run(size: str, steps: int, batch: int, seq_len: int) -> dict[str, float | str]:
    torch.manual_seed(0)
    config = ModelConfig.named(size, vocab_size=4096, max_seq_len=seq_len)
    diloco = DiLoCoConfig(inner_steps=10**6, warmup_steps=0, total_steps=10**6)
    base = DiLoCo(build_stage(config, 0, 2), diloco, loss_fn=remote_loss(_answer))
    ours = DiLoCo(copy.deepcopy(base.model), diloco, loss_fn=remote_loss(_answer))
    tokens = torch.randint(
        0, config.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(1)
    )
    x, y = tokens[:, :-1], tokens[:, 1:]
    times: dict[str, list[float]] = {"ours": [], "base": []}
    for step in range(steps + 2):
        for name in ("ours", "base") if step % 2 else ("base", "ours"):
            start = time.perf_counter()
            if name == "ours":
                float(driver_inner_step(ours, x, y))
            else:
                float(base.queue_inner_step(x, y))
            if step >= 2:  # two warm-up steps each
                times[name].append(time.perf_counter() - start)
    same = all(torch.equal(a, b) for a, b in zip(base.params, ours.params, strict=True))
    answers = iter([3e38])
    blamed: list[str] = []

    def hostile_once(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        value = next(answers, None)
        return (torch.full_like(hidden, value), 3.0) if value is not None else _answer(hidden, labels)

    ours.loss_fn = remote_loss(hostile_once, lambda why: blamed.append(why) is None)
    start = time.perf_counter()
    float(driver_inner_step(ours, x, y))
    refused_s = time.perf_counter() - start
    base_ms = statistics.median(times["base"]) * 1e3
    ours_ms = statistics.median(times["ours"]) * 1e3
    return {
        "size": size,
        "parameters": sum(p.numel() for p in base.params),
        "base_ms": round(base_ms, 2),
        "ours_ms": round(ours_ms, 2),
        "ratio": round(ours_ms / base_ms, 3),
        "same_weights": same,
        "blamed_step_ms": round(refused_s * 1e3, 2),
        "blamed": len(blamed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="micro,tiny,small")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list, last")
    parser.add_argument(
        "--quick", action="store_true", help="the micro size, 4 steps: seconds, for a smoke test"
    )
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.steps = "micro", 4
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'size':>6} {'params':>11} {'queue_inner_step ms':>20} {'driver_inner_step ms':>21} "
          f"{'ratio':>6} {'same θ':>7} {'blamed step ms':>15}")  # fmt: skip
    for size in args.sizes.split(","):
        row = _run(size, args.steps, args.batch, args.seq_len)
        rows.append(row)
        print(f"{row['size']:>6} {row['parameters']:>11,} {row['base_ms']:>20} {row['ours_ms']:>21} "
              f"{row['ratio']:>6} {row['same_weights']!s:>7} {row['blamed_step_ms']:>15}", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
