"""`neuroshard-adversary --attack NAME`: a node that lies on the real wire, to test the defences.

TESTING ONLY. An `Attacker` decides what a Byzantine replica commits to. Its round,
`ForgingRound` (an ``OuterRound`` subclass the node's composition root builds in place of the
honest one, ``neuroshard.cli.node.Roles``), hands it the honest `RoundInput` and θ_round after
the H honest inner steps, commits to and publishes the forged input instead, and logs a note. The maths of every attack is in ``neuroshard.adversary.attacks``;
this module only decides what to feed it:

- ``sign_flip``, ``scale`` (×k), ``gaussian`` (σ = param · RMS of the honest Δ), ``zero``:
  the honest Δ transformed;
- ``ipm`` and ``alie`` from what the attacker holds when it commits. Every member commits
  before any Δ can be read, so no peer's Δ: ipm sends −ε · its own Δ; alie sends the mean
  plus z standard deviations of its own Δ alone, which is its Δ (σ of one row is zero);
- ``stale``: its own honest Δ from k rounds ago; ``wrong_base``: a Δ trained from θ of k
  rounds ago, committed against that old θ's hash (honest Δ for the first k rounds: no
  history yet);
- ``copy``, ``equivocate``, ``nan``: not mounted (honest Δ, and the note says so). A copy
  needs a Δ the round reveals only after everyone committed; a second commitment or a NaN
  part is refused before any owner aggregates it, and forging them needs hooks inside the
  round rather than a different input;
- the adaptive families (``attacks.ADAPTIVE``), at the realistic knowledge level: before it
  commits, the attacker holds its own honest Δ of this round and what earlier rounds revealed
  — their aggregates, which it reads back from its θ_round history through the outer step it
  knows (``revealed_aggregate``). Its estimate of the honest rows is its own Δ plus its
  earlier Δs' deviations from those aggregates, ± each (``attacks.realistic_estimate``); it
  picks the largest parameter whose Δ passes the partitioned round's per-part screening on
  that estimate with 10% of each threshold's room in reserve (``attacks.adapt``). Nothing it
  uses is revealed after it commits, so it commits once, like an honest member.

``--owner-attack NAME`` instead runs one of the cheating owners of ``neuroshard.adversary.owners``
(wrong_aggregate, equivocator, withholder, mismatched_part) as this node's round: those cheat
inside the round, in the parts the node owns, not in its contribution (``adversary.cli``).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor

from neuroshard.adversary import attacks
from neuroshard.adversary.attacks import ADAPTIVE, ATTACKS
from neuroshard.node import aggregation
from neuroshard.node.aggregation import default_rule
from neuroshard.node.outer.partition import part_bounds
from neuroshard.node.outer.reduce import ANCHOR_FLOOR, reduce_part
from neuroshard.node.outer.round import OuterRound, RoundFactory
from neuroshard.node.outer.state import RoundInput, RoundResult
from neuroshard.node.validation import ANCHORED_VALIDATION, ValidationConfig

DEFAULT_PARAMS: dict[str, float] = {
    "scale": 10.0,
    "gaussian": 1.0,
    "copy": 0.01,
    "ipm": 0.5,
    "stale": 2.0,
    "nan": 1.0,
    "equivocate": 0.1,
    "wrong_base": 1.0,
}
"""--attack-param when not given: scale k; gaussian σ in units of the honest Δ's RMS; copy's
relative noise (1%, the issue's); ipm ε; stale and wrong_base k rounds back; nan's NaN count;
equivocate's relative spread between its two payloads. alie's param is z (default: Baruch et
al.'s z_max for the round's n and the default rule's f)."""


@dataclass(kw_only=True)
class AttackConfig:
    name: str
    """One of ``neuroshard.adversary.attacks.ATTACKS``."""
    param: float | None = None
    """The attack's strength (DEFAULT_PARAMS says what it means per attack)."""
    seed: int = 0
    """Seeds the noise of gaussian (reproducible runs)."""
    outer_lr: float = 1.0
    outer_momentum: float = 0.5
    outer_warmup_rounds: int = 0
    """The network's outer step (Nesterov when momentum > 0, the lr ramped over the warm-up's
    rounds): the adaptive attacks read earlier rounds' aggregates back from θ_round with it
    (``revealed_aggregate``). The defaults are DiLoCoConfig's from H = 20; below that its lr is
    0.7 (node.diloco.tuned_outer_lr), and a network.toml that names no warm-up ramps over 3
    rounds, so give the network's values (cli.attacker_from_args takes the node's flags)."""
    validation: ValidationConfig | None = None
    """The screening thresholds the adaptive attacks aim under (default: ``ValidationConfig()``)."""
    anchor_floor: float = ANCHOR_FLOOR
    anchored_validation: ValidationConfig = field(default_factory=lambda: ANCHORED_VALIDATION)
    """In a round with an anchor (its input carries the momentum buffer, which is public): the floor
    the whole Δ's cosine to it must clear and the wider per-part limits, both the network's."""

    def __post_init__(self) -> None:
        if self.name not in ATTACKS:
            raise ValueError(f"unknown attack {self.name!r}; known: {', '.join(ATTACKS)}")
        if self.name in ("stale", "wrong_base", "nan") and self.param is not None and self.param < 1:
            raise ValueError(f"--attack-param for {self.name} must be >= 1, got {self.param}")

    @property
    def strength(self) -> float:
        return self.param if self.param is not None else DEFAULT_PARAMS.get(self.name, math.nan)


class Attacker:
    """One Byzantine replica's strategy, with the history stale and wrong_base need."""

    def __init__(self, config: AttackConfig) -> None:
        self.config = config
        self._generator = torch.Generator().manual_seed(config.seed)
        history = int(config.strength) + 1 if config.name in ("stale", "wrong_base") else 1
        if config.name in ADAPTIVE:
            history = ADAPTIVE_HISTORY + 1
        self._deltas: deque[Tensor] = deque(maxlen=history)
        self._thetas: deque[tuple[Tensor, str]] = deque(maxlen=history)
        self._aggregates: deque[Tensor] = deque(maxlen=ADAPTIVE_HISTORY)
        self._momentum: Tensor | None = None
        self._previous_theta: Tensor | None = None
        self.gamma = math.nan
        """The adaptive attack's last chosen parameter (for the round note)."""

    @property
    def name(self) -> str:
        return self.config.name

    def forge_input(self, honest: RoundInput, theta_round: Tensor) -> tuple[RoundInput, str]:
        """What this replica commits to this round instead of its honest Δ, and a note for its round
        line. In the partitioned round every member commits before any Δ can be read, so the
        observing attacks (copy, alie, ipm) work from what the attacker has: its own Δ."""
        delta = honest.delta
        self._deltas.append(delta.detach().clone())
        self._thetas.append((theta_round.detach().clone(), honest.base_hash))
        name, p = self.config.name, self.config.strength
        if name in ADAPTIVE:
            return self._adaptive(honest, theta_round)
        if name in ("stale", "wrong_base"):
            k = int(p)
            if len(self._deltas) <= k:
                return honest, f"{name} (no history yet: honest Δ)"
            if name == "stale":
                return replace(honest, delta=attacks.stale(list(self._deltas), k)), name
            old_theta, old_hash = self._thetas[0]
            forged = attacks.wrong_base(delta, theta_round, old_theta)
            return replace(honest, delta=forged, base_hash=old_hash), name
        if name in ("copy", "equivocate", "nan"):
            # copy needs a Δ it cannot read before committing; a second commitment or a NaN payload
            # is refused before any owner aggregates it. Not yet ported to the partitioned round.
            return honest, f"{name} (not mounted in the partitioned round: honest Δ)"
        n = len(honest.members)
        forged = {
            "sign_flip": lambda: attacks.sign_flip(delta),
            "scale": lambda: attacks.scale(delta, p),
            "gaussian": lambda: attacks.gaussian(delta, p * _rms(delta), self._generator),
            "zero": lambda: attacks.zero(delta),
            "ipm": lambda: attacks.ipm(delta[None], p),
            "alie": lambda: attacks.alie(
                torch.stack(list(self._deltas)),
                n,
                1,
                self.config.param
                if self.config.param is not None
                else attacks.alie_z(n, max(1, default_rule(n)[1])),
            ),
        }[name]()
        return replace(honest, delta=forged), name

    def _adaptive(self, honest: RoundInput, theta_round: Tensor) -> tuple[RoundInput, str]:
        """The realistic adaptive attack (module docstring)."""
        theta = theta_round.detach().to(torch.float32).clone()
        if self._previous_theta is not None and self._previous_theta.shape == theta.shape:
            # θ moved from the previous round's θ_round by round r − 1's outer step, at its ramped lr.
            warmup = self.config.outer_warmup_rounds
            lr = self.config.outer_lr * (min(1.0, honest.round / warmup) if warmup else 1.0)
            aggregate, self._momentum = revealed_aggregate(
                self._previous_theta, theta, self._momentum, lr, self.config.outer_momentum
            )
            self._aggregates.append(aggregate)
        self._previous_theta = theta
        own = self._deltas[-1]
        if not self._aggregates:  # nothing revealed yet: no spread to hide in
            return honest, f"{self.config.name} (realistic, nothing revealed yet: honest Δ)"
        # Earlier Δs of this replica (all but the current one) against the aggregates revealed after them.
        earlier = list(self._deltas)[:-1][-len(self._aggregates) :] if self._aggregates else []
        deviations = [d - a for d, a in zip(earlier, list(self._aggregates)[-len(earlier) :], strict=True)]
        spread = torch.stack([x for e in deviations for x in (e, -e)]) if deviations else None
        estimate = attacks.realistic_estimate(own[None], spread)
        anchor = None
        base = self.config.validation or ValidationConfig()
        if honest.anchor is not None:  # public: the colluder aims at the floor with no margin
            anchor = attacks.Anchor(honest.anchor.detach().to(torch.float32), self.config.anchor_floor)
            base = self.config.anchored_validation
        config = attacks.tightened(base, attacks.REALISTIC_MARGIN)
        chosen = attacks.adapt(
            self.config.name,
            estimate,
            1,
            self._generator,
            config=config,
            screen=part_screen(config, len(honest.members), anchor),
            anchor=anchor,
        )
        self.gamma = chosen.gamma
        note = f"{self.config.name} (realistic, γ={chosen.gamma:.3g}{'' if chosen.passed else ', no γ passes: estimated mean'})"
        return replace(honest, delta=chosen.rows[0].contiguous()), note


ADAPTIVE_HISTORY = 3
"""Rounds of (own Δ, revealed aggregate) an adaptive attacker keeps to estimate the honest spread."""


def revealed_aggregate(
    before: Tensor, after: Tensor, momentum_buffer: Tensor | None, lr: float, momentum: float
) -> tuple[Tensor, Tensor]:
    """The aggregate g an outer step applied, read back from θ before and after it, and the new
    momentum buffer: torch's SGD with Nesterov momentum μ takes b ← μb + g (b = g at the first
    step) and θ ← θ − lr·(g + μb), so g = ((θ_before − θ_after)/lr − μ²b_old) / (1 + μ); with
    μ = 0 it is plain SGD. Exact up to float rounding while the attacker saw every step."""
    u = (before - after) / lr
    if momentum == 0:
        return u, u
    previous = torch.zeros_like(u) if momentum_buffer is None else momentum_buffer
    g = (u - momentum * momentum * previous) / (1 + momentum)
    return g, momentum * previous + g


def part_screen(config: ValidationConfig, parts: int, anchor: attacks.Anchor | None = None) -> attacks.Screen:
    """The partitioned round's screening as an attacker can run it on its estimate: every part of
    every crafted row must pass its part's ``screen_round`` (``reduce.reduce_part``), and with an
    `anchor` every crafted row's whole cosine to it must clear its floor (``reduce.AnchorCheck``)."""

    def passes(estimate: Tensor, crafted: Tensor) -> bool:
        if anchor is not None and not all(anchor.admits(r) for r in crafted):
            return False
        rows = torch.cat([estimate, crafted])
        names = [f"h{i:04d}" for i in range(estimate.shape[0])] + [
            f"x{j:04d}" for j in range(crafted.shape[0])
        ]
        for a, b in part_bounds(rows.shape[1], parts):
            if b > a:
                part = {w: r[a:b].contiguous() for w, r in zip(names, rows, strict=True)}
                _, refused = reduce_part(part, aggregation.mean, config)
                if any(w.startswith("x") for w in refused):
                    return False
        return True

    return passes


def _rms(x: Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())


class ForgingRound(OuterRound):
    """An honest round in every step but one: it commits to the attacker's forged input instead of
    its honest one, and logs what it sent. Built by `forging_rounds` for `neuroshard-adversary`."""

    def __init__(
        self, *args: Any, attacker: Attacker, theta_round: Callable[[], Tensor], **kwargs: Any
    ) -> None:
        """OuterRound's arguments, plus the attacker and a way to read this replica's θ_round."""
        super().__init__(*args, **kwargs)
        self.attacker = attacker
        self.theta_round = theta_round

    async def run(self, inp: RoundInput) -> RoundResult:
        # The round's own anchor floor and limits are the network's: aim at those.
        self.attacker.config.anchor_floor = self.config.anchor_floor
        if self.config.anchored_validation is not None:
            self.attacker.config.anchored_validation = self.config.anchored_validation
        # Off the event loop, which also serves this node's peer routes: an adaptive search screens
        # many candidates. The training thread waits in finish_round meanwhile.
        forged, note = await asyncio.to_thread(self.attacker.forge_input, inp, self.theta_round())
        self.log(f"round {inp.round}: ATTACKER sent {note}")
        return await super().run(forged)


def forging_rounds(attacker: Attacker) -> Callable[[Callable[[], Tensor]], RoundFactory]:
    """The round factory of a contribution attacker, for ``neuroshard.cli.node.Roles.rounds``."""

    def rounds(theta_round: Callable[[], Tensor]) -> RoundFactory:
        return partial(ForgingRound, attacker=attacker, theta_round=theta_round)

    return rounds


def warning(attacker: Attacker) -> str:
    """The loud line a node prints at start when it attacks."""
    p = attacker.config.param
    strength = "" if p is None else f" (param {p:g})"
    return (
        f"WARNING: ATTACK MODE {attacker.name}{strength}: this node is a Byzantine attacker for testing; "
        "its contributions are forged on purpose"
    )
