"""Byzantine robustness on the DiLoCo simulator: adaptive attacks × aggregation rules, tiny LM, real text.

M honest + K Byzantine replicas train a small transformer with adversary/simulate.py, with the outer
optimizer a bare ``DiLoCoConfig`` carries (Nesterov, momentum 0.5, lr tuned for H: 0.7 at H = 10
since 2026-11-26, 1.0 before; RESULTS.md's earlier tables ran with 1.0) and the outer warm-up a
network.toml gets by default (3 rounds since 2026-11-27, none before: --outer-warmup), for 20 rounds of
H = 10 inner steps (H = 500, the production default, would make one run ~50× longer). The text
is the standard library's source (``common.fresh_clone_text``: what any fresh clone builds), every
tenth block of 2,048 tokens held out. Non-IID (the default column): replica i reads only the i-th
contiguous region of the training text — different modules, different code; IID: every replica
samples the whole text.

Byzantine replicas train like everyone else (so each holds an honest Δ of its own), then the
attack replaces their rows inside the ``aggregate`` callable, which sees the whole (M+K, d) stack.
The adaptive attacks (``attacks.ADAPTIVE``) choose their parameter every round as the largest
whose rows pass the defence's screening (``attacks.adapt``): the rule's own screening for "val+",
"fit+" and "part:" rules (per part for "part:"), ``screen_round`` with the configured thresholds
otherwise ("whole:" included: it screens whole rows the same way). Two knowledge levels, reported separately:

- ``omniscient:NAME``: the colluders see the round's honest Δs (a simulator-only upper bound);
- ``realistic:NAME``: they see their own K honestly trained Δs and the previous round's revealed
  payloads (re-centred on their own mean: ``attacks.realistic_estimate``), and keep 10% of each
  threshold's room in reserve (``attacks.tightened``).

The older fixed-parameter attacks (``attacks.FIXED``) stay selectable with --attacks.

Reported: final held-out loss ÷ the clean run's (no attackers, plain mean, same seed and data),
mean over seeds, the worst attack per rule and knowledge level, and the defence's verdicts per
attack (attack contributions caught, honest contributions refused).

    .venv/bin/python bench/robustness.py --quick     # smoke: 5+1, 1 seed, 4 one-step rounds
    .venv/bin/python bench/robustness.py --splits 8+2 --seeds 1 --rules mean,val+default   # a pilot
    .venv/bin/python bench/robustness.py --attacks none --rules mean   # calibration: honest stats only
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import math
import multiprocessing
import re
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, fields, replace

import torch
from common import bench_dataset, fresh_clone_text, quick_text
from torch import Tensor

from neuroshard.adversary import attacks
from neuroshard.adversary.simulate import simulate
from neuroshard.node import aggregation
from neuroshard.node.diloco import DiLoCoConfig, tensor_digest
from neuroshard.node.model import ModelConfig
from neuroshard.node.network_definition import DEFAULT_OUTER_WARMUP_ROUNDS
from neuroshard.node.outer.partition import part_bounds
from neuroshard.node.outer.reduce import MIN_SCREENED, reduce_part
from neuroshard.node.validation import ValidationConfig, ValidationResult, screen_round

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
    "val+centered_clip",
    "val+nnm+default",
    "val+bucket+default",
    "val+clip+default",
    "part:clip+default",
    "val+hist+default",
    "fit+default",
    "fit+mean",
    "part:default",
    "part:mean",
    "part:krum",
    "part:geometric_median",
    "part:centered_clip",
    "part:trimmed_mean",
    "val+trimmed_mean",
    "val+cclip_median",
    "part:cclip_median",
    "whole:default",
    "part:prev+default",
    "part:prev+wt+default",
    "part:prev+centered_clip",
)
"""Rules with f = K (the true attacker count, as robustness papers assume), except "default",
which is the network's default rule (``aggregation.default_rule``: centered clipping from the
coordinate median since 2026-11-27, the trimmed mean with f = ⌈0.2·n⌉ before; RESULTS.md's
earlier tables ran with the trimmed mean, and "trimmed_mean" with f = K is that rule at the 8+2
and 10+3 splits). Prefixes say how the round is screened
first: "val+" with ``screen_round`` and the configured thresholds; "fit+" with thresholds fitted
to the round's own spread (``fitted_screen``); "part:" is the partitioned round's version
(``neuroshard.node.outer.reduce.reduce_part``: Δ cut into n = M + K parts, each screened on its
own statistics and aggregated alone, as the round's owners do); "whole:" screens whole Δs as
"val+" does and then aggregates each part of the kept rows alone as "part:" does: the partitioned
round if every replica learned each contributor's whole-vector statistics (not built: it needs
the owners' per-part sums gathered before any part is reduced). centered_clip's center is the
previous round's aggregate (Karimireddy et al. 2021); "cclip_median" is centered clipping as a
node runs it when its network definition names "centered_clip" (one iteration from the round's
coordinate median, τ the median distance: a pure function of the round's rows, no history; for
n ≥ 5 the same as "default" since 2026-11-27); "bucket+" averages random pairs first
(Karimireddy, He & Jaggi 2022, s = 2, the permutation seeded by the round); "clip+" scales every
row longer than the rows' median norm down to it first (norm bounding, Sun et al. 2019, "Can You
Really Backdoor Federated Learning?"), so a Δ screened in at the norm-ratio limit weighs no more
than a typical one; "hist+" keeps per-wallet history (the issue's candidate): each wallet's
exponential average of its rows' cosine to the round's aggregate (a row the screening refused
counts as −1), and a wallet whose average has fallen below ``HISTORY_FLOOR`` after
``HISTORY_WARM`` rounds is refused (unless that would refuse every row left). The adaptive
colluders know it: they also require that the
round's rows keep every colluder's average at or above the floor (``AttackedAggregate._screen``).
"prev+" (after "part:") also refuses, on every part, a contributor whose whole Δ's cosine to the
previous round's aggregate is below ``PREV_FLOOR`` (--prev-floor; no check in round 0): the
colluders know it too (their rows must pass it, and the edge family builds around it:
``attacks.Anchor``). The round builds it anchored to the outer momentum buffer instead
(``--anchor momentum``; ``node.outer.reduce.AnchorCheck``, ``[aggregation] anchor_floor``), with
``--later-validation`` for its wider per-part limits from round 1. "prev+wt+" (tried, not adopted:
RESULTS.md, 2026-12-06) also weights each kept row's clipped pull by max(0, its whole-Δ cosine to
the anchor − --weight-offset); --aim moves the colluders' cosine to the anchor above the floor.
Any prefix also takes "cc<S>x<I>"
(``CLIP_VARIANT``): the default rule's τ scaled by S, I iterations. "default" here is the rule
with τ the median distance and one iteration (``aggregation.LEGACY_CLIPPING``); what a
network.toml gets since 2026-12-06 is ``aggregation.DEFAULT_CLIPPING``, τ × 1.25 and 3
iterations, anchored: ``part:prev+cc1.25x3 --anchor momentum --later-validation`` with
``validation.ANCHORED_VALIDATION``'s limits (RESULTS.md, "The clipping's τ and iterations")."""

DEFAULT_RULES = ("mean", "val+default", "part:default")
DEFAULT_ATTACKS = (
    "none",
    *(f"{level}:{name}" for level in attacks.KNOWLEDGE for name in attacks.ADAPTIVE),
)
ATTACKS = ("none", *attacks.FIXED, *DEFAULT_ATTACKS[1:])

SCALE_K = 100.0
"""scale: ×100, a boosted Δ (model replacement, Bagdasaryan et al. 2020, boosts by ≈ n/η)."""
GAUSSIAN_REL = 100.0
"""gaussian: noise with norm ≈ 100× the honest contributions' RMS norm (Xie et al. 2018 use σ = 200)."""
IPM_EPSILON = 0.1
"""ipm: ε = 0.1, the small-ε setting that Xie et al. 2020 aim at robust rules."""
STALE_K = 2
WRONG_BASE_K = 2
"""stale / wrong_base: 2 rounds old; in rounds 0–1 there is nothing that old and the attacker sends its own Δ."""
COLLUDER_SPREAD = 0.1
"""alie / ipm (fixed): every colluder would send the same vector, which find_copies flags at once;
a colluder that knows the detector adds its own noise of relative norm 0.1 (2× the 5% tolerance)."""
VALIDATION = ValidationConfig()
FIT_K = 4.0
"""fit+: a statistic more than FIT_K robust standard deviations (1.4826 × MAD over the round's
contributions) from the round's median is refused, inside the fixed thresholds."""
HISTORY_ALPHA = 0.3
"""hist+: weight of the newest round in a wallet's average cosine to the aggregate."""
HISTORY_WARM = 3
"""hist+: rounds a wallet is seen before its average can refuse it."""
PREV_FLOOR = 0.1
"""prev+: the whole Δ's cosine to the previous round's aggregate below which a contributor is
refused on every part (honest non-IID Δs measured 0.21–0.75 in clean runs; a sign flip of one
sits at minus its own)."""
HISTORY_FLOOR = 0.0
"""hist+: a wallet whose average cosine to the aggregate is below this is refused (--history-floor)."""
HELD_OUT_BLOCK = 2048
"""Tokens per block of the train/held-out split; every tenth block is held out."""


@dataclass(kw_only=True, frozen=True)
class Setup:
    """One benchmark geometry: model, data, DiLoCo schedule."""

    rounds: int = 20
    inner_steps: int = 10
    batch_size: int = 8
    seq_len: int = 32
    dim: int = 32
    n_layers: int = 2
    ffn_dim: int = 64
    inner_lr: float = 1e-2
    vocab_size: int = 512
    """A 512-token BPE: the embedding and head dominate a dim-32 model, and 512 instead of 2048
    halves an inner step (7.7 → 3.9 ms on one core)."""
    eval_batches: int = 8
    quick: bool = False
    """The --quick text (tiny) instead of the fresh-clone text."""
    outer: str | None = None
    """``LR:MOMENTUM:n|s`` (Nesterov or plain SGD) in place of the bare DiLoCoConfig's outer step."""
    outer_warmup: int = DEFAULT_OUTER_WARMUP_ROUNDS
    """``DiLoCoConfig.outer_warmup_rounds``: the network's default ramp (``network_definition.
    DEFAULT_OUTER_WARMUP_ROUNDS``, part of the default defence since 2026-11-27; 0 before)."""
    history_floor: float = HISTORY_FLOOR
    """hist+: the average cosine to the aggregate below which a wallet is refused."""
    prev_floor: float = PREV_FLOOR
    """prev+: the whole-Δ cosine to the previous aggregate below which a contributor is refused."""
    validation: ValidationConfig = field(default_factory=lambda: VALIDATION)
    """The screening's thresholds (--validation overrides the node's defaults)."""
    anchor: str = "aggregate"
    """prev+'s anchor: "aggregate" (the previous round's) or "momentum" (the outer optimizer's
    momentum buffer, an average of the past aggregates that every replica already holds and
    agrees on by hash, so a joining replica has it too)."""
    later_validation: ValidationConfig | None = None
    """--later-validation: the thresholds from round 1 on (``validation`` then holds round 0
    only); meant for prev+, whose anchor exists from round 1."""
    aim: float | None = None
    """--aim: the whole-Δ cosine to the anchor the colluders build at (at least the floor), for a
    defence that weights rows by that cosine (wt+): at the floor a row weighs least."""
    weight_offset: float = 0.0
    """wt+: a row's weight is max(0, cosine to the anchor − this)."""


@dataclass(kw_only=True)
class Job:
    honest: int
    byzantine: int
    seed: int
    attack: str
    rule: str
    data: str = "noniid"


@dataclass(kw_only=True)
class Outcome:
    job: Job
    final_loss: float
    seconds: float
    honest_total: int = 0
    honest_rejected: dict[str, int] = field(default_factory=dict)
    """Honest contributions refused by the rule's screening (any screening, whole or any part),
    by reason code; rules without screening count ``screen_round``'s verdicts."""
    attack_active: int = 0
    attack_caught: int = 0
    gammas: list[float] = field(default_factory=list)
    """The adaptive attack's chosen parameter, per round."""
    equivocations_visible: int = 0
    honest_stats: dict[str, list[float]] = field(default_factory=dict)
    min_honest_pair_distance: float = math.inf
    history: dict[str, list[float]] = field(default_factory=dict)
    """hist+: per round after the warm-up, the lowest honest and the highest attacker average."""


class Diverged(RuntimeError):
    """The aggregate was non-finite: the rule let a NaN or inf through."""


@functools.cache
def load_tokens(vocab_size: int, quick: bool) -> tuple[Tensor, Tensor]:
    """(train, held-out) token streams of the bench text: every tenth block held out, so both
    sides sample every part of the text."""
    text = quick_text() if quick else fresh_clone_text()
    dataset = bench_dataset(text, vocab_size=vocab_size)
    tokens = torch.cat([dataset.source.fetch(info) for info in dataset.manifest.shards]).long()
    blocks = tokens[: tokens.numel() // HELD_OUT_BLOCK * HELD_OUT_BLOCK].view(-1, HELD_OUT_BLOCK)
    held = torch.arange(blocks.shape[0]) % 10 == 9
    return blocks[~held].flatten(), blocks[held].flatten()


def make_batches(
    setup: Setup, replicas: int, seed: int, data: str
) -> tuple[Callable[[int, int], tuple[Tensor, Tensor]], list[tuple[Tensor, Tensor]]]:
    """Per-replica training batches — non-IID: from disjoint contiguous regions (each replica
    reads its own part of the text); IID: from the whole text — and fixed held-out batches."""
    train, heldout = load_tokens(setup.vocab_size, setup.quick)
    T, B = setup.seq_len, setup.batch_size
    region = train.numel() // replicas if data == "noniid" else train.numel()
    steps = setup.rounds * setup.inner_steps
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, region - T - 1, (replicas, steps, B), generator=gen)  # (R, steps, B)
    offsets = torch.arange(T + 1)

    def windows(source: Tensor, first: Tensor) -> tuple[Tensor, Tensor]:
        w = source[first[:, None] + offsets]  # (B, T+1)
        return w[:, :-1], w[:, 1:]

    def batches(replica: int, step: int) -> tuple[Tensor, Tensor]:
        shift = replica * region if data == "noniid" else 0
        return windows(train, starts[replica, step] + shift)

    stride = (heldout.numel() - T - 1) // (setup.eval_batches * 16)
    eval_batches = [
        windows(heldout, torch.arange(16) * stride + k * 16 * stride) for k in range(setup.eval_batches)
    ]
    return batches, eval_batches


def attacker_generator(seed: int, round_index: int, attacker: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{round_index}/{attacker}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def fitted_screen(
    rows: dict[str, Tensor], d: int, base: ValidationConfig = VALIDATION
) -> dict[str, ValidationResult]:
    """screen_round with the norm-ratio and cosine limits fitted to the round: median ± FIT_K
    robust standard deviations of the contributions' own statistics, inside ``base``'s limits."""
    first = screen_round(rows, (d,), base)
    stats = [v.stats for v in first.values() if "norm_ratio" in v.stats]
    if len(stats) < MIN_SCREENED:
        return first

    def centre_spread(key: str) -> tuple[float, float]:
        values = [s[key] for s in stats]
        centre = statistics.median(values)
        return centre, 1.4826 * statistics.median(abs(v - centre) for v in values)

    nr, nr_s = centre_spread("norm_ratio")
    cos, cos_s = centre_spread("cosine")
    fitted = replace(
        base,
        min_norm_ratio=max(base.min_norm_ratio, nr - FIT_K * nr_s),
        max_norm_ratio=max(min(base.max_norm_ratio, nr + FIT_K * nr_s), base.min_norm_ratio + 1e-6),
        min_cosine=max(base.min_cosine, cos - FIT_K * cos_s),
    )
    return screen_round(rows, (d,), fitted)


def bucketed(stack: Tensor, generator: torch.Generator, size: int = 2) -> Tensor:
    """Rows averaged in random buckets of ``size`` (the last may be smaller): (n, d) → (⌈n/size⌉, d).
    One permutation for all columns, so a part of the stack buckets like the same columns of the whole."""
    n = stack.shape[0]
    order = torch.randperm(n, generator=generator)
    groups = [torch.sort(order[i : i + size]).values for i in range(0, n, size)]
    return torch.stack([aggregation.mean(stack[g]) for g in groups])


CLIP_VARIANT = re.compile(r"cc([0-9]*\.?[0-9]+)(?:-([0-9]*\.?[0-9]+))?x([1-9][0-9]*)")
"""Rule "cc<S>x<I>" (any screening prefix): centered clipping from the coordinate median with τ = S ×
the median distance to it, I iterations with that τ; "cc1x1" is the default rule's maths for n ≥ 5.
"cc<S1>-<S2>x<I>": τ moves geometrically from S1 to S2 × that distance over the I iterations (a
wide first pull for honest replicas with unusual data, narrower later ones against a searched
ALIE; tried 2026-12-07)."""


SIGN_AGREEMENT = re.compile(r"sg([0-9]*\.?[0-9]+)\+")
"""Prefix "sg<θ>+<rule>": the rule's aggregate with every coordinate zeroed whose rows agree on the
sign by less than θ (|Σ sign(x_i)| / n < θ): a robust learning rate in the manner of Ozdayi,
Kantarcioglu & Gel (AAAI 2021), who flip such coordinates' step instead; zeroing is the milder
form. Column-local, so a part zeroes like the same columns of the whole (tried 2026-12-07)."""


def sign_masked(stack: Tensor, aggregate: Tensor, threshold: float) -> Tensor:
    """`aggregate` with the coordinates whose rows' sign agreement is below `threshold` set to 0."""
    agreement = torch.sign(stack).sum(dim=0).abs_().div_(stack.shape[0])
    return torch.where(agreement >= threshold, aggregate, torch.zeros_like(aggregate))


CLIP_MOMENTUM = re.compile(r"ccm([0-9]*\.?[0-9]+)x([1-9][0-9]*)")
"""Rule "ccm<S>x<I>": centered clipping around the outer momentum buffer's estimate of one round's
aggregate, (1 − μ)·buffer (its steady state for a constant Δ), τ = S × the median distance to it,
I iterations; the coordinate median where there is no buffer yet (tried 2026-12-07)."""


def clip_variant(stack: Tensor, scale: float, iters: int, last_scale: float | None = None) -> Tensor:
    """``aggregation.centered_clip`` from the coordinate median with τ scaled (the sweep of the
    default rule's two knobs); below ``SMALL_N`` rows the median, as the default rule. With
    `last_scale`, iteration i of I clips at scale · (last_scale / scale)^(i / (I − 1))."""
    rows = stack[torch.isfinite(stack).all(dim=1)]
    if rows.shape[0] < aggregation.SMALL_N:
        return aggregation.aggregate("default", stack)
    center = aggregation.coordinate_median(rows)
    distance = float((rows.double() - center.double()).norm(dim=1).median())
    if not distance > 0:
        return center
    if last_scale is None or iters == 1:
        return aggregation.centered_clip(rows, center, scale * distance, iters=iters)
    for i in range(iters):
        step = scale * (last_scale / scale) ** (i / (iters - 1))
        center = aggregation.centered_clip(rows, center, step * distance, iters=1)
    return center


def norm_clipped(stack: Tensor) -> Tensor:
    """Rows longer than the median row norm scaled down to it (norms taken in float64)."""
    norms = stack.double().norm(dim=1)
    cap = norms.median()
    scale = torch.where(norms > cap, cap / norms, torch.ones_like(norms)).to(stack.dtype)
    return stack * scale[:, None]


def _cosine(a: Tensor, b: Tensor) -> float:
    """cos(a, b) in float64 (0 when either is zero)."""
    a64, b64 = a.double(), b.double()
    denominator = float(a64.norm() * b64.norm())
    return float(a64 @ b64) / denominator if denominator > 0 else 0.0


def split_rule(rule: str) -> tuple[str, str]:
    """("val" | "fit" | "part" | "whole" | "", the aggregation rule after the screening prefix)."""
    for prefix, kind in (("val+", "val"), ("fit+", "fit"), ("part:", "part"), ("whole:", "whole")):
        if rule.startswith(prefix):
            return kind, rule[len(prefix) :]
    return "", rule


class AttackedAggregate:
    """The simulator's ``aggregate``: rows 0..M−1 are honest, rows M.. are replaced by the attack."""

    def __init__(
        self,
        job: Job,
        diloco: DiLoCoConfig,
        outcome: Outcome,
        history_floor: float = HISTORY_FLOOR,
        validation: ValidationConfig = VALIDATION,
        prev_floor: float = PREV_FLOOR,
        later_validation: ValidationConfig | None = None,
        anchor: str = "aggregate",
        aim: float | None = None,
        weight_offset: float = 0.0,
    ) -> None:
        self.job, self.outcome, self.history_floor = job, outcome, history_floor
        self.aim, self.weight_offset = aim, weight_offset
        self.prev_floor = prev_floor
        self.validation = validation
        self.later_validation = later_validation
        self.anchor_kind = anchor
        self.screen_kind, self.rule = split_rule(job.rule)
        self.with_prev = self.rule.startswith("prev+")
        if self.with_prev:
            if self.screen_kind != "part":
                raise ValueError(
                    f"{job.rule}: prev+ is simulated for the partitioned round only (part:prev+…)"
                )
            self.rule = self.rule[len("prev+") :]
        self.weighted = self.rule.startswith("wt+")
        if self.weighted:
            if not self.with_prev:
                raise ValueError(f"{job.rule}: wt+ weights by the anchor's cosine (part:prev+wt+…)")
            self.rule = self.rule[len("wt+") :]
        self.with_history = self.rule.startswith("hist+")
        if self.with_history:
            self.rule = self.rule[len("hist+") :]
        self.history: dict[str, tuple[float, int]] = {}  # wallet → (average cosine, rounds seen)
        self.round = 0
        self.own_history: list[Tensor] = []  # per round, the attackers' own honest Δs (K, d)
        self.revealed: Tensor | None = None  # the previous round's honest payloads (M, d)
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
        if self.round >= 1 and self.later_validation is not None:
            self.validation = self.later_validation  # for the screening and the colluders' search alike
        self.own_history.append(own.clone())
        rows, active, equivocated = self._attack(honest, own)
        wallets = [f"h{i:02d}" for i in range(M)] + [f"x{j:02d}" for j in range(len(rows) - M)]
        by_wallet = dict(zip(wallets, rows, strict=True))
        d = stack.shape[1]
        plain = screen_round(by_wallet, (d,), self.validation)  # the honest statistics, whatever the rule
        if self.screen_kind == "part":
            anchored = self._anchor_refuses(by_wallet)
            kept_wallets = [w for w in wallets if w not in anchored]
            result, refused = self._partitioned(kept_wallets, [by_wallet[w] for w in kept_wallets], len(rows))
            refused = anchored | refused
        else:
            verdicts = fitted_screen(by_wallet, d, self.validation) if self.screen_kind == "fit" else plain
            refused = {w: v.reason for w, v in verdicts.items() if not v.ok}
            if self.with_history:
                late = {w: "history" for w in by_wallet if w not in refused and self._history_refuses(w)}
                if len(refused) + len(late) < len(by_wallet):  # never an empty round
                    refused |= late
            kept = rows if not self.screen_kind else [r for w, r in by_wallet.items() if w not in refused]
            if self.screen_kind == "whole":
                result = self._per_part(torch.stack(kept), len(rows))
            else:
                result = self._apply(self.rule, torch.stack(kept))
        if self.with_history:
            self._remember(by_wallet, refused, result)
        self._record(wallets, plain, refused, active, honest, equivocated)
        if not bool(torch.isfinite(result).all()):
            raise Diverged(f"round {self.round}: {self.job.rule} returned non-finite values")
        self._advance(result)
        self.revealed = honest.clone()
        return result

    def _history_refuses(self, wallet: str, after_this_round: float | None = None) -> bool:
        """Whether the wallet's average refuses it in the coming round; with ``after_this_round``,
        whether that average, once this round is counted, would refuse it in the next one."""
        value, seen = self.history.get(wallet, (1.0, 0))
        if after_this_round is not None:
            value, seen = after_this_round, seen + 1
        return seen >= HISTORY_WARM and value < self.history_floor

    def _averaged(self, wallet: str, cosine: float) -> float:
        """The wallet's average after a round whose row had this cosine to the aggregate."""
        value, seen = self.history.get(wallet, (cosine, 0))
        return cosine if seen == 0 else (1 - HISTORY_ALPHA) * value + HISTORY_ALPHA * cosine

    def _remember(self, by_wallet: dict[str, Tensor], refused: dict[str, str], result: Tensor) -> None:
        M = self.job.honest
        for w, row in by_wallet.items():
            cosine = -1.0 if w in refused and refused[w] != "history" else _cosine(row, result)
            self.history[w] = (self._averaged(w, cosine), self.history.get(w, (0.0, 0))[1] + 1)
        if self.round + 1 >= HISTORY_WARM:
            ranked = [(w, v) for w, (v, _) in self.history.items()]
            self.outcome.history.setdefault("honest", []).append(min(v for w, v in ranked[:M]))
            if ranked[M:]:
                self.outcome.history.setdefault("attack", []).append(max(v for w, v in ranked[M:]))

    def _start_shadow(self, d: int) -> None:
        self.shadow = torch.zeros(d, requires_grad=True)
        self.shadow_opt = torch.optim.SGD(
            [self.shadow],
            lr=self.diloco.outer_step_lr,
            momentum=self.diloco.outer_momentum,
            nesterov=self.diloco.outer_nesterov,
        )
        self.thetas.append(self.shadow.detach().clone())

    def _advance(self, result: Tensor) -> None:
        assert self.shadow_opt is not None
        warmup = self.diloco.outer_warmup_rounds  # the engines' ramp (DiLoCo._outer_lr_now)
        ramp = min(1.0, (self.round + 1) / warmup) if warmup else 1.0
        self.shadow_opt.param_groups[0]["lr"] = self.diloco.outer_step_lr * ramp
        self.shadow.grad = result.clone()
        self.shadow_opt.step()
        self.thetas.append(self.shadow.detach().clone())
        self.previous = result
        self.round += 1

    def _attack(self, honest: Tensor, own: Tensor) -> tuple[list[Tensor], list[bool], int]:
        """The round's contributions (honest first), whether each attacker attacked, equivocations seen."""
        attack = self.job.attack
        if attack == "none":
            return list(honest), [], 0  # no attackers at all: the rule's clean cost
        if ":" in attack:
            return [*honest, *self._adaptive(honest, own)], [True] * own.shape[0], 0
        return self._fixed(honest, own)

    def _adaptive(self, honest: Tensor, own: Tensor) -> list[Tensor]:
        level, name = self.job.attack.split(":")
        if level == "omniscient":
            estimate, config = honest, self.validation
        else:
            revealed = self.revealed
            deviations = None if revealed is None else revealed - revealed.mean(dim=0)
            estimate = attacks.realistic_estimate(own, deviations)
            config = attacks.tightened(self.validation, attacks.REALISTIC_MARGIN)
        gen = attacker_generator(self.job.seed, self.round, 0)
        anchor = self._anchor()  # the previous aggregate is public: no margin at either level
        if anchor is not None and self.aim is not None:
            anchor = attacks.Anchor(anchor.direction, max(anchor.floor, self.aim))
        chosen = attacks.adapt(
            name,
            estimate,
            own.shape[0],
            gen,
            config=config,
            screen=self._screen(config, anchor),
            anchor=anchor,
        )
        self.outcome.gammas.append(chosen.gamma)
        return list(chosen.rows)

    def _screen(self, config: ValidationConfig, anchor: attacks.Anchor | None = None) -> attacks.Screen:
        """The colluders' acceptance test: the defence's own screening (``config``'s thresholds);
        under hist+, also every colluder's average after this round at or above the floor (the
        aggregate predicted as the rule over their estimate and their rows)."""
        base = self._screen_only(config)
        if anchor is not None:
            screened = base

            def base(estimate: Tensor, crafted: Tensor) -> bool:
                # As the defence does: rows under the floor are out before any part is screened.
                if not all(anchor.admits(r) for r in crafted):
                    return False
                kept = [r for r in estimate if anchor.admits(r)]
                return screened(torch.stack(kept) if kept else estimate, crafted)

        if not self.with_history:
            return base

        def keeps_history(estimate: Tensor, crafted: Tensor) -> bool:
            if not base(estimate, crafted):
                return False
            predicted = self._apply(self.rule, torch.cat([estimate, crafted]))
            return all(
                not self._history_refuses(f"x{j:02d}", self._averaged(f"x{j:02d}", _cosine(row, predicted)))
                for j, row in enumerate(crafted)
            )

        return keeps_history

    def _screen_only(self, config: ValidationConfig) -> attacks.Screen:
        if self.screen_kind == "part":
            parts = self.job.honest + self.job.byzantine

            def per_part(estimate: Tensor, crafted: Tensor) -> bool:
                rows = torch.cat([estimate, crafted])
                wallets = [f"h{i:04d}" for i in range(estimate.shape[0])] + [
                    f"x{j:04d}" for j in range(crafted.shape[0])
                ]
                for a, b in part_bounds(rows.shape[1], parts):
                    if b > a:
                        part = {w: r[a:b].contiguous() for w, r in zip(wallets, rows, strict=True)}
                        _, refused = reduce_part(part, aggregation.mean, config)
                        if any(w.startswith("x") for w in refused):
                            return False
                return True

            return per_part
        if self.screen_kind == "fit":

            def fitted(estimate: Tensor, crafted: Tensor) -> bool:
                rows = {f"h{i:04d}": r for i, r in enumerate(estimate)}
                rows |= {f"x{j:04d}": r for j, r in enumerate(crafted)}
                verdicts = fitted_screen(rows, estimate.shape[1], config)
                return all(verdicts[f"x{j:04d}"].ok for j in range(crafted.shape[0]))

            return fitted
        return attacks.screen_passes(config)

    def _fixed(self, honest: Tensor, own: Tensor) -> tuple[list[Tensor], list[bool], int]:
        M, K, r, attack = self.job.honest, self.job.byzantine, self.round, self.job.attack
        rows = list(honest)
        active: list[bool] = []
        equivocated = 0
        rms = float(honest.norm() / math.sqrt(honest.shape[0]))  # typical honest ‖Δ‖
        for j in range(K):
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
                equivocated += tensor_digest(row) != tensor_digest(other)
            elif attack == "wrong_base":
                on = r >= WRONG_BASE_K
                old = self.thetas[r - WRONG_BASE_K] if on else self.thetas[r]
                row = attacks.wrong_base(mine, self.thetas[r], old)
            else:
                raise ValueError(f"unknown attack {attack!r}; known: {', '.join(ATTACKS)}")
            rows.append(row)
            active.append(on)
        return rows, active, equivocated

    def _anchor(self) -> attacks.Anchor | None:
        """prev+'s whole-Δ check (none in the first round: there is no previous aggregate). The
        previous aggregate is public, so colluders at either knowledge level know it exactly."""
        if not self.with_prev or self.previous is None:
            return None
        if self.anchor_kind == "momentum":
            assert self.shadow_opt is not None
            buffer = self.shadow_opt.state[self.shadow].get("momentum_buffer")
            if buffer is None:  # plain outer SGD keeps none: nothing to anchor to
                return None
            return attacks.Anchor(buffer.detach().clone(), self.prev_floor)
        return attacks.Anchor(self.previous, self.prev_floor)

    def _anchor_refuses(self, by_wallet: dict[str, Tensor]) -> dict[str, str]:
        """prev+: the contributors whose whole Δ's cosine to the anchor is under the floor (none if
        that would be more than half of them, as ``AnchorCheck.refusals``; "everyone" when most
        tables of "The anchored round" were measured, 2026-11-28, which no run there tells apart)."""
        anchor = self._anchor()
        if anchor is None:
            return {}
        low = {w: "prev_cosine" for w, r in by_wallet.items() if not anchor.admits(r)}
        return low if 2 * len(low) <= len(by_wallet) else {}

    def _partitioned(
        self, wallets: list[str], rows: list[Tensor], parts: int
    ) -> tuple[Tensor, dict[str, str]]:
        """The rule as the partitioned round applies it: per part, after that part's screening,
        over ``parts`` parts (the round's members, refused ones included). Returns the aggregate
        and the wallets refused on some part (with the first reason)."""
        d = rows[0].numel()
        out = torch.zeros(d)
        refused: dict[str, str] = {}
        weights = self._weights(dict(zip(wallets, rows, strict=True)))
        for j, (a, b) in enumerate(part_bounds(d, parts)):
            if b == a:
                continue
            part = {w: row[a:b].contiguous() for w, row in zip(wallets, rows, strict=True)}
            apply = functools.partial(self._apply, self.rule, span=(a, b))
            if weights is not None:
                apply = functools.partial(self._weighted, part, weights)
            out[a:b], part_refused = reduce_part(part, apply, self.validation)
            for w, reason in part_refused.items():
                refused.setdefault(w, f"part {j}: {reason}")
        return out, refused

    def _weights(self, by_wallet: dict[str, Tensor]) -> dict[str, float] | None:
        """wt+: each contributor's weight, max(0, whole-Δ cosine to the anchor − offset); None (equal
        weights) without an anchor or when every weight would be 0."""
        anchor = self._anchor()
        if not self.weighted or anchor is None or not bool(anchor.direction.any()):
            return None
        weights = {
            w: max(0.0, _cosine(r, anchor.direction) - self.weight_offset) for w, r in by_wallet.items()
        }
        return weights if any(v > 0 for v in weights.values()) else None

    def _weighted(self, part: dict[str, Tensor], weights: dict[str, float], stack: Tensor) -> Tensor:
        """The default rule (one centered clipping step from the coordinate median, τ = the median
        distance) with the clipped pulls averaged by weight. ``stack`` holds the part's rows that
        passed its screening, in ``part``'s order."""
        kept = [w for w in sorted(part) if any(torch.equal(part[w], row) for row in stack)]
        if len(kept) != stack.shape[0] or stack.shape[0] < aggregation.SMALL_N:
            return self._apply(self.rule, stack, span=(0, 0))
        w = torch.tensor([weights[k] for k in kept], dtype=torch.float64)
        if not float(w.sum()) > 0:
            return self._apply(self.rule, stack, span=(0, 0))
        center = stack.double().quantile(0.5, dim=0)
        diffs = stack.double() - center
        norms = diffs.norm(dim=1)
        tau = float(norms.median())
        if not tau > 0:
            return center.float()
        clip = torch.clamp(tau / norms, max=1.0)
        return (center + (w * clip) @ diffs / w.sum()).float()

    def _per_part(self, kept: Tensor, n: int) -> Tensor:
        """The rule on each of the n parts of the kept rows alone (no screening: it was whole-vector)."""
        out = torch.zeros(kept.shape[1])
        for a, b in part_bounds(kept.shape[1], n):
            if b > a:
                out[a:b] = self._apply(self.rule, kept[:, a:b].contiguous(), span=(a, b))
        return out

    def _clip_around_momentum(
        self, stack: Tensor, scale: float, iters: int, span: tuple[int, int] | None
    ) -> Tensor:
        """CLIP_MOMENTUM: centered clipping around (1 − μ) × the outer momentum buffer."""
        buffer = (
            None if self.shadow_opt is None else self.shadow_opt.state[self.shadow].get("momentum_buffer")
        )
        rows = stack[torch.isfinite(stack).all(dim=1)]
        if buffer is None or rows.shape[0] < aggregation.SMALL_N:
            return clip_variant(stack, scale, iters)
        mu = float(self.shadow_opt.param_groups[0]["momentum"])  # type: ignore[union-attr]
        center = (1 - mu) * buffer.detach()
        if span is not None:
            center = center[span[0] : span[1]]
        distance = float((rows.double() - center.double()).norm(dim=1).median())
        if not distance > 0:
            return center.clone()
        return aggregation.centered_clip(rows, center.contiguous(), scale * distance, iters=iters)

    def _apply(self, rule: str, stack: Tensor, span: tuple[int, int] | None = None) -> Tensor:
        f = self.job.byzantine
        masked = SIGN_AGREEMENT.match(rule)
        if masked:
            inner = self._apply(rule[masked.end() :], stack, span)
            return sign_masked(stack, inner, float(masked[1]))
        if rule.startswith("bucket+"):
            gen = attacker_generator(
                self.job.seed, self.round, 1_000_000
            )  # the round's seed, not an attacker's
            return self._apply(rule[len("bucket+") :], bucketed(stack, gen), span)
        if rule.startswith("clip+"):
            return self._apply(rule[len("clip+") :], norm_clipped(stack), span)
        if rule == "centered_clip":
            # Karimireddy et al. 2021: center = the previous aggregate; 3 iterations as in their experiments.
            previous = self.previous
            if previous is not None and span is not None:
                previous = previous[span[0] : span[1]]
            return aggregation.centered_clip(stack, previous, None, iters=3)
        around = CLIP_MOMENTUM.fullmatch(rule)
        if around:
            return self._clip_around_momentum(stack, float(around[1]), int(around[2]), span)
        variant = CLIP_VARIANT.fullmatch(rule)
        if variant:
            last = None if variant[2] is None else float(variant[2])
            return clip_variant(stack, float(variant[1]), int(variant[3]), last)
        if rule == "cclip_median":  # what a node runs when its network names "centered_clip": no history
            return aggregation.network_rule("centered_clip", f)(stack)
        if rule in ("mean", "median", "geometric_median", "default"):
            return aggregation.aggregate(rule, stack)
        if span is not None:  # a part, as the round reduces it: too few rows left falls back as the node does
            return aggregation.network_rule(rule, f)(stack)
        if stack.shape[0] < aggregation.min_contributions(rule, f):
            return aggregation.aggregate("default", stack)
        return aggregation.aggregate(rule, stack, f)

    def _record(
        self,
        wallets: list[str],
        plain: dict[str, ValidationResult],
        refused: dict[str, str],
        active: list[bool],
        honest: Tensor,
        equivocated: int,
    ) -> None:
        """Counts the defence's verdicts (``refused``; ``screen_round``'s when the rule screens
        nothing) and the honest statistics against the round's median."""
        out, M = self.outcome, self.job.honest
        if not self.screen_kind:
            refused = {w: v.reason for w, v in plain.items() if not v.ok}
        for w in wallets[:M]:
            out.honest_total += 1
            if w in refused:
                code = refused[w].split(": ")[1] if refused[w].startswith("part ") else refused[w]
                code = code.split(":", 1)[0]
                out.honest_rejected[code] = out.honest_rejected.get(code, 0) + 1
            for key in ("norm_ratio", "cosine", "variance_ratio"):
                if key in plain[w].stats:
                    out.honest_stats.setdefault(key, []).append(plain[w].stats[key])
        for w, on in zip(wallets[M:], active, strict=True):
            if on:
                out.attack_active += 1
                out.attack_caught += w in refused
        out.equivocations_visible += equivocated
        if self.previous is not None:  # whole-Δ cosine to the last aggregate (every replica holds it)
            for row in honest:
                out.honest_stats.setdefault("prev_cosine", []).append(_cosine(row, self.previous))
                for a, b in part_bounds(row.numel(), len(wallets)):
                    out.honest_stats.setdefault("part_prev_cosine", []).append(
                        _cosine(row[a:b], self.previous[a:b])
                    )
        dist = aggregation.pairwise_sq_distances(honest).sqrt()  # (M, M)
        norms = honest.norm(dim=1)
        rel = dist / torch.maximum(norms[:, None], norms[None, :])
        rel.fill_diagonal_(math.inf)
        out.min_honest_pair_distance = min(out.min_honest_pair_distance, float(rel.min()))


def run_job(job: Job, setup: Setup) -> Outcome:
    torch.set_num_threads(1)
    replicas = job.honest + (job.byzantine if job.attack != "none" else 0)
    # Data regions are cut for M+K replicas even without attackers, so honest replica i reads
    # the same text in every run of a seed.
    batches, eval_batches = make_batches(setup, job.honest + job.byzantine, job.seed, job.data)
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
    # The outer step a bare DiLoCoConfig carries (Nesterov, momentum 0.5, lr tuned for H: 0.7 at the
    # default H = 10, 1.0 from H = 20; node.diloco.tuned_outer_lr): the default.
    diloco = DiLoCoConfig(
        inner_steps=setup.inner_steps,
        inner_lr=setup.inner_lr,
        warmup_steps=min(10, total),
        total_steps=total,
        **outer_settings(setup.outer),
        outer_warmup_rounds=setup.outer_warmup,
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
            aggregate=AttackedAggregate(
                job,
                diloco,
                outcome,
                setup.history_floor,
                setup.validation,
                setup.prev_floor,
                setup.later_validation,
                setup.anchor,
                setup.aim,
                setup.weight_offset,
            ),
            eval_batches=eval_batches,
        )
        outcome.final_loss = result.eval_loss[-1]
        if not math.isfinite(outcome.final_loss):
            outcome.final_loss = math.inf
    except Diverged:
        outcome.final_loss = math.inf
    outcome.seconds = time.perf_counter() - start
    return outcome


def print_tables(outcomes: list[Outcome], rules: list[str], attack_names: list[str]) -> None:
    groups = sorted({(o.job.data, o.job.honest, o.job.byzantine) for o in outcomes})
    by_key = {
        (o.job.data, o.job.honest, o.job.byzantine, o.job.seed, o.job.attack, o.job.rule): o for o in outcomes
    }
    for data, M, K in groups:
        seeds = sorted(
            {o.job.seed for o in outcomes if (o.job.data, o.job.honest, o.job.byzantine) == (data, M, K)}
        )
        clean = {
            s: by_key[(data, M, K, s, "none", "mean")].final_loss
            for s in seeds
            if (data, M, K, s, "none", "mean") in by_key
        }
        print(
            f"\n### {data}, {M} honest + {K} Byzantine — final held-out loss / clean loss "
            f"(mean of {len(seeds)} seeds)\n"
        )
        print("clean loss (no attackers, mean): " + ", ".join(f"seed {s}: {v:.4f}" for s, v in clean.items()))
        print()
        print("| attack | " + " | ".join(rules) + " |")
        print("|---" * (len(rules) + 1) + "|")
        levels = ["omniscient", "realistic", "fixed"]
        worst = {(level, r): 0.0 for level in levels for r in rules}
        for attack in attack_names:
            level = attack.split(":")[0] if ":" in attack else "fixed"
            cells = []
            for rule in rules:
                ratios = [
                    by_key[(data, M, K, s, attack, rule)].final_loss / clean[s]
                    for s in seeds
                    if (data, M, K, s, attack, rule) in by_key and s in clean
                ]
                value = statistics.fmean(ratios) if ratios else math.nan
                if attack != "none" and not math.isnan(value):
                    worst[(level, rule)] = max(worst[(level, rule)], value)
                cells.append(_cell(value))
            print(f"| {attack} | " + " | ".join(cells) + " |")
        for level in levels:
            if any(
                a.startswith(level) or (level == "fixed" and ":" not in a and a != "none")
                for a in attack_names
            ):
                row = " | ".join(f"**{_cell(worst[(level, r)])}**" for r in rules)
                print(f"| **worst, {level}** | {row} |")
        print_validator(outcomes, data, M, K, attack_names, rules)


def _cell(value: float) -> str:
    if math.isnan(value):
        return "–"
    return "div" if math.isinf(value) else f"{value:.3f}"


def print_validator(
    outcomes: list[Outcome], data: str, M: int, K: int, attack_names: list[str], rules: list[str]
) -> None:
    print(
        f"\nVerdicts ({data}, {M}+{K}): attack contributions caught / honest contributions refused, by the rule's screening\n"
    )
    print("| attack | γ chosen (median) | " + " | ".join(rules) + " |")
    print("|---" * (len(rules) + 2) + "|")
    for attack in attack_names:
        cells = []
        gammas: list[float] = []
        for rule in rules:
            group = [
                o
                for o in outcomes
                if (o.job.data, o.job.honest, o.job.byzantine, o.job.attack, o.job.rule)
                == (data, M, K, attack, rule)
            ]
            gammas += [g for o in group for g in o.gammas]
            active = sum(o.attack_active for o in group)
            caught = sum(o.attack_caught for o in group)
            refused = sum(sum(o.honest_rejected.values()) for o in group)
            honest = sum(o.honest_total for o in group)
            cells.append(f"{caught}/{active} · {refused}/{honest}" if group else "–")
        gamma = f"{statistics.median(gammas):.3g}" if gammas else "–"
        print(f"| {attack} | {gamma} | " + " | ".join(cells) + " |")


def print_honest_ranges(outcomes: list[Outcome], validation: ValidationConfig = VALIDATION) -> None:
    """The measured honest distribution the screening's thresholds are calibrated against."""
    for data in sorted({o.job.data for o in outcomes}):
        print(f"\nHonest contributions vs the round's coordinate median ({data}, all runs):\n")
        print("| statistic | n | min | 1% | median | 99% | max | threshold |")
        print("|---|---|---|---|---|---|---|---|")
        limits = {
            "norm_ratio": f"[{validation.min_norm_ratio}, {validation.max_norm_ratio}]",
            "cosine": f">= {validation.min_cosine}",
            "variance_ratio": f"[{validation.min_variance_ratio}, {validation.max_variance_ratio}]",
            "prev_cosine": "(whole Δ vs the previous aggregate; prev+ refuses below --prev-floor)",
            "part_prev_cosine": "(per part vs the previous aggregate; not screened)",
        }
        group = [o for o in outcomes if o.job.data == data]
        for key, limit in limits.items():
            values = sorted(v for o in group for v in o.honest_stats.get(key, []))
            if not values:
                continue
            q = statistics.quantiles(values, n=100) if len(values) > 1 else values * 99
            print(
                f"| {key} | {len(values)} | {values[0]:.3f} | {q[0]:.3f} | {statistics.median(values):.3f} | "
                f"{q[98]:.3f} | {values[-1]:.3f} | {limit} |"
            )
        closest = min(o.min_honest_pair_distance for o in group)
        print(
            f"\nClosest pair of honest contributions, relative L2: {closest:.3f} "
            f"(duplicate tolerance {validation.duplicate_tolerance})"
        )


def print_history(outcomes: list[Outcome]) -> None:
    """hist+: how far apart the honest and the attacking wallets' averages stayed."""
    group = [o for o in outcomes if o.history]
    if not group:
        return
    print(
        f"\nhist+ (α {HISTORY_ALPHA}, from round {HISTORY_WARM}): the lowest honest "
        "and the highest attacker average cosine to the aggregate over the rounds\n"
    )
    print("| data | split | attack | rule | lowest honest | highest attacker |")
    print("|---|---|---|---|---|---|")
    for o in sorted(group, key=lambda o: (o.job.data, o.job.honest, o.job.attack, o.job.rule, o.job.seed)):
        j, h = o.job, o.history
        attack = f"{max(h['attack']):.3f}" if h.get("attack") else "–"
        print(
            f"| {j.data} | {j.honest}+{j.byzantine} | {j.attack} | {j.rule} | {min(h['honest']):.3f} | {attack} |"
        )


def outer_settings(spec: str | None) -> dict[str, float | bool]:
    """DiLoCoConfig's outer fields from ``LR:MOMENTUM:n|s`` (n: Nesterov, s: plain SGD); {} for None."""
    if spec is None:
        return {}
    lr, momentum, kind = spec.split(":")
    if kind not in ("n", "s"):
        raise ValueError(f"--outer {spec!r}: the third field is n (Nesterov) or s (SGD)")
    return {"outer_lr": float(lr), "outer_momentum": float(momentum), "outer_nesterov": kind == "n"}


def validation_config(spec: str) -> ValidationConfig:
    """``VALIDATION`` with the fields of ``name=value,…`` replaced ("" keeps it); ValueError names a
    field that does not exist or a value ValidationConfig refuses."""
    changes: dict[str, float] = {}
    known = {f.name for f in fields(ValidationConfig) if f.type in (float, "float")}
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        if name not in known:
            raise ValueError(f"unknown field {name!r}; known: {', '.join(sorted(known))}")
        changes[name] = float(value)
    return replace(VALIDATION, **changes)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 5+1, 1 seed, 4 rounds of 1 inner step"
    )
    parser.add_argument("--splits", default="8+2,10+3", help="comma-separated honest+byzantine pairs")
    parser.add_argument("--data", default="noniid,iid", help="noniid (own region per replica), iid, or both")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument(
        "--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1"
    )
    parser.add_argument("--attacks", default=",".join(DEFAULT_ATTACKS), help=f"known: {', '.join(ATTACKS)}")
    parser.add_argument("--rules", default=",".join(DEFAULT_RULES), help=f"known: {', '.join(RULES)}")
    parser.add_argument("--rounds", type=int, default=Setup.rounds)
    parser.add_argument("--inner-steps", type=int, default=Setup.inner_steps)
    parser.add_argument("--workers", type=int, default=2, help="processes, one torch thread each")
    parser.add_argument(
        "--outer",
        help="LR:MOMENTUM:n|s, the outer step of every run (default: DiLoCoConfig's for --inner-steps, "
        "Nesterov 0.7 / 0.5 at H = 10)",
    )
    parser.add_argument(
        "--history-floor",
        type=float,
        default=HISTORY_FLOOR,
        help=f"hist+: refuse a wallet whose average cosine to the aggregate is below this (default {HISTORY_FLOOR})",
    )
    parser.add_argument(
        "--outer-warmup",
        type=int,
        default=DEFAULT_OUTER_WARMUP_ROUNDS,
        help="outer rounds over which the outer lr ramps up (default: a network.toml's, "
        f"{DEFAULT_OUTER_WARMUP_ROUNDS}; 0 for the tables before 2026-11-27)",
    )
    parser.add_argument(
        "--prev-floor",
        type=float,
        default=PREV_FLOOR,
        help=f"prev+: refuse a Δ whose cosine to the previous aggregate is below this (default {PREV_FLOOR})",
    )
    parser.add_argument(
        "--validation",
        default="",
        help="screening thresholds in place of the node's defaults, e.g. max_norm_ratio=8,min_cosine=0 "
        "(fields of neuroshard.node.validation.ValidationConfig)",
    )
    parser.add_argument(
        "--anchor",
        choices=("aggregate", "momentum"),
        default="aggregate",
        help="prev+'s anchor: the previous round's aggregate (default) or the outer momentum buffer",
    )
    parser.add_argument(
        "--later-validation",
        default=None,
        help="thresholds as --validation's for rounds 1 on, --validation's then holding round 0 only "
        "(with part:prev+…: the node's limits while there is no anchor, open ones after)",
    )
    parser.add_argument(
        "--aim",
        type=float,
        default=None,
        help="the whole-Δ cosine to the anchor the colluders build at (default: the floor)",
    )
    parser.add_argument(
        "--weight-offset",
        type=float,
        default=0.0,
        help="wt+: a row weighs max(0, its cosine to the anchor − this) (default 0)",
    )
    args = parser.parse_args()
    outer_settings(args.outer)  # refuse a malformed spec before any run starts
    try:
        validation = validation_config(args.validation)
        later = None if args.later_validation is None else validation_config(args.later_validation)
    except ValueError as exc:
        parser.error(f"--validation / --later-validation: {exc}")
    setup = Setup(
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        outer=args.outer,
        history_floor=args.history_floor,
        prev_floor=args.prev_floor,
        outer_warmup=args.outer_warmup,
        validation=validation,
        later_validation=later,
        anchor=args.anchor,
        aim=args.aim,
        weight_offset=args.weight_offset,
    )
    splits, data_modes = args.splits, args.data
    if args.quick:
        # HISTORY_WARM + 1 rounds, so that hist+ refuses (or the colluders avoid it) at least once.
        setup = Setup(
            rounds=HISTORY_WARM + 1,
            inner_steps=1,
            eval_batches=1,
            quick=True,
            history_floor=args.history_floor,
            prev_floor=args.prev_floor,
            outer_warmup=args.outer_warmup,
            validation=validation,
            later_validation=later,
            anchor=args.anchor,
        )
        splits, args.seeds, data_modes = "5+1", 1, "noniid"
        args.attacks = "none,omniscient:alie_search,realistic:edge,omniscient:mimic"
        if args.rules == parser.get_default("rules"):
            args.rules = ",".join([*DEFAULT_RULES, "val+hist+default", "whole:default", "part:prev+default"])
    attack_names = [a for a in args.attacks.split(",") if a]
    rules = [r for r in args.rules.split(",") if r]
    for name in attack_names:
        if name not in ATTACKS:
            parser.error(f"unknown attack {name!r}; known: {', '.join(ATTACKS)}")
    for name in rules:
        kind, rule = split_rule(name)
        if rule.startswith("prev+") and kind != "part":
            parser.error(f"{name!r}: prev+ is simulated for the partitioned round only (part:prev+…)")
        bare = rule.removeprefix("prev+")
        bare = bare[m.end() :] if (m := SIGN_AGREEMENT.match(bare)) else bare
        bare = bare.removeprefix("bucket+")
        if name not in RULES and not (CLIP_VARIANT.fullmatch(bare) or CLIP_MOMENTUM.fullmatch(bare)):
            parser.error(f"unknown rule {name!r}; known: {', '.join(RULES)}")
    if "none" not in attack_names or "mean" not in rules:
        print("(note: without the none × mean run there is no clean loss to divide by; ratios show as –)")
    pairs = [tuple(int(x) for x in s.split("+")) for s in splits.split(",")]
    jobs = [
        Job(honest=M, byzantine=K, seed=seed, attack=attack, rule=rule, data=data)
        for data in data_modes.split(",")
        for M, K in pairs
        for seed in range(args.first_seed, args.first_seed + args.seeds)
        for attack in attack_names
        for rule in rules
    ]
    load_tokens(setup.vocab_size, setup.quick)  # build the data set once before the workers start
    print(
        f"{len(jobs)} runs: data {data_modes}, splits {splits}, {args.seeds} seed(s), {len(attack_names)} attacks × "
        f"{len(rules)} rules; {asdict(setup)}; outer: {args.outer or 'DiLoCoConfig defaults'}; {args.workers} workers × 1 thread"
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
            gamma = f" γ~{statistics.median(o.gammas):.3g}" if o.gammas else ""
            print(
                f"[{done}/{len(jobs)} {time.perf_counter() - start:6.0f}s] {j.data} {j.honest}+{j.byzantine} "
                f"seed {j.seed} {j.attack:>24} × {j.rule:<18} loss {o.final_loss:.4f} "
                f"caught {o.attack_caught}/{o.attack_active} honest refused "
                f"{sum(o.honest_rejected.values())}{gamma} ({o.seconds:.1f}s)",
                flush=True,
            )
    print(f"\n## Robustness benchmark ({time.perf_counter() - start:.0f}s wall)")
    print_tables(outcomes, rules, attack_names)
    print_honest_ranges(outcomes, setup.validation)
    print_history(outcomes)


if __name__ == "__main__":
    main()
