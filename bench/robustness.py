"""Byzantine robustness: every attack × every aggregation rule on the DiLoCo simulator, tiny LM, real text.

M honest + K Byzantine replicas train a small transformer on austen.txt with node/simulate.py.
Byzantine replicas train like everyone else (so each has an honest Δ of its own), then the
attack replaces their rows. The simulator's ``contribution_hook`` sees one replica at a time,
but ALIE, IPM and copy need the honest contributions of the same round ("colluding attackers
share what they observe"), so the attack runs inside the ``aggregate`` callable instead: it
receives the whole (M+K, d) stack, rewrites rows M.., optionally screens the round with
``validation.screen_round``, and applies the rule. That models omniscient colluders.

Equivocation cannot do its real harm here: the simulator has one aggregate, so replicas cannot
diverge. The attacker makes two payloads and the aggregate sees the first; the table shows that a
single validator accepts it, and counts the rounds where the two payloads' sha256 differ, which is
what the network's digest exchange will compare.

Reported: final held-out loss of the (shared) model divided by the clean run's (no attackers,
plain mean, same seed), mean over seeds; and the validator's verdicts, which are computed in
every run whether or not the rule uses them: honest contributions rejected, and the share of
attack contributions caught.

    .venv/bin/python bench/robustness.py            # full: 8+2 and 10+3, 2 seeds, 528 runs
        # a run takes ~2.8 s (8+2) / ~3.7 s (10+3) on an idle core: ~15 min with 2 workers;
        # measured 36 min wall while other jobs kept the load average at 5–6
    .venv/bin/python bench/robustness.py --quick    # smoke: 5+1, 1 seed, 3 one-step rounds (~30 s)
    .venv/bin/python bench/robustness.py --attacks none --rules mean   # calibration: honest stats only
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import math
import multiprocessing
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field

import torch
from common import DEFAULT_TEXT, bench_dataset
from torch import Tensor

from neuroshard.node import aggregation, attacks
from neuroshard.node.diloco import DiLoCoConfig, tensor_sha256
from neuroshard.node.model import ModelConfig
from neuroshard.node.outer.partition import part_bounds
from neuroshard.node.outer.reduce import reduce_part
from neuroshard.node.simulate import simulate
from neuroshard.node.validation import ValidationConfig, Verdict, screen_round

RULES = (
    "mean",
    "trimmed_mean",
    "median",
    "krum",
    "multi_krum",
    "geometric_median",
    "centered_clip",
    "nnm+trimmed_mean",
    "default",
    "val+default",
    "val+mean",
    "part:default",
    "part:mean",
    "part:krum",
    "part:geometric_median",
    "part:centered_clip",
)
"""Rules with f = K (the true attacker count, as robustness papers assume), except "default",
which picks f from n alone (trimmed mean, f = ⌈0.2·n⌉). "val+" screens the round first.
"part:" is the partitioned round's version (``neuroshard.node.outer.reduce.reduce_part``): Δ cut
into n = M + K parts (``partition.part_bounds``), each part screened on its own statistics and
aggregated with the rule alone, as the round's owners do; compare it with "val+" (the default
rule, the mean) or with the whole-vector rule (Krum, geometric median, centered clipping)."""

ATTACKS = ("none", *attacks.ATTACKS)

SCALE_K = 100.0
"""scale: ×100, a boosted Δ (model replacement, Bagdasaryan et al. 2020, boosts by ≈ n/η). ×10 made the
plain mean only 3% worse here: K·10/n ≈ 2 honest Δs in the same direction is just a larger step."""
GAUSSIAN_REL = 100.0
"""gaussian: noise with norm ≈ 100× the honest contributions' RMS norm (σ set from what colluders see;
Xie et al. 2018 use σ = 200 on gradients). At 10× the plain mean was only 3% worse."""
IPM_EPSILON = 0.1
"""ipm: ε = 0.1, the small-ε setting that Xie et al. 2020 aim at robust rules."""
STALE_K = 2
WRONG_BASE_K = 2
"""stale / wrong_base: 2 rounds old; in rounds 0–1 there is nothing that old and the attacker sends its own Δ."""
COLLUDER_SPREAD = 0.1
"""alie / ipm: every colluder would send the same vector, which find_copies flags at once; a colluder
that knows the detector adds its own noise of relative norm 0.1 (2× the 5% tolerance)."""
VALIDATION = ValidationConfig()


@dataclass(kw_only=True, frozen=True)
class Setup:
    """One benchmark geometry: model, data, DiLoCo schedule."""

    rounds: int = 6
    inner_steps: int = 10
    batch_size: int = 8
    seq_len: int = 32
    dim: int = 32
    n_layers: int = 2
    ffn_dim: int = 64
    inner_lr: float = 1e-2
    outer_lr: float = 0.7
    outer_momentum: float = 0.0
    """Plain outer SGD. The paper's Nesterov 0.9 suits H = 500; at H = 10 over 6 rounds it made the
    clean held-out loss oscillate (measured 5.37, 5.48, 5.24, 5.22, 5.22, 5.23 by round) where plain
    SGD fell steadily to 5.04, and a noisy clean run makes every ratio noisy."""
    vocab_size: int = 512
    """A 512-token BPE of austen.txt: the embedding and head dominate a dim-32 model, and 512
    instead of 2048 halves an inner step (7.7 → 3.9 ms on one core)."""
    eval_batches: int = 8
    heldout_tokens: int = 65_536


@dataclass(kw_only=True)
class Job:
    honest: int
    byzantine: int
    seed: int
    attack: str
    rule: str


@dataclass(kw_only=True)
class Outcome:
    job: Job
    final_loss: float
    seconds: float
    honest_total: int = 0
    honest_rejected: dict[str, int] = field(default_factory=dict)
    """Honest contributions rejected, by reason code (copy victims appear as "duplicate")."""
    attack_active: int = 0
    attack_caught: int = 0
    equivocations_visible: int = 0
    """Rounds × attackers where the two equivocated payloads hash differently (what the digest exchange compares)."""
    honest_stats: dict[str, list[float]] = field(default_factory=dict)
    min_honest_pair_distance: float = math.inf


class Diverged(RuntimeError):
    """The aggregate was non-finite: the rule let a NaN or inf through."""


@functools.cache
def load_tokens(vocab_size: int) -> Tensor:
    """All shards of the bench data set, concatenated: (N,) int64."""
    dataset = bench_dataset(DEFAULT_TEXT, vocab_size=vocab_size)
    return torch.cat([dataset.source.fetch(info) for info in dataset.manifest.shards]).long()


def make_batches(
    tokens: Tensor, setup: Setup, replicas: int, seed: int
) -> tuple[Callable[[int, int], tuple[Tensor, Tensor]], list[tuple[Tensor, Tensor]]]:
    """Per-replica training batches from disjoint contiguous regions (each replica reads its own
    part of the novels), and fixed held-out batches from the last ``heldout_tokens``."""
    T, B = setup.seq_len, setup.batch_size
    train, heldout = tokens[: -setup.heldout_tokens], tokens[-setup.heldout_tokens :]
    region = train.numel() // replicas
    steps = setup.rounds * setup.inner_steps
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, region - T - 1, (replicas, steps, B), generator=gen)  # (R, steps, B)
    offsets = torch.arange(T + 1)

    def windows(source: Tensor, first: Tensor) -> tuple[Tensor, Tensor]:
        w = source[first[:, None] + offsets]  # (B, T+1)
        return w[:, :-1], w[:, 1:]

    def batches(replica: int, step: int) -> tuple[Tensor, Tensor]:
        return windows(train, starts[replica, step] + replica * region)

    stride = (heldout.numel() - T - 1) // (setup.eval_batches * 16)
    eval_batches = [
        windows(heldout, torch.arange(16) * stride + k * 16 * stride) for k in range(setup.eval_batches)
    ]
    return batches, eval_batches


def attacker_generator(seed: int, round_index: int, attacker: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{round_index}/{attacker}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


class AttackedAggregate:
    """The simulator's ``aggregate``: rows 0..M−1 are honest, rows M.. are replaced by the attack."""

    def __init__(self, job: Job, diloco: DiLoCoConfig, outcome: Outcome) -> None:
        self.job, self.outcome = job, outcome
        self.round = 0
        self.own_history: list[Tensor] = []  # per round, the attackers' own honest Δs (K, d)
        self.previous: Tensor | None = None  # last aggregate: centered clipping's center
        # θ_r − θ_{r−k} for wrong_base: replay the outer SGD on a shadow from 0. The outer
        # optimizer has no weight decay, so differences of the shadow are differences of θ.
        self.shadow = torch.zeros(0, requires_grad=True)
        self.shadow_opt: torch.optim.SGD | None = None
        self.thetas: list[Tensor] = []
        self.diloco = diloco

    def __call__(self, stack: Tensor) -> Tensor:  # (M+K, d) → (d,)
        M = self.job.honest
        honest, own = stack[:M], stack[M:]
        if not self.thetas:
            self._start_shadow(stack.shape[1])
        self.own_history.append(own.clone())
        rows, active, equivocated = self._attack(honest, own)
        wallets = [f"h{i:02d}" for i in range(M)] + [f"b{j:02d}" for j in range(len(rows) - M)]
        verdicts = screen_round(dict(zip(wallets, rows, strict=True)), (stack.shape[1],), VALIDATION)
        self._record(wallets, verdicts, active, honest, equivocated)
        if self.job.rule.startswith("part:"):
            result = self._partitioned(self.job.rule[len("part:") :], wallets, rows)
        elif self.job.rule.startswith("val+"):
            accepted = [row for w, row in zip(wallets, rows, strict=True) if verdicts[w].ok]
            result = self._apply(self.job.rule[len("val+") :], torch.stack(accepted))
        else:
            result = self._apply(self.job.rule, torch.stack(rows))
        if not bool(torch.isfinite(result).all()):
            raise Diverged(f"round {self.round}: {self.job.rule} returned non-finite values")
        self._advance(result)
        return result

    def _start_shadow(self, d: int) -> None:
        self.shadow = torch.zeros(d, requires_grad=True)
        self.shadow_opt = torch.optim.SGD(
            [self.shadow],
            lr=self.diloco.outer_lr,
            momentum=self.diloco.outer_momentum,
            nesterov=self.diloco.outer_nesterov,
        )
        self.thetas.append(self.shadow.detach().clone())

    def _advance(self, result: Tensor) -> None:
        assert self.shadow_opt is not None
        self.shadow.grad = result.clone()
        self.shadow_opt.step()
        self.thetas.append(self.shadow.detach().clone())
        self.previous = result
        self.round += 1

    def _attack(self, honest: Tensor, own: Tensor) -> tuple[list[Tensor], list[bool], int]:
        """The round's contributions (honest first), whether each attacker attacked, equivocations seen."""
        M, K, r, attack = self.job.honest, self.job.byzantine, self.round, self.job.attack
        rows = list(honest)
        active: list[bool] = []
        equivocated = 0
        rms = float(honest.norm() / math.sqrt(honest.shape[0]))  # typical honest ‖Δ‖
        for j in range(K if attack != "none" else 0):
            gen = attacker_generator(self.job.seed, r, j)
            mine = own[j]
            on = True
            if attack == "sign_flip":
                row = attacks.sign_flip(mine)
            elif attack == "scale":
                row = attacks.scale(mine, SCALE_K)
            elif attack == "gaussian":
                row = attacks.gaussian(mine, GAUSSIAN_REL * rms / math.sqrt(mine.numel()), gen)
            elif attack == "zero":
                row = attacks.zero(mine)
            elif attack == "copy":
                row = attacks.copy(honest[j % M], 0.0 if j == 0 else 0.01, gen)
            elif attack == "alie":
                row = attacks.copy(attacks.alie(honest, M + K, K), COLLUDER_SPREAD, gen)
            elif attack == "ipm":
                row = attacks.copy(attacks.ipm(honest, IPM_EPSILON), COLLUDER_SPREAD, gen)
            elif attack == "stale":
                on = r >= STALE_K
                row = attacks.stale([h[j] for h in self.own_history], STALE_K) if on else mine
            elif attack == "nan":
                row = attacks.nan(mine, 1, gen)
            elif attack == "equivocate":
                row, other = attacks.equivocate(mine, gen)
                equivocated += tensor_sha256(row) != tensor_sha256(other)
            elif attack == "wrong_base":
                on = r >= WRONG_BASE_K
                old = self.thetas[r - WRONG_BASE_K] if on else self.thetas[r]
                row = attacks.wrong_base(mine, self.thetas[r], old)
            else:
                raise ValueError(f"unknown attack {attack!r}; known: {', '.join(ATTACKS)}")
            rows.append(row)
            active.append(on)
        if attack == "none":
            rows = list(honest)  # no attackers at all: the rule's clean cost
        return rows, active, equivocated

    def _partitioned(self, rule: str, wallets: list[str], rows: list[Tensor]) -> Tensor:
        """The rule as the partitioned round applies it: per part, after that part's screening."""
        d = rows[0].numel()
        out = torch.zeros(d)
        for a, b in part_bounds(d, len(rows)):
            if b == a:
                continue
            part = {w: row[a:b].contiguous() for w, row in zip(wallets, rows, strict=True)}
            out[a:b], _ = reduce_part(part, functools.partial(self._apply, rule, span=(a, b)), VALIDATION)
        return out

    def _apply(self, rule: str, stack: Tensor, span: tuple[int, int] | None = None) -> Tensor:
        f = self.job.byzantine
        if rule == "centered_clip":
            # Karimireddy et al. 2021: center = the previous aggregate; 3 iterations as in their experiments.
            previous = self.previous
            if previous is not None and span is not None:
                previous = previous[span[0] : span[1]]
            return aggregation.centered_clip(stack, previous, None, iters=3)
        if rule in ("mean", "median", "geometric_median", "default"):
            return aggregation.aggregate(rule, stack)
        if span is not None:  # a part, as the round reduces it: too few rows left falls back as the node does
            return aggregation.network_rule(rule, f)(stack)
        return aggregation.aggregate(rule, stack, f)

    def _record(
        self,
        wallets: list[str],
        verdicts: dict[str, Verdict],
        active: list[bool],
        honest: Tensor,
        equivocated: int,
    ) -> None:
        out, M = self.outcome, self.job.honest
        for w in wallets[:M]:
            v = verdicts[w]
            out.honest_total += 1
            if not v.ok:
                out.honest_rejected[v.code] = out.honest_rejected.get(v.code, 0) + 1
            for key in ("norm_ratio", "cosine", "variance_ratio"):
                if key in v.stats:
                    out.honest_stats.setdefault(key, []).append(v.stats[key])
        for w, on in zip(wallets[M:], active, strict=True):
            if on:
                out.attack_active += 1
                out.attack_caught += not verdicts[w].ok
        out.equivocations_visible += equivocated
        dist = aggregation.pairwise_sq_distances(honest).sqrt()  # (M, M)
        norms = honest.norm(dim=1)
        rel = dist / torch.maximum(norms[:, None], norms[None, :])
        rel.fill_diagonal_(math.inf)
        out.min_honest_pair_distance = min(out.min_honest_pair_distance, float(rel.min()))


def run_job(job: Job, setup: Setup) -> Outcome:
    torch.set_num_threads(1)
    replicas = job.honest + (job.byzantine if job.attack != "none" else 0)
    tokens = load_tokens(setup.vocab_size)
    # Data regions are cut for M+K replicas even without attackers, so honest replica i reads
    # the same text in every run of a seed.
    batches, eval_batches = make_batches(tokens, setup, job.honest + job.byzantine, job.seed)
    model = ModelConfig(
        vocab_size=setup.vocab_size,
        dim=setup.dim,
        n_layers=setup.n_layers,
        n_heads=2,
        ffn_dim=setup.ffn_dim,
        max_seq_len=setup.seq_len,
        init_seed=job.seed,
    )
    total = setup.rounds * setup.inner_steps
    diloco = DiLoCoConfig(
        inner_steps=setup.inner_steps,
        inner_lr=setup.inner_lr,
        warmup_steps=min(10, total),
        total_steps=total,
        outer_lr=setup.outer_lr,
        outer_momentum=setup.outer_momentum,
        outer_nesterov=setup.outer_momentum > 0,
    )
    outcome = Outcome(job=job, final_loss=math.nan, seconds=0.0)
    start = time.perf_counter()
    try:
        result = simulate(
            model,
            diloco,
            replicas=replicas,
            rounds=setup.rounds,
            batches=batches,
            aggregate=AttackedAggregate(job, diloco, outcome),
            eval_batches=eval_batches,
        )
        outcome.final_loss = result.eval_loss[-1]
    except Diverged:
        outcome.final_loss = math.inf
    outcome.seconds = time.perf_counter() - start
    return outcome


def print_tables(outcomes: list[Outcome], rules: list[str], attack_names: list[str]) -> None:
    splits = sorted({(o.job.honest, o.job.byzantine) for o in outcomes})
    by_key = {(o.job.honest, o.job.byzantine, o.job.seed, o.job.attack, o.job.rule): o for o in outcomes}
    for M, K in splits:
        seeds = sorted({o.job.seed for o in outcomes if (o.job.honest, o.job.byzantine) == (M, K)})
        clean = {
            s: by_key[(M, K, s, "none", "mean")].final_loss
            for s in seeds
            if (M, K, s, "none", "mean") in by_key
        }
        print(
            f"\n### {M} honest + {K} Byzantine — final held-out loss / clean loss (mean of {len(seeds)} seeds)\n"
        )
        print("clean loss (no attackers, mean): " + ", ".join(f"seed {s}: {v:.4f}" for s, v in clean.items()))
        print()
        print("| attack | " + " | ".join(rules) + " |")
        print("|---" * (len(rules) + 1) + "|")
        worst = dict.fromkeys(rules, 0.0)
        for attack in attack_names:
            cells = []
            for rule in rules:
                ratios = [
                    by_key[(M, K, s, attack, rule)].final_loss / clean[s]
                    for s in seeds
                    if (M, K, s, attack, rule) in by_key and s in clean
                ]
                value = statistics.fmean(ratios) if ratios else math.nan
                if attack != "none" and not math.isnan(value):
                    worst[rule] = max(worst[rule], value)
                cells.append(_cell(value))
            print(f"| {attack} | " + " | ".join(cells) + " |")
        print("| **worst attack** | " + " | ".join(f"**{_cell(worst[r])}**" for r in rules) + " |")
        print_validator(outcomes, M, K, attack_names)


def _cell(value: float) -> str:
    if math.isnan(value):
        return "–"
    return "div" if math.isinf(value) else f"{value:.3f}"


def print_validator(outcomes: list[Outcome], M: int, K: int, attack_names: list[str]) -> None:
    print(f"\nValidator ({M}+{K}, verdicts of screen_round in every run above, all rules and seeds):\n")
    print(
        "| attack | attack contributions caught | honest rejected | of which copy victims | two equivocated payloads differ |"
    )
    print("|---|---|---|---|---|")
    for attack in attack_names:
        group = [o for o in outcomes if (o.job.honest, o.job.byzantine, o.job.attack) == (M, K, attack)]
        active = sum(o.attack_active for o in group)
        caught = sum(o.attack_caught for o in group)
        honest = sum(o.honest_total for o in group)
        rejected = sum(sum(o.honest_rejected.values()) for o in group)
        victims = sum(o.honest_rejected.get("duplicate", 0) for o in group)
        rate = f"{caught}/{active} ({100 * caught / active:.0f}%)" if active else "–"
        equiv = f"{sum(o.equivocations_visible for o in group)}/{active}" if attack == "equivocate" else "–"
        print(f"| {attack} | {rate} | {rejected}/{honest} | {victims} | {equiv} |")


def print_honest_ranges(outcomes: list[Outcome]) -> None:
    """The measured honest distribution the ValidationConfig defaults are calibrated against."""
    print("\nHonest contributions vs the round's coordinate median (all runs):\n")
    print("| statistic | n | min | 1% | median | 99% | max | threshold |")
    print("|---|---|---|---|---|---|---|---|")
    limits = {
        "norm_ratio": f"[{VALIDATION.min_norm_ratio}, {VALIDATION.max_norm_ratio}]",
        "cosine": f">= {VALIDATION.min_cosine}",
        "variance_ratio": f"[{VALIDATION.min_variance_ratio}, {VALIDATION.max_variance_ratio}]",
    }
    for key, limit in limits.items():
        values = sorted(v for o in outcomes for v in o.honest_stats.get(key, []))
        if not values:
            continue
        q = statistics.quantiles(values, n=100) if len(values) > 1 else values * 99
        print(
            f"| {key} | {len(values)} | {values[0]:.3f} | {q[0]:.3f} | {statistics.median(values):.3f} | "
            f"{q[98]:.3f} | {values[-1]:.3f} | {limit} |"
        )
    closest = min(o.min_honest_pair_distance for o in outcomes)
    print(
        f"\nClosest pair of honest contributions, relative L2: {closest:.3f} "
        f"(duplicate tolerance {VALIDATION.duplicate_tolerance})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 5+1, 1 seed, 3 rounds of 1 inner step"
    )
    parser.add_argument("--splits", default="8+2,10+3", help="comma-separated honest+byzantine pairs")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--rounds", type=int, default=Setup.rounds)
    parser.add_argument("--inner-steps", type=int, default=Setup.inner_steps)
    parser.add_argument("--workers", type=int, default=2, help="processes, one torch thread each")
    args = parser.parse_args()
    setup = Setup(rounds=args.rounds, inner_steps=args.inner_steps)
    splits = args.splits
    if args.quick:
        setup, splits, args.seeds = Setup(rounds=3, inner_steps=1, eval_batches=1), "5+1", 1
    attack_names = [a for a in args.attacks.split(",") if a]
    rules = [r for r in args.rules.split(",") if r]
    for name in attack_names:
        if name not in ATTACKS:
            parser.error(f"unknown attack {name!r}; known: {', '.join(ATTACKS)}")
    for name in rules:
        if name not in RULES:
            parser.error(f"unknown rule {name!r}; known: {', '.join(RULES)}")
    if "none" not in attack_names or "mean" not in rules:
        print("(note: without the none × mean run there is no clean loss to divide by; ratios show as –)")
    pairs = [tuple(int(x) for x in s.split("+")) for s in splits.split(",")]
    jobs = [
        Job(honest=M, byzantine=K, seed=seed, attack=attack, rule=rule)
        for M, K in pairs
        for seed in range(args.seeds)
        for attack in attack_names
        for rule in rules
    ]
    load_tokens(setup.vocab_size)  # build the data set once before the workers start
    print(
        f"{len(jobs)} runs: splits {splits}, {args.seeds} seed(s), {len(attack_names)} attacks × {len(rules)} rules; "
        f"{asdict(setup)}; {args.workers} workers × 1 thread"
    )
    start = time.perf_counter()
    outcomes: list[Outcome] = []
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=context) as pool:
        futures = [pool.submit(run_job, job, setup) for job in jobs]
        for done, future in enumerate(as_completed(futures), 1):
            o = future.result()
            outcomes.append(o)
            j = o.job
            print(
                f"[{done}/{len(jobs)} {time.perf_counter() - start:6.0f}s] {j.honest}+{j.byzantine} seed {j.seed} "
                f"{j.attack:>10} × {j.rule:<16} loss {o.final_loss:.4f} ({o.seconds:.1f}s)",
                flush=True,
            )
    print(f"\n## Robustness benchmark ({time.perf_counter() - start:.0f}s wall)")
    print_tables(outcomes, rules, attack_names)
    print_honest_ranges(outcomes)


if __name__ == "__main__":
    main()
