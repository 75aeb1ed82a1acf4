"""What a replica sent on against what its replayed step computes: where the codecs put honest
payloads, and where the lies land (issue 17, verifier.segmentcheck.SENT_TOLERANCE).

A segment check decodes each payload a step sent on (its output forward, the gradient of its input
back) and compares it with the replay's tensor by cosine and norm ratio. An honest payload differs
from the replay only by the pipeline codec's rounding and the precision it trained in; this bench
measures the codec part on Gaussian tensors (activations with 20× outlier channels, as trained
models have), worst over seeds, for every wire codec, and where each lie the tests name lands
against the default codec's honest payload. The precision part is measured on real rounds by
tests/verifier/test_segmentcheck.py (honest segments, fp32 and bf16 training, an fp32 replay).

    .venv/bin/python bench/bench_sent_tolerance.py [--seeds 5] [--shape 8,128,128] [--quick]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import Tensor

from neuroshard.node.actcodec import DEFAULT_CODEC
from neuroshard.node.p2p.pipeline_wire import (
    decode_activations_as,
    decode_gradient,
    encode_activations,
    encode_gradient,
)
from neuroshard.protocol.pipeline import CODEC_NAMES
from neuroshard.verifier.segmentcheck import SENT_TOLERANCE

LIES: dict[str, Callable[[Tensor], Tensor]] = {
    "scaled 1.2": lambda t: 1.2 * t,
    "scaled 1.1": lambda t: 1.1 * t,
    "flipped": lambda t: -t,
    "noise": lambda t: torch.randn(t.shape, generator=torch.Generator().manual_seed(7)) * t.std(),
    "another micro-batch's rows": lambda t: t.roll(1, dims=0),
}


def _compare(sent: Tensor, replayed: Tensor) -> tuple[float, float]:
    a, b = sent.flatten().double(), replayed.flatten().double()
    return float(a @ b / (a.norm() * b.norm())), float(a.norm() / b.norm())


def _tensors(seed: int, shape: tuple[int, int, int]) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(shape, generator=g)
    hidden[..., :4] *= 20.0  # outlier channels
    grad = torch.randn(shape, generator=g) * 1e-3
    return hidden, grad, torch.randint(0, 100, shape[:2], generator=g)


def _round_trip(codec: str, hidden: Tensor, grad: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    shape = tuple(hidden.shape)
    sent, _ = decode_activations_as(encode_activations(hidden, labels, codec), shape, codec, 100)  # type: ignore[arg-type]
    back = decode_gradient(encode_gradient(grad, codec), shape, codec)  # type: ignore[arg-type]
    return sent, back


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--shape", default="8,128,128", help="micro-batch B,T,C")
    p.add_argument("--quick", action="store_true", help="2 seeds of 2x32x64 (a smoke run)")
    args = p.parse_args()
    if args.quick:
        args.seeds, args.shape = 2, "2,32,64"
    torch.set_num_threads(1)
    shape = tuple(int(x) for x in args.shape.split(","))
    assert len(shape) == 3
    tol = SENT_TOLERANCE
    print(f"SENT_TOLERANCE: cosine >= {tol.min_cosine}, norm ratio 1 ± {tol.norm_tolerance}; shape {shape}")
    print(
        f"{'codec':<12} {'act cos':>9} {'act |n-1|':>10} {'grad cos':>9} {'grad |n-1|':>11}  margin (1-cos, |n-1|)"
    )
    for codec in CODEC_NAMES:
        worst = [1.0, 0.0, 1.0, 0.0]
        for seed in range(args.seeds):
            hidden, grad, labels = _tensors(seed, shape)  # type: ignore[arg-type]
            sent, back = _round_trip(codec, hidden, grad, labels)
            for k, (c, n) in enumerate((_compare(sent, hidden), _compare(back, grad))):
                worst[2 * k] = min(worst[2 * k], c)
                worst[2 * k + 1] = max(worst[2 * k + 1], abs(n - 1))
        cos, norm = min(worst[0], worst[2]), max(worst[1], worst[3])
        margin = (
            f"{(1 - tol.min_cosine) / max(1 - cos, 1e-12):.1f}×, {tol.norm_tolerance / max(norm, 1e-12):.1f}×"
        )
        print(f"{codec:<12} {worst[0]:>9.4f} {worst[1]:>10.4f} {worst[2]:>9.4f} {worst[3]:>11.4f}  {margin}")
    print(f"\nlies against an honest {DEFAULT_CODEC} payload (seed 0), activations / gradient:")
    hidden, grad, labels = _tensors(0, shape)  # type: ignore[arg-type]
    for name, lie in LIES.items():
        sent, back = _round_trip(DEFAULT_CODEC, lie(hidden), lie(grad), labels)
        verdicts = []
        for got, replayed in ((sent, hidden), (back, grad)):
            c, n = _compare(got, replayed)
            caught = c < tol.min_cosine or abs(n - 1) > tol.norm_tolerance
            verdicts.append(f"cos {c:+.4f} norm {n:.3f} {'refused' if caught else 'PASSES'}")
        print(f"  {name:<28} {' / '.join(verdicts)}")


if __name__ == "__main__":
    main()
