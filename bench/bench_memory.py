"""Training memory of the model presets: measured peak on the device against `estimate_memory`.

For each preset, with and without activation checkpointing, builds the model on the device,
runs a few inner steps the node's way (bf16 autocast, fused AdamW, fp32 master weights) on
random tokens, and reads the allocator's peak (`torch.cuda.max_memory_allocated`). The estimate
is the one the README and `node/model.py` quote (weights + grads + AdamW + activations; the
CPU-side round state is not on the device and not counted here). A preset that does not fit is
reported as out of memory, not skipped. Without a GPU it prints the estimates alone.

    python bench/bench_memory.py --device cuda [--sizes 125m,350m,1b] [--batch-size 8] [--seq-len 2048]
    .venv/bin/python bench/bench_memory.py --quick   # CPU: the estimate table only
"""

from __future__ import annotations

import argparse
import time

import torch
from common import parse_with_quick

from neuroshard.node.device import resolve
from neuroshard.node.model import ModelConfig, build_stage, cross_entropy_loss, estimate_memory

GIB = 1024**3


def measure(
    cfg: ModelConfig, batch: int, seq: int, checkpointing: bool, device: str, steps: int
) -> tuple[float, float]:
    """(peak GiB allocated, seconds per step) of `steps` inner steps on `device` with bf16 autocast."""
    placement = resolve(device, "bf16")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(placement.device)
    model = build_stage(cfg, 0, 1).to(placement.device)
    model.activation_checkpointing = checkpointing
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=placement.fused_adamw())
    gen = torch.Generator(device=placement.device).manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=placement.device, generator=gen)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), device=placement.device, generator=gen)
    elapsed = 0.0
    try:
        for step in range(steps):
            torch.cuda.synchronize(placement.device)
            start = time.perf_counter()
            with placement.autocast():
                loss = cross_entropy_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize(placement.device)
            if step > 0:  # the first step allocates AdamW's state and warms the kernels
                elapsed += time.perf_counter() - start
        return torch.cuda.max_memory_allocated(placement.device) / GIB, elapsed / max(1, steps - 1)
    finally:
        del model, opt
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="125m,350m,1b")
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="cpu", help="cuda, cuda:N (cpu: estimates only)")
    args = parse_with_quick(parser, sizes="micro,tiny", batch_size=2, seq_len=32)
    measured = args.device != "cpu" and torch.cuda.is_available()
    where = f"{torch.cuda.get_device_name(resolve(args.device).device)}" if measured else "no GPU"
    print(
        f"batch {args.batch_size}x{args.seq_len}, vocab {args.vocab_size}, bf16 autocast, fused AdamW; {where}"
    )
    print("| preset | params | checkpointing | estimate (GiB) | measured peak (GiB) | s/step | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        cfg = ModelConfig.named(size, vocab_size=args.vocab_size, max_seq_len=max(args.seq_len, 64))
        for checkpointing in (False, True):
            est = estimate_memory(
                cfg, batch=args.batch_size, seq=args.seq_len, activation_checkpointing=checkpointing
            )
            device_gib = (est.train_state + est.activations) / GIB
            peak, per_step, rate = "—", "—", "—"
            if measured:
                try:
                    gib, seconds = measure(
                        cfg, args.batch_size, args.seq_len, checkpointing, args.device, args.steps
                    )
                    peak, per_step = f"{gib:.1f}", f"{seconds:.3f}"
                    rate = f"{args.batch_size * args.seq_len / seconds:,.0f}"
                except torch.OutOfMemoryError:
                    peak = "out of memory"
                    torch.cuda.empty_cache()
            print(
                f"| {size} | {cfg.num_params() / 1e6:.1f}M | {'yes' if checkpointing else 'no'} | "
                f"{device_gib:.1f} | {peak} | {per_step} | {rate} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
