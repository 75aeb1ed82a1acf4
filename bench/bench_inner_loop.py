"""Inner-loop throughput: our node's training loop vs a bare PyTorch loop, side by side.

Both train the same model (same init), with the same batch shape, optimizer settings and
thread count. Ours is the real `Trainer.run`: shard streaming, DiLoCo inner steps (AdamW,
clipping, schedule), outer steps at round ends, periodic checkpoints and progress lines.
The baseline is the loop a PyTorch user writes by hand over batches already in memory.
Runs alternate (ours, bare, ours, bare, …) so drift in machine speed hits both alike.

    .venv/bin/python bench/bench_inner_loop.py [--steps 200] [--repeats 3] [--threads 2]
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

from neuroshard.data import DataPosition
from neuroshard.node.diloco import DiLoCoConfig
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.trainer import Trainer, TrainerConfig


def ours(
    dataset, model_cfg: ModelConfig, diloco_cfg: DiLoCoConfig, steps: int, batch: int, seq: int
) -> float:  # type: ignore[no-untyped-def]
    with tempfile.TemporaryDirectory() as ckpt:
        trainer = Trainer(
            wallet_id="bench",
            dataset=dataset,
            model_config=model_cfg,
            diloco_config=diloco_cfg,
            config=TrainerConfig(
                batch_size=batch, seq_len=seq, max_steps=steps, checkpoint_every=50, log_every=50
            ),
            checkpoint_dir=Path(ckpt),
            log=lambda line: None,
        )
        trainer.batches.next_batch()  # load the first shard outside the timed region, as the baseline does
        trainer.batches.position = DataPosition()
        start = time.perf_counter()
        trainer.run(threading.Event())
        elapsed = time.perf_counter() - start
    return steps * batch * seq / elapsed


def bare(
    batches: list[tuple[torch.Tensor, torch.Tensor]], model_cfg: ModelConfig, diloco_cfg: DiLoCoConfig
) -> float:
    model = build_stage(model_cfg, 0, 1)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=diloco_cfg.inner_lr,
        betas=diloco_cfg.betas,
        weight_decay=diloco_cfg.weight_decay,
    )
    start = time.perf_counter()
    for inputs, labels in batches:
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    elapsed = time.perf_counter() - start
    return sum(x.numel() for x, _ in batches) / elapsed


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
    args = parse_with_quick(parser, steps=8, repeats=1, model_size="micro", batch_size=2, seq_len=32)
    torch.set_num_threads(args.threads)

    dataset = quick_dataset() if args.quick else bench_dataset(args.text)
    print(f"text: {'the quick text' if args.quick else args.text}")
    model_cfg = ModelConfig.named(args.model_size, vocab_size=dataset.tokenizer.vocab_size)
    diloco_cfg = DiLoCoConfig(inner_steps=100, warmup_steps=min(20, args.steps), total_steps=args.steps)
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
        f"H={diloco_cfg.inner_steps}, checkpoint every 50 steps"
    )
    bare(batches[:10], model_cfg, diloco_cfg)  # warm-up: allocator, kernels
    ours_runs, bare_runs = [], []
    for i in range(args.repeats):
        ours_runs.append(ours(dataset, model_cfg, diloco_cfg, args.steps, args.batch_size, args.seq_len))
        bare_runs.append(bare(batches, model_cfg, diloco_cfg))
        print(f"  run {i + 1}: ours {ours_runs[-1]:,.0f} tok/s   bare {bare_runs[-1]:,.0f} tok/s")
    o, b = statistics.median(ours_runs), statistics.median(bare_runs)
    print(
        f"median: ours {o:,.0f} tok/s, bare PyTorch {b:,.0f} tok/s, ratio ours/bare = {o / b:.3f} (target >= 0.95)"
    )


if __name__ == "__main__":
    main()
