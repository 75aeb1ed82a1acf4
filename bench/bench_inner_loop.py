"""Inner-loop throughput: our node's training loop vs a bare PyTorch loop, side by side.

Both train the same model (same init), with the same batch shape, optimizer settings, device,
precision and thread count. Ours is the real `Trainer.run`: shard streaming, DiLoCo inner steps
(AdamW, clipping, schedule), outer steps at round ends (on CUDA a lone replica's outer step runs
on the device, with θ_round and the momentum kept on the CPU), periodic
checkpoints and progress lines (each run prints where its wall time went). The baseline is the loop a PyTorch user writes by hand over
batches already on the device (same autocast, same fused AdamW); "engine alone" is the DiLoCo
engine's inner steps over those batches (clipping, schedule), to place a gap. Runs alternate (ours, bare,
ours, bare, …) so drift in machine speed hits both alike.

Model FLOPs utilisation (MFU, Chowdhery et al. 2022, appendix B): 6·N + 12·L·C·T FLOPs per
token (N parameters, L layers, width C, sequence T) times tokens/s, over the device's peak dense
bf16 (or fp32/TF32) rate: from a table of known GPUs, or --peak-tflops.

    .venv/bin/python bench/bench_inner_loop.py [--steps 200] [--repeats 3] [--threads 2]
    .venv/bin/python bench/bench_inner_loop.py --device cuda --model-size 125m --batch-size 16 --seq-len 1024
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import DEFAULT_TEXT, bench_dataset, parse_with_quick, quick_dataset

from neuroshard.cli.node_flags import checkpoint_interval
from neuroshard.data import DataPosition
from neuroshard.node.device import Placement, resolve
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.trainer import Trainer, TrainerConfig

PEAK_TFLOPS = {
    # Dense bf16 tensor-core peaks from the vendors' data sheets (fp32 runs use TF32, half these).
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 80GB HBM3": 989.0,
    "H100 PCIe": 756.0,
    "H100": 756.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 125.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
}


def peak_tflops(placement: Placement, override: float | None) -> float | None:
    """The device's peak dense TFLOP/s at the run's precision; None when unknown (CPU, other GPUs)."""
    if override is not None:
        return override
    if not placement.is_cuda:
        return None
    name = torch.cuda.get_device_name(placement.device)
    for key, value in PEAK_TFLOPS.items():  # most specific names first
        if key in name:
            return value if placement.precision in ("bf16", "fp16") else value / 2
    return None


def flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """6N for the matmuls forward and backward plus 12·L·C·T for attention (PaLM, appendix B)."""
    return 6 * cfg.num_params() + 12 * cfg.n_layers * cfg.dim * seq


def _sync(placement: Placement) -> None:
    if placement.is_cuda:
        torch.cuda.synchronize(placement.device)


def ours(
    dataset,
    model_cfg: ModelConfig,
    diloco_cfg: DiLoCoConfig,
    steps: int,
    batch: int,
    seq: int,
    placement: Placement,
    checkpoint_every: int,
    checkpoint_interval_s: float,
    breakdowns: list[str],
    steady: list[float],
) -> float:  # type: ignore[no-untyped-def]
    with tempfile.TemporaryDirectory() as ckpt:
        trainer = Trainer(
            wallet_id="bench",
            dataset=dataset,
            model_config=model_cfg,
            diloco_config=diloco_cfg,
            config=TrainerConfig(
                batch_size=batch,
                seq_len=seq,
                max_steps=steps,
                checkpoint_every=checkpoint_every,
                checkpoint_interval_s=checkpoint_interval_s,
                log_every=50,
            ),
            checkpoint_dir=Path(ckpt),
            log=lambda line: None,
            placement=placement,
        )
        trainer.batches.next_batch()  # load the first shard outside the timed region, as the baseline does
        trainer.batches.position = DataPosition()
        _sync(placement)
        start = time.perf_counter()
        result = trainer.run(threading.Event())
        _sync(placement)
        elapsed = time.perf_counter() - start
        skipped = (
            f", {trainer.checkpoints_skipped} checkpoint turns skipped" if trainer.checkpoints_skipped else ""
        )
        breakdowns.append(result.breakdown() + skipped)
    tokens = steps * batch * seq
    steady.append(tokens / (elapsed - result.seconds.get("final checkpoint", 0.0)))
    return tokens / elapsed


def bare(
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    model_cfg: ModelConfig,
    diloco_cfg: DiLoCoConfig,
    placement: Placement,
) -> float:
    model = build_stage(model_cfg, 0, 1).to(placement.device)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=diloco_cfg.inner_lr,
        betas=diloco_cfg.betas,
        weight_decay=diloco_cfg.weight_decay,
        fused=placement.fused_adamw(),
    )
    on_device = [(x.to(placement.device), y.to(placement.device)) for x, y in batches]
    _sync(placement)
    start = time.perf_counter()
    for inputs, labels in on_device:
        with placement.autocast():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    _sync(placement)
    elapsed = time.perf_counter() - start
    return sum(x.numel() for x, _ in batches) / elapsed


def _engine_on(
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    model_cfg: ModelConfig,
    diloco_cfg: DiLoCoConfig,
    placement: Placement,
) -> tuple[DiLoCo, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A fresh engine on the placement and the batches moved there (synchronised)."""
    diloco = DiLoCo(build_stage(model_cfg, 0, 1), diloco_cfg, placement=placement)
    on_device = [(x.to(placement.device), y.to(placement.device)) for x, y in batches]
    _sync(placement)
    return diloco, on_device


def engine(
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    model_cfg: ModelConfig,
    diloco_cfg: DiLoCoConfig,
    placement: Placement,
) -> float:
    """The DiLoCo engine's inner steps (clipping, lr schedule, bookkeeping) over the baseline's
    device batches: no trainer, no data feed, no rounds or checkpoints. Between bare and ours,
    it says which layer a gap comes from."""
    diloco, on_device = _engine_on(batches, model_cfg, diloco_cfg, placement)
    start = time.perf_counter()
    for inputs, labels in on_device:
        diloco.queue_inner_step(inputs, labels).item()
    _sync(placement)
    elapsed = time.perf_counter() - start
    return sum(x.numel() for x, _ in batches) / elapsed


def profile(
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    model_cfg: ModelConfig,
    diloco_cfg: DiLoCoConfig,
    placement: Placement,
) -> None:
    """torch.profiler's top operators for 20 engine steps (--profile): where the device time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    diloco, on_device = _engine_on(batches[:25], model_cfg, diloco_cfg, placement)
    for inputs, labels in on_device[:5]:
        diloco.inner_step(inputs, labels)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if placement.is_cuda else [])
    with torch_profile(activities=activities) as prof:
        for inputs, labels in on_device[5:]:
            diloco.inner_step(inputs, labels)
    key = "self_cuda_time_total" if placement.is_cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=15))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda, cuda:N, mps")
    parser.add_argument("--precision", default="auto", help="auto, fp32, bf16, fp16")
    parser.add_argument("--inner-steps", type=int, default=100, help="H (the node's default: 100)")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top operators")
    parser.add_argument(
        "--no-engine", action="store_true", help="skip the engine-alone runs (a third less time on long runs)"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=50, help="steps between checkpoints (the node's default: 50)"
    )
    parser.add_argument(
        "--checkpoint-interval",
        type=float,
        help="seconds a checkpoint turn waits after the last write (the node's default: 0 on the CPU, 300 on accelerators)",
    )
    parser.add_argument(
        "--peak-tflops", type=float, help="the device's peak dense TFLOP/s (default: known GPUs)"
    )
    args = parse_with_quick(parser, steps=8, repeats=1, model_size="micro", batch_size=2, seq_len=32)
    torch.set_num_threads(args.threads)
    placement = resolve(args.device, args.precision)
    interval = checkpoint_interval(args, placement)

    dataset = quick_dataset() if args.quick else bench_dataset(args.text)
    print(f"text: {'the quick text' if args.quick else args.text}")
    model_cfg = ModelConfig.named(args.model_size, vocab_size=dataset.tokenizer.vocab_size)
    diloco_cfg = DiLoCoConfig(
        inner_steps=args.inner_steps, warmup_steps=min(20, args.steps), total_steps=args.steps
    )
    probe = Trainer(
        wallet_id="bench",
        dataset=dataset,
        model_config=model_cfg,
        diloco_config=diloco_cfg,
        config=TrainerConfig(batch_size=args.batch_size, seq_len=args.seq_len),
        checkpoint_dir=Path(tempfile.mkdtemp()),
        log=lambda line: None,
    )
    batches = [probe.batches.next_batch() for _ in range(args.steps)]
    print(
        f"model {args.model_size} ({sum(p.numel() for p in probe.model.parameters()):,} params), "
        f"batch {args.batch_size}x{args.seq_len}, {args.steps} steps, torch threads {args.threads}, "
        f"H={diloco_cfg.inner_steps}, checkpoint every {args.checkpoint_every} steps and at most every {interval:g} s; device {placement.describe()}"
    )
    bare(batches[:10], model_cfg, diloco_cfg, placement)  # warm-up: allocator, kernels
    ours_runs, bare_runs, engine_runs, breakdowns, steady_runs = [], [], [], [], []
    for i in range(args.repeats):
        ours_runs.append(
            ours(
                dataset,
                model_cfg,
                diloco_cfg,
                args.steps,
                args.batch_size,
                args.seq_len,
                placement,
                args.checkpoint_every,
                interval,
                breakdowns,
                steady_runs,
            )
        )
        bare_runs.append(bare(batches, model_cfg, diloco_cfg, placement))
        if not args.no_engine:
            engine_runs.append(engine(batches, model_cfg, diloco_cfg, placement))
        alone = f"{engine_runs[-1]:,.0f} tok/s" if engine_runs else "not run"
        print(
            f"  run {i + 1}: ours {ours_runs[-1]:,.0f} tok/s ({steady_runs[-1]:,.0f} without the final write)   "
            f"bare {bare_runs[-1]:,.0f} tok/s   engine alone {alone}"
        )
        print(f"    ours' wall time: {breakdowns[-1]}")
    o, b = statistics.median(ours_runs), statistics.median(bare_runs)
    st = statistics.median(steady_runs)
    alone = f"{statistics.median(engine_runs) / b:.3f}" if engine_runs else "not run"
    print(
        f"median: ours {o:,.0f} tok/s, bare PyTorch {b:,.0f} tok/s, ratio ours/bare = {o / b:.3f} (target >= 0.95); "
        f"without the run's final checkpoint write (once per run, not per round) {st / b:.3f}; "
        f"engine alone/bare = {alone}"
    )
    if args.profile:
        profile(batches, model_cfg, diloco_cfg, placement)
    flops = flops_per_token(model_cfg, args.seq_len)
    peak = peak_tflops(placement, args.peak_tflops)
    achieved = f"model GFLOP/s: ours {o * flops / 1e9:,.1f}, bare {b * flops / 1e9:,.1f}"
    if peak is None:
        print(f"{achieved}; MFU n/a (no peak known for this device: --peak-tflops)")
    else:
        print(
            f"{achieved}; MFU ours {o * flops / 1e12 / peak:.3f}, bare {b * flops / 1e12 / peak:.3f} (peak {peak:.0f} TFLOP/s)"
        )


if __name__ == "__main__":
    main()
