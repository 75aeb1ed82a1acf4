"""DiLoCo against synchronous data parallel at equal tokens, and against one replica alone (issue 18).

Every run trains the same tiny model from the same θ₀ (per seed) on the same text and is scored
on the same held-out windows:

- data parallel: one model, each inner step on the concatenation of the M replicas' batches
  (M·B sequences), so it sees exactly the tokens the M DiLoCo replicas see together;
- one replica alone: replica 0's batches only (a quarter of the tokens at M = 4);
- DiLoCo: M replicas of H inner steps each per round, outer step on the mean of their
  pseudo-gradients (``neuroshard.adversary.simulate``), with the robust default rule beside it
  (``aggregation.aggregate("default", ...)``) where --robust-at names M, and with --overlap
  the same defaults with a one-round-delayed outer step (``simulate(delayed_outer=True)``).

Same inner AdamW, lr schedule (linear warm-up, cosine decay to 10% at the last step), batch per
replica and number of inner steps per replica for all three. The text is the standard library's
source (``common.fresh_clone_text``: what any checkout builds), tokenized with a BPE trained on
its first megabyte; every tenth block of 2,048 tokens is held out.

An outer setting is written ``lr:momentum:n`` (Nesterov) or ``lr:momentum:s`` (heavy ball, or
plain SGD at momentum 0); ``defaults`` is what a bare ``DiLoCoConfig(inner_steps=H)`` carries;
``:wK`` after either ramps the outer lr up over the first K rounds (``defaults:w5``).
Finished runs are cached in a JSON file keyed by everything that decides them, so a sweep and
the table it leads to share runs.

    .venv/bin/python bench/bench_convergence.py --overlap --plot bench/convergence.png  # RESULTS.md's table
    .venv/bin/python bench/bench_convergence.py --outer 1:0:s 0.7:0.9:n 1:0.5:n --seeds 0 --replicas 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CACHE_DIR, fresh_clone_text, parse_with_quick, quick_text

from neuroshard.adversary.simulate import Batch, SimulationResult, simulate
from neuroshard.node.aggregation import aggregate
from neuroshard.node.diloco import DiLoCoConfig, copy_into_parameters
from neuroshard.node.model import ModelConfig, Transformer, cross_entropy_loss
from neuroshard.tokenizer import BPETokenizer

HELD_OUT_FRACTION = 0.1
HELD_OUT_BLOCK = 2048
"""Tokens per block of the train/held-out split (--quick's 70k-token text still gets three held-out blocks)."""
TOKENIZER_TRAIN_CHARS = 1_000_000


@dataclass(frozen=True)
class Setting:
    """What every run of one invocation shares; part of each cached run's key."""

    text_sha: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch: int
    steps: int
    inner_lr: float
    warmup_steps: int
    eval_batches: int
    eval_every: int


@dataclass(frozen=True)
class Outer:
    """One outer optimizer setting."""

    lr: float
    momentum: float
    nesterov: bool
    warmup: int = 0
    """Outer warm-up rounds (DiLoCoConfig.outer_warmup_rounds); written ``…:wK``."""

    @classmethod
    def parse(cls, spec: str, inner_steps: int) -> Outer:
        base, _, warmup = spec.partition(":w")
        if base == "defaults":
            d = DiLoCoConfig(inner_steps=inner_steps)
            return cls(d.outer_step_lr, d.outer_momentum, d.outer_nesterov, int(warmup or 0))
        lr, momentum, kind = base.split(":")
        if kind not in ("n", "s"):
            raise ValueError(f"outer spec {spec!r}: the kind must be n (Nesterov) or s (SGD/heavy ball)")
        return cls(float(lr), float(momentum), kind == "n", int(warmup or 0))


def load_tokens(text: Path, vocab_size: int) -> tuple[Tensor, str]:
    """All of ``text`` as int32 token ids (cached under /tmp), and the text's sha256."""
    raw = text.read_bytes()
    sha = hashlib.sha256(raw).hexdigest()
    path = CACHE_DIR / f"convergence-{sha[:12]}-v{vocab_size}.pt"
    if path.exists():
        return torch.load(path, weights_only=True), sha
    start = time.perf_counter()
    decoded = raw.decode("utf-8")
    tokenizer = BPETokenizer.train([decoded[:TOKENIZER_TRAIN_CHARS]], vocab_size)
    tokens = torch.tensor(tokenizer.encode(decoded), dtype=torch.int32)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{time.monotonic_ns()}")
    torch.save(tokens, tmp)
    tmp.replace(path)
    print(f"(tokenized {text} into {tokens.numel():,} tokens in {time.perf_counter() - start:.1f}s)")
    return tokens, sha


class Windows:
    """Training batches drawn at random from the training tokens, a pure function of
    (seed, replica, inner step); held-out batches are fixed consecutive windows."""

    def __init__(self, tokens: Tensor, setting: Setting) -> None:
        # Every tenth block is held out, so both sides sample every part of the text (its tail alone
        # is the codecs' character tables: a held-out set of those measured nothing).
        blocks = tokens[: tokens.numel() // HELD_OUT_BLOCK * HELD_OUT_BLOCK].long().view(-1, HELD_OUT_BLOCK)
        held = (
            torch.arange(blocks.shape[0]) % round(1 / HELD_OUT_FRACTION) == round(1 / HELD_OUT_FRACTION) - 1
        )
        self.train, self.held_out = blocks[~held].flatten(), blocks[held].flatten()
        self.seq, self.batch = setting.seq_len, setting.batch
        self.offsets = torch.arange(self.seq + 1)
        need = setting.eval_batches * self.batch * (self.seq + 1)
        if need > self.held_out.numel():
            raise ValueError(
                f"{setting.eval_batches} eval batches need {need} held-out tokens, have {self.held_out.numel()}"
            )

    def _cut(self, source: Tensor, starts: Tensor) -> Batch:
        rows = source[starts[:, None] + self.offsets]  # (B, T + 1)
        return rows[:, :-1], rows[:, 1:]

    def replica(self, seed: int, replica: int, step: int) -> Batch:
        g = torch.Generator().manual_seed((seed * 1_000_003 + replica) * 1_000_003 + step)
        starts = torch.randint(0, self.train.numel() - self.seq - 1, (self.batch,), generator=g)
        return self._cut(self.train, starts)

    def concatenated(self, seed: int, replicas: int, step: int) -> Batch:
        parts = [self.replica(seed, i, step) for i in range(replicas)]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])  # (M·B, T)

    def eval_batches(self, count: int) -> list[Batch]:
        """``count`` batches of windows spread evenly over the held-out tokens."""
        stride = (self.held_out.numel() - self.seq - 1) // (count * self.batch)
        starts = torch.arange(count * self.batch) * stride
        return [self._cut(self.held_out, starts[i * self.batch : (i + 1) * self.batch]) for i in range(count)]


def run_key(setting: Setting, **fields: Any) -> str:
    return json.dumps({"setting": asdict(setting), **fields}, sort_keys=True)


def _model_config(setting: Setting, seed: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=setting.vocab_size,
        dim=setting.dim,
        n_layers=setting.n_layers,
        n_heads=setting.n_heads,
        ffn_dim=setting.dim * 8 // 3 // 8 * 8,
        max_seq_len=setting.seq_len,
        init_seed=seed,
    )


def _schedule(setting: Setting) -> dict[str, Any]:
    return {"inner_lr": setting.inner_lr, "warmup_steps": setting.warmup_steps, "total_steps": setting.steps}


def _one_model(setting: Setting) -> DiLoCoConfig:
    """Data parallel or one replica alone: outer SGD at lr 1, momentum 0 just hands on the weights
    (H = the evaluation interval)."""
    return DiLoCoConfig(
        inner_steps=setting.eval_every,
        outer_lr=1.0,
        outer_momentum=0.0,
        outer_nesterov=False,
        **_schedule(setting),
    )


def train(
    setting: Setting,
    windows: Windows,
    *,
    kind: str,
    replicas: int,
    seed: int,
    inner_steps: int = 0,
    outer: Outer | None = None,
    rule: str = "mean",
    delayed: bool = False,
    proxy: str = "own",
) -> dict[str, Any]:
    """One run; returns its held-out curve [(inner step, loss)] and final held-out loss."""
    model = _model_config(setting, seed)
    schedule = _schedule(setting)
    evals = windows.eval_batches(setting.eval_batches)
    batches: Callable[[int, int], Batch]
    if kind == "diloco":
        assert outer is not None
        config = DiLoCoConfig(
            inner_steps=inner_steps,
            outer_lr=outer.lr,
            outer_momentum=outer.momentum,
            outer_nesterov=outer.nesterov,
            outer_warmup_rounds=outer.warmup,
            **schedule,
        )
        every, count = inner_steps, replicas
        batches = lambda i, step: windows.replica(seed, i, step)  # noqa: E731
    else:
        every, count = setting.eval_every, 1
        config = _one_model(setting)
        if kind == "dp":
            batches = lambda _i, step: windows.concatenated(seed, replicas, step)  # noqa: E731
        else:
            batches = lambda _i, step: windows.replica(seed, 0, step)  # noqa: E731
    rule_fn: Callable[[Tensor], Tensor] = (
        (lambda stack: stack.mean(dim=0)) if rule == "mean" else (lambda stack: aggregate("default", stack))
    )
    if setting.steps % every:
        raise ValueError(f"--steps {setting.steps} is not a multiple of H = {every}")
    start = time.perf_counter()
    result: SimulationResult = simulate(
        model,
        config,
        replicas=count,
        rounds=setting.steps // every,
        batches=batches,
        aggregate=rule_fn,
        eval_batches=evals,
        delayed_outer=delayed,
        proxy=proxy,
    )
    curve = [(0, result.initial_eval_loss)] + [
        ((r + 1) * every, loss) for r, loss in enumerate(result.eval_loss)
    ]
    return {"curve": curve, "final": result.eval_loss[-1], "seconds": time.perf_counter() - start}


NOISE_SETS = 4
NOISE_PER_SET = 32
"""`noise_scale`'s sets of fresh windows, and the one-replica batches averaged per set."""


def noise_scale(
    setting: Setting,
    windows: Windows,
    *,
    replicas: int,
    seed: int,
    step: int,
    sets: int = NOISE_SETS,
    per_set: int = NOISE_PER_SET,
) -> dict[str, float]:
    """The simple gradient noise scale B_simple = tr(Σ)/|G|² (McCandlish et al. 2018, "An
    Empirical Model of Large-Batch Training", §2 and appendix A) of data parallel's weights after
    `step` of its steps (the table's data parallel run at the same --steps, stopped there), in
    sequences. Σ is the per-sequence gradient covariance and G the true gradient; the paper's
    model puts a step's progress at ΔL_max/(1 + B_simple/B), so a batch of B sequences gains
    about B/(1 + B/B_simple) times one sequence's progress: nearly linear in B well under
    B_simple, flat well above it.

    Estimated from gradients of B = --batch sequences (one replica's batch) against their mean
    over `per_set` of them (per_set·B sequences): with |G_B|² = |G|² + tr(Σ)/B, two batch sizes
    give both terms. `sets` sets of fresh training windows; numerator and denominator are
    averaged over the sets before their ratio, as the paper advises. The model is for SGD; our
    inner optimizer is AdamW, so read it as the scale of the batch, not a prediction."""
    every = setting.eval_every
    if step % every:
        raise ValueError(f"--noise-scale step {step} is not a multiple of --eval-every {every}")
    model = _model_config(setting, seed)
    theta = simulate(
        model,
        _one_model(setting),
        replicas=1,
        rounds=step // every,
        batches=lambda _i, s: windows.concatenated(seed, replicas, s),
    ).theta
    net = Transformer(model)
    copy_into_parameters(theta, net.parameters())
    small, big = [], []
    for k in range(sets):
        grads = []
        for j in range(per_set):  # windows no run trains on: another seed's draws
            x, y = windows.replica(10_000 + 100 * seed + k, j, step)
            net.zero_grad()
            cross_entropy_loss(net(x), y).backward()
            grads.append(torch.cat([p.grad.flatten() for p in net.parameters() if p.grad is not None]))
        g = torch.stack(grads).double()
        small.append(float(g.square().sum(dim=1).mean()))
        big.append(float(g.mean(dim=0).square().sum()))
    b, bb = setting.batch, setting.batch * per_set
    s_small, s_big = statistics.fmean(small), statistics.fmean(big)
    g2 = (bb * s_big - b * s_small) / (bb - b)
    trace = (s_small - s_big) / (1 / b - 1 / bb)
    return {"step": step, "g2": g2, "trace": trace, "b_simple": trace / g2 if g2 > 0 else float("inf")}


def print_noise_scale(args: argparse.Namespace, setting: Setting, windows: Windows) -> None:
    m = args.replicas[0]
    print(
        f"\ngradient noise scale at data parallel's weights (M = {m}: {m * setting.batch} sequences a step; "
        f"estimated from {setting.batch}- and {NOISE_PER_SET * setting.batch}-sequence gradients, "
        f"{NOISE_SETS} sets)"
    )
    print(
        "| seed | step | \\|G\\|² | tr Σ | B_simple, sequences | B_simple, tokens |\n|---|---|---|---|---|---|"
    )
    for seed in args.seeds:
        for step in args.noise_scale:
            r = noise_scale(setting, windows, replicas=m, seed=seed, step=step)
            print(
                f"| {seed} | {step} | {r['g2']:.4g} | {r['trace']:.4g} | {r['b_simple']:.0f} | "
                f"{r['b_simple'] * setting.seq_len:,.0f} |",
                flush=True,
            )


class Runs:
    """Finished runs, kept in a JSON file so a later invocation reuses them."""

    def __init__(self, setting: Setting, windows: Windows, path: Path | None) -> None:
        self.setting, self.windows, self.path = setting, windows, path
        self.done: dict[str, dict[str, Any]] = {}
        if path is not None and path.exists():
            self.done = json.loads(path.read_text())

    def get(self, **fields: Any) -> dict[str, Any]:
        outer = fields.get("outer")
        # An outer step without warm-up keeps the key it had before the field existed.
        described = {k: v for k, v in asdict(outer).items() if k != "warmup" or v} if outer else None
        key = run_key(self.setting, **{**fields, "outer": described})
        if key not in self.done:
            self.done[key] = train(self.setting, self.windows, **fields)
            label = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
            print(
                f"  {label}: held-out {self.done[key]['final']:.4f} ({self.done[key]['seconds']:.0f}s)",
                file=sys.stderr,
                flush=True,
            )
            if self.path is not None:
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(self.done))
                tmp.replace(self.path)
        return self.done[key]


def mean_final(runs: Sequence[dict[str, Any]]) -> float:
    return statistics.fmean(r["final"] for r in runs)


def table(args: argparse.Namespace, runs: Runs) -> list[dict[str, Any]]:
    """Run the grid and print one row per (M, H); returns the rows with their curves."""
    rows: list[dict[str, Any]] = []
    head = ["M", "H", "data parallel", "one replica"]
    head += [f"DiLoCo {spec}" for spec in args.outer] + ["robust rule (defaults)"]
    head += [f"overlapped (one-round-delayed outer step, {args.overlap_proxy} proxy)"] if args.overlap else []
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for m in args.replicas:
        dp = [runs.get(kind="dp", replicas=m, seed=s) for s in args.seeds]
        alone = [runs.get(kind="single", replicas=1, seed=s) for s in args.seeds]
        dp_loss, alone_loss = mean_final(dp), mean_final(alone)
        for h in args.inner_steps:
            if args.steps % h or args.steps // h < 2:
                continue  # a run of fewer than two rounds says nothing about the outer optimizer
            row: dict[str, Any] = {
                "M": m,
                "H": h,
                "dp": dp_loss,
                "single": alone_loss,
                "diloco": {},
                "curves": {},
            }
            row["curves"]["data parallel"] = dp[0]["curve"]
            row["curves"]["one replica"] = alone[0]["curve"]
            cells = [str(m), str(h), f"{dp_loss:.4f}", f"{alone_loss:.4f} ({alone_loss / dp_loss:.3f}×)"]
            for spec in args.outer:
                if spec != "defaults" and m not in args.compare_at:
                    cells.append("—")
                    continue
                outer = Outer.parse(spec, h)
                got = [
                    runs.get(kind="diloco", replicas=m, seed=s, inner_steps=h, outer=outer)
                    for s in args.seeds
                ]
                loss = mean_final(got)
                row["diloco"][spec] = loss
                row["curves"][f"DiLoCo {spec}"] = got[0]["curve"]
                cells.append(f"{loss:.4f} ({loss / dp_loss:.3f}×)")
            robust = "—"
            if m in args.robust_at:
                outer = Outer.parse("defaults", h)
                got = [
                    runs.get(kind="diloco", replicas=m, seed=s, inner_steps=h, outer=outer, rule="default")
                    for s in args.seeds
                ]
                loss = mean_final(got)
                mean_rule = row["diloco"].get("defaults") or mean_final(
                    [
                        runs.get(kind="diloco", replicas=m, seed=s, inner_steps=h, outer=outer)
                        for s in args.seeds
                    ]
                )
                row["robust"] = loss
                robust = f"{loss:.4f} ({loss / mean_rule:.3f}× mean)"
            cells.append(robust)
            if args.overlap and m in args.compare_at:
                outer = Outer.parse("defaults", h)
                # The key names the proxy only where it is not "own": earlier runs' keys stay valid.
                proxy = {"proxy": args.overlap_proxy} if args.overlap_proxy != "own" else {}
                got = [
                    runs.get(
                        kind="diloco", replicas=m, seed=s, inner_steps=h, outer=outer, delayed=True, **proxy
                    )
                    for s in args.seeds
                ]
                loss = mean_final(got)
                row["curves"][f"DiLoCo defaults, overlapped ({args.overlap_proxy})"] = got[0]["curve"]
                base = row["diloco"].get("defaults")
                cells.append(f"{loss:.4f}" + (f" ({loss / base:.3f}× defaults)" if base else ""))
            print("| " + " | ".join(cells) + " |", flush=True)
            rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install -e '.[bench]')")
        return
    ms = sorted({row["M"] for row in rows})
    hs = sorted({row["H"] for row in rows})
    fig, axes = plt.subplots(len(ms), len(hs), figsize=(4 * len(hs), 3 * len(ms)), squeeze=False)
    for row in rows:
        ax = axes[ms.index(row["M"])][hs.index(row["H"])]
        top, bottom = 0.0, float("inf")
        for label, curve in row["curves"].items():
            steps, losses = zip(*curve[1:], strict=True)
            ax.plot(steps, losses, label=label)
            top = max(top, *(loss for step, loss in curve if step >= steps[-1] / 5))
            bottom = min(bottom, *losses)
        ax.set_ylim(bottom - 0.05, top)  # past the first fifth: the start's steep fall would flatten the rest
        ax.set_title(f"M={row['M']} H={row['H']} (seed 0)", fontsize=9)
        ax.set_xlabel("inner steps per replica")
        ax.legend(fontsize=6)
    for ax_row in axes:
        ax_row[0].set_ylabel("held-out loss")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"(plot: {path})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8], help="M values")
    p.add_argument("--inner-steps", type=int, nargs="+", default=[10, 50, 100, 500], help="H values")
    p.add_argument(
        "--outer", nargs="+", default=["defaults", "0.7:0.9:n", "1:0:s"], help="outer settings (columns)"
    )
    p.add_argument(
        "--compare-at",
        type=int,
        nargs="*",
        default=[4],
        help="M values that run the --outer columns besides defaults",
    )
    p.add_argument(
        "--robust-at", type=int, nargs="*", default=[4], help="M values that also run the default rule"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument(
        "--overlap",
        action="store_true",
        help="also run the defaults with a one-round-delayed outer step (--compare-at M)",
    )
    p.add_argument(
        "--overlap-proxy",
        choices=["own", "eager"],
        default="own",
        help="with --overlap, what stands in for the aggregate in flight: the replica's own progress, "
        "or eager updates (each replica steps at once on 1/M of its own progress plus 1/M of each "
        "other's from the round before)",
    )
    p.add_argument("--steps", type=int, default=500, help="inner steps per replica (and for both baselines)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per replica per inner step")
    p.add_argument("--inner-lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=16, help="held-out batches of --batch sequences")
    p.add_argument(
        "--eval-every", type=int, default=25, help="inner steps between the baselines' evaluations"
    )
    p.add_argument("--text-bytes", type=int, default=4_000_000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", default=str(CACHE_DIR / "convergence-runs.json"), help="'' for none")
    p.add_argument("--plot", default="convergence.png", help="PNG of held-out curves ('' for none)")
    p.add_argument(
        "--noise-scale",
        type=int,
        nargs="*",
        default=[],
        help="data parallel steps (at the first --replicas M) at which to estimate the gradient noise "
        "scale B_simple (McCandlish et al. 2018): the batch below which more batch buys nearly linear progress",
    )
    args = parse_with_quick(
        p, replicas=[2], inner_steps=[5], seeds=[0], steps=10, dim=32, layers=1, vocab=300, seq_len=16,
        batch=2, warmup_steps=2, eval_batches=2, eval_every=5, cache="", outer=["defaults", "1:0:s"], robust_at=[2],
        compare_at=[2], overlap=True, noise_scale=[5],
    )  # fmt: skip
    torch.set_num_threads(args.threads)
    text = quick_text() if args.quick else fresh_clone_text(args.text_bytes)
    tokens, sha = load_tokens(text, args.vocab)
    setting = Setting(
        text_sha=sha, vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
        seq_len=args.seq_len, batch=args.batch, steps=args.steps, inner_lr=args.inner_lr,
        warmup_steps=args.warmup_steps, eval_batches=args.eval_batches, eval_every=args.eval_every,
    )  # fmt: skip
    params = (
        "dim {dim}, {n_layers} layers, vocab {vocab_size}, seq {seq_len}, {batch} seqs/replica/step".format(
            **asdict(setting)
        )
    )
    print(
        f"text: {text} ({tokens.numel():,} tokens, every tenth block of {HELD_OUT_BLOCK} held out); model: {params}"
    )
    print(
        f"{args.steps} inner steps per replica, AdamW lr {args.inner_lr} with {args.warmup_steps} warm-up steps, "
        f"cosine to 10%; seeds {args.seeds}; held-out loss of the final weights, mean over seeds (× = ratio)"
    )
    windows = Windows(tokens, setting)
    rows = table(args, Runs(setting, windows, Path(args.cache) if args.cache else None))
    if args.plot and rows:
        plot(rows, Path(args.plot))
    if args.noise_scale:
        print_noise_scale(args, setting, windows)


if __name__ == "__main__":
    main()
