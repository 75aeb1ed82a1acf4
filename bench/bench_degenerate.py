"""Degenerate activations through a pipeline's stages: why a stage refuses them, and where (issue 17).

A stage > 0 replica refuses a micro-batch any position of which has a mean square under a
quarter of the norm's eps (`node.pipeline.DEGENERATE_MEAN_SQUARE`), and sends on no output that
has one. This prints what that bound rests on, per model size, at initialisation (seeded):

- the smallest mean square (÷ eps) over the positions of stage 0's output for random token ids:
  how far above the bound honest activations start;
- for the first middle stage, on inputs whose every position has a mean square of 1, ¼, 1/16 of
  eps, or exactly zero: the stage's gain (largest |∂loss/∂input| from a gradient whose largest
  value is 1), the smallest mean square of its output (÷ eps), and the next stage's gain on that
  output. Zeros come out as zeros, so the next stage's gain is as large again and compounds;
  activations at the bound come out restored, and the next stage's gain is an honest one.

Compute only, no timing: a size takes seconds on 2 cores (350m builds two 4-layer stages).

    .venv/bin/python bench/bench_degenerate.py [--sizes tiny,350m] [--stages 6] [--json] [--quick]
"""

from __future__ import annotations

import argparse
import json

import torch
from common import parse_with_quick

from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.pipeline import DEGENERATE_MEAN_SQUARE

SHARES = (1.0, DEGENERATE_MEAN_SQUARE, 1 / 16, 0.0)


def _mean_square(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float().pow(2).mean(-1)


def _through(stage: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    x = x.detach().clone().requires_grad_(True)
    out = stage(x)
    unit = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(unit / unit.abs().max())
    assert x.grad is not None
    return out.detach(), float(x.grad.abs().max())


def _run(size: str, num_stages: int, batch: int, seq_len: int) -> list[dict[str, float | str]]:
    torch.manual_seed(0)
    config = ModelConfig.named(size, vocab_size=4096, max_seq_len=seq_len)
    eps = config.norm_eps
    num_stages = min(num_stages, config.n_layers)  # tiny's 4 layers make at most 4 stages
    if num_stages < 3:
        raise SystemExit(f"{size} has {config.n_layers} layers: too few for a middle stage and one after it")
    first, middle, after = (build_stage(config, s, num_stages) for s in range(3))
    layers = len(middle.layers)
    with torch.no_grad():
        honest = first(torch.randint(0, config.vocab_size, (batch, seq_len)))
    where: dict[str, float | str] = {"size": size, "stages": num_stages, "layers": layers}
    lowest = float(_mean_square(honest).min()) / eps
    rows: list[dict[str, float | str]] = [
        {**where, "input": "stage 0 output (honest)", "input_ms_over_eps": lowest}
    ]
    for share in SHARES:
        noise = torch.randn(batch, seq_len, config.dim, generator=torch.Generator().manual_seed(2))
        x = noise * (share * eps / _mean_square(noise).unsqueeze(-1)).sqrt()
        out, gain = _through(middle, x)
        _, next_gain = _through(after, out)
        rows.append({
            **where, "input": f"{share:g} × eps" if share else "zeros", "input_ms_over_eps": share,
            "gain": gain, "output_ms_over_eps": float(_mean_square(out).min()) / eps, "next_gain": next_gain,
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,350m")
    parser.add_argument(
        "--stages", type=int, default=6, help="stages the model is cut into (≥ 3; at most its layers)"
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list last")
    args = parse_with_quick(parser, sizes="tiny", seq_len=16)
    if args.stages < 3:
        parser.error("--stages must be at least 3 (a middle stage and the one after it)")
    torch.set_num_threads(args.threads)
    rows = [
        row for size in args.sizes.split(",") for row in _run(size, args.stages, args.batch, args.seq_len)
    ]
    print(
        f"bound: a position's mean square ≥ {DEGENERATE_MEAN_SQUARE} × eps; seed 0; the middle stage is stage 1"
    )
    print(
        f"{'size':6} {'stages':>6} {'layers':>6} {'input':24} {'in ms/eps':>10} {'gain':>10} {'out ms/eps':>11} {'next gain':>10}"
    )
    for row in rows:
        rest = "".join(
            f" {row[key]:>{width}.3g}" if key in row else ""
            for key, width in (("gain", 10), ("output_ms_over_eps", 11), ("next_gain", 10))
        )
        print(
            f"{row['size']!s:6} {row['stages']!s:>6} {row['layers']!s:>6} {row['input']!s:24} {row['input_ms_over_eps']:>10.3g}{rest}"
        )
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
