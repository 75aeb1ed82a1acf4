"""A checkpoint at a round boundary, as the node writes it vs as it did, side by side.

After an outer step a replica's weights are θ_round's bits. `DiLoCo.checkpoint_state` then
stores each parameter as a view of the θ_round snapshot, which torch.save writes once, and
`save_checkpoint` writes without the zip records' CRC-32s (torch.load never reads them). The
baseline is the node before both: the model's own snapshot beside θ_round (the layout a
checkpoint taken mid-round still has), written with CRC-32s. A third layout, ours with CRC-32s,
separates the two changes. All snapshot the same engine (weights, AdamW moments after one real
inner step, outer momentum after one outer step) and write through `atomic_write` (temporary
file, fsync, rename, fsync of the directory); writes alternate into the same directory. Each
line splits a checkpoint's time into the snapshot (device to CPU, the bit comparison) and the
write; the summary gives medians of each layout's totals and of the per-repeat ratios.

This is the write that ends every run (`Trainer.save` in `Trainer.run`'s last step), which a
bare training loop does not do: bench_inner_loop.py reports its time as "final checkpoint".

    .venv/bin/python bench/bench_checkpoint.py --model-size 125m --vocab-size 4096
    python3 bench/bench_checkpoint.py --device cuda --model-size 125m --vocab-size 4096 --threads 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import parse_with_quick

from neuroshard.data.files import atomic_write, torch_save
from neuroshard.node.checkpoint import CHECKPOINT_FORMAT, CheckpointIdentity, save_checkpoint
from neuroshard.node.device import resolve, snapshot_to_cpu
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, Transformer

IDENTITY = CheckpointIdentity(wallet_id="bench", stage=0, model_fingerprint="bench", tokenizer_sha256="bench")


def at_round_boundary(engine: DiLoCo, vocab: int) -> None:
    """One real inner step (AdamW's moments exist), then the outer step: the weights are θ_round."""
    device = engine.params[0].device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, 65), generator=gen).to(device)
    engine.inner_step(ids[:, :-1], ids[:, 1:])
    engine.local_outer_step()
    assert engine.steps_in_round == 0


def two_copies(engine: DiLoCo) -> dict[str, Any]:
    """The layout before checkpoint_state: the model's snapshot beside θ_round's."""
    return {"model": snapshot_to_cpu(engine.model.state_dict()), "diloco": engine.state_dict()}


def save_with_crc32s(path: Path, identity: CheckpointIdentity, state: dict[str, Any]) -> None:
    """save_checkpoint as it was: torch.save's default, a CRC-32 computed for every record."""
    payload = {"format": CHECKPOINT_FORMAT, "identity": identity.as_dict(), "state": state}
    atomic_write(path, lambda tmp: torch_save(payload, tmp, crc32=True))


LAYOUTS: dict[str, tuple[Any, Any]] = {
    "ours": (DiLoCo.checkpoint_state, save_checkpoint),
    "ours + CRC-32s": (DiLoCo.checkpoint_state, save_with_crc32s),
    "before": (two_copies, save_with_crc32s),
}


def timed_checkpoint(take: Any, save: Any, engine: DiLoCo, path: Path) -> tuple[float, float, int]:
    """(snapshot s, write s, file bytes) of one checkpoint."""
    start = time.perf_counter()
    state = take(engine)
    snapshot = time.perf_counter() - start
    start = time.perf_counter()
    save(path, IDENTITY, state)
    written = time.perf_counter() - start
    return snapshot, written, path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, mps")
    parser.add_argument("--model-size", default="125m")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=4, help="checkpoints of each layout")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temporary directory)"
    )
    args = parse_with_quick(parser, model_size="micro", vocab_size=256, repeats=1)
    torch.set_num_threads(args.threads)
    placement = resolve(args.device, "auto")
    config = ModelConfig.named(args.model_size, vocab_size=args.vocab_size)
    torch.manual_seed(0)
    engine = DiLoCo(Transformer(config), DiLoCoConfig(inner_steps=100), placement=placement)
    at_round_boundary(engine, args.vocab_size)
    n = engine.theta_round.numel()
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        print(
            f"model {args.model_size} ({n:,} params), device {placement.describe()}, torch threads {args.threads}, "
            f"writing to {directory}"
        )
        runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in LAYOUTS}
        names = list(LAYOUTS)
        for r in range(args.repeats):
            # Rotated, so no layout always goes first (the first snapshot allocates the pinned memory).
            for name in names[r % len(names) :] + names[: r % len(names)]:
                take, save = LAYOUTS[name]
                snapshot, written, size = timed_checkpoint(take, save, engine, Path(directory) / "ckpt.pt")
                runs[name].append((snapshot, written, size))
                print(
                    f"  {r}: {name:<14} snapshot {snapshot:.3f} s, write {written:.3f} s, "
                    f"total {snapshot + written:.3f} s, {size / 1e9:.3f} GB"
                )

    def median_of(rows: list[tuple[float, float, int]], part: Any) -> float:
        return statistics.median(part(row) for row in rows)

    base = runs["before"]
    for name, rows in runs.items():
        total = median_of(rows, lambda row: row[0] + row[1])
        ratio = statistics.median((a[0] + a[1]) / (b[0] + b[1]) for a, b in zip(rows, base, strict=True))
        print(
            f"median {name:<14}: snapshot {median_of(rows, lambda row: row[0]):.3f} s, "
            f"write {median_of(rows, lambda row: row[1]):.3f} s, total {total:.3f} s, "
            f"{median_of(rows, lambda row: row[2]) / 1e9:.3f} GB; time / before: {total / median_of(base, lambda row: row[0] + row[1]):.3f} "
            f"(of medians), {ratio:.3f} (median of each repeat's ratio)"
        )


if __name__ == "__main__":
    main()
