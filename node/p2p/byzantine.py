"""`neuroshard-node --attack NAME`: a node that lies on the real wire, to test the defences.

TESTING ONLY. An `Attacker` is the one hook `PeerNetwork` calls when built with one: after its
H honest inner steps the node hands over its honest Δ and round, and gets back the signed
contribution its own book keeps and, per peer wallet, the one pushed to that peer. The maths
of every attack is in ``neuroshard.node.attacks``; this module only decides what to feed it
and puts the result on the wire the way a real attacker would:

- ``sign_flip``, ``scale`` (×k), ``gaussian`` (σ = param · RMS of the honest Δ), ``zero``;
- ``copy``, ``alie``, ``ipm`` use what the attacker observes: the contributions its peers
  revealed to it this round (it waits for them before sending its own; colluding attackers each
  see the same honest pushes, so they collude through what they observe). Under
  commit-then-reveal (exchange.py) peers reveal payloads only to wallets that committed first,
  so the attacker commits to its honest Δ's header, observes, and then signs its forgery under
  a second header: the strongest it can do, since a late commitment sees no payload at all. The
  second header is an equivocation, and that is how it gets caught;
- ``stale``: its own honest Δ from k rounds ago; ``wrong_base``: a Δ trained from θ of k rounds
  ago, signed against that old θ's hash (honest Δ for the first k rounds: no history yet);
- ``nan``: encoded raw, as an attacker would (the honest codec refuses non-finite values);
- ``equivocate``: two different validly signed payloads, one to each half of its peers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors.torch import save as st_save
from torch import Tensor

from .. import attacks
from ..aggregation import default_rule
from ..attacks import ATTACKS
from ..wallet import Wallet
from .codec import encode_delta, quantize_int8, sha256_hex
from .exchange import Exchange
from .rounds import Contribution
from .wire import ContributionHeader, Rejected

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
    """One of ``neuroshard.node.attacks.ATTACKS``."""
    param: float | None = None
    """The attack's strength (DEFAULT_PARAMS says what it means per attack)."""
    seed: int = 0
    """Seeds the noise of gaussian, copy, nan and equivocate (reproducible runs)."""
    observe_s: float = 10.0
    """How long copy, alie and ipm wait for the peers' contributions before forging their own."""

    def __post_init__(self) -> None:
        if self.name not in ATTACKS:
            raise ValueError(f"unknown attack {self.name!r}; known: {', '.join(ATTACKS)}")
        if self.name in ("stale", "wrong_base", "nan") and self.param is not None and self.param < 1:
            raise ValueError(f"--attack-param for {self.name} must be >= 1, got {self.param}")
        if self.observe_s < 0:
            raise ValueError(f"AttackConfig.observe_s must be >= 0, got {self.observe_s}")

    @property
    def strength(self) -> float:
        return self.param if self.param is not None else DEFAULT_PARAMS.get(self.name, math.nan)


@dataclass(frozen=True, kw_only=True)
class HonestRound:
    """What the attacking replica holds after its H honest inner steps."""

    wallet: Wallet
    stage: int
    round: int
    base_hash: str
    theta_round: Tensor
    delta: Tensor
    encoding: str
    tokens: int
    peers: tuple[str, ...]
    """Live stage peers' wallets, sorted (equivocate splits them in two halves)."""
    observe: Callable[[float], dict[str, Tensor]]
    """Commits to the honest Δ's header (peers reveal payloads to committed wallets only), then
    blocks up to the given seconds for every live peer's contribution; returns the Δs held."""


@dataclass(frozen=True)
class Forged:
    own: Contribution
    """What this replica's own book keeps (and its digests list)."""
    outgoing: Callable[[str], Contribution] | None
    """Per peer wallet, what is pushed to it; None pushes `own` to everyone."""
    note: str
    """For the round line: the attack, and whether it could act this round."""


def encode_unchecked(delta: Tensor, encoding: str) -> bytes:
    """The codec's layout without its refusal of non-finite values: what a Byzantine node sends."""
    x = delta.detach().float().contiguous()
    if encoding == "fp16":
        return st_save({"delta": x.to(torch.float16)})
    q, scale = quantize_int8(x)
    return st_save({"q": q, "scale": scale})


def sign(
    view: HonestRound, delta: Tensor, *, base_hash: str | None = None, raw: bool = False
) -> Contribution:
    """A validly signed contribution of `delta` in the attacker's name."""
    payload = encode_unchecked(delta, view.encoding) if raw else encode_delta(delta, view.encoding)
    header = ContributionHeader.create(
        view.wallet,
        stage=view.stage,
        round=view.round,
        base_hash=base_hash or view.base_hash,
        tokens=view.tokens,
        encoding=view.encoding,
        numel=delta.numel(),
        payload_sha256=sha256_hex(payload),
    )
    return Contribution(header, payload)


class Attacker:
    """One Byzantine replica's strategy, with the history stale and wrong_base need."""

    def __init__(self, config: AttackConfig) -> None:
        self.config = config
        self._generator = torch.Generator().manual_seed(config.seed)
        history = int(config.strength) + 1 if config.name in ("stale", "wrong_base") else 1
        self._deltas: deque[Tensor] = deque(maxlen=history)
        self._thetas: deque[tuple[Tensor, str]] = deque(maxlen=history)

    @property
    def name(self) -> str:
        return self.config.name

    def forge(self, view: HonestRound) -> Forged:
        """The contribution(s) to send this round instead of the honest one."""
        self._deltas.append(view.delta.detach().clone())
        self._thetas.append((view.theta_round.detach().clone(), view.base_hash))
        name, p = self.config.name, self.config.strength
        if name in ("copy", "alie", "ipm"):
            return self._observing(view, name, p)
        if name in ("stale", "wrong_base"):
            return self._from_history(view, name, int(p))
        if name == "equivocate":
            first, second = attacks.equivocate(view.delta, self._generator, p)
            a, b = sign(view, first), sign(view, second)
            half = set(view.peers[len(view.peers) // 2 :])
            return Forged(a, lambda peer: b if peer in half else a, f"{name} (2 payloads)")
        if name == "nan":
            forged = attacks.nan(view.delta, int(p), self._generator)
            return Forged(sign(view, forged, raw=True), None, name)
        delta = view.delta
        forged = {
            "sign_flip": lambda: attacks.sign_flip(delta),
            "scale": lambda: attacks.scale(delta, p),
            "gaussian": lambda: attacks.gaussian(delta, p * _rms(delta), self._generator),
            "zero": lambda: attacks.zero(delta),
        }[name]()
        return Forged(sign(view, forged), None, name)

    def _observing(self, view: HonestRound, name: str, p: float) -> Forged:
        seen = view.observe(self.config.observe_s)
        if not seen:
            return Forged(sign(view, view.delta), None, f"{name} (nothing observed: honest Δ)")
        honest = torch.stack([seen[w] for w in sorted(seen)])  # (m, d), wallet order
        if name == "copy":
            forged = attacks.copy(honest[0], p, self._generator if p > 0 else None)
        elif name == "ipm":
            forged = attacks.ipm(honest, p)
        else:
            n = len(seen) + 1
            z = (
                self.config.param
                if self.config.param is not None
                else attacks.alie_z(n, max(1, default_rule(n)[1]))
            )
            forged = attacks.alie(honest, n, 1, z)
        return Forged(sign(view, forged), None, f"{name} (observed {len(seen)})")

    def _from_history(self, view: HonestRound, name: str, k: int) -> Forged:
        if len(self._deltas) <= k:
            return Forged(sign(view, view.delta), None, f"{name} (no history yet: honest Δ)")
        if name == "stale":
            return Forged(sign(view, attacks.stale(list(self._deltas), k)), None, name)
        old_theta, old_hash = self._thetas[0]
        forged = attacks.wrong_base(view.delta, view.theta_round, old_theta)
        return Forged(sign(view, forged, base_hash=old_hash), None, name)


def _rms(x: Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())


async def observe_peers(
    exchange: Exchange, commitment: ContributionHeader, timeout_s: float
) -> dict[str, Tensor]:
    """The decoded Δs this replica holds for the round of `commitment` from its peers, after
    committing to `commitment` (so peers reveal to it) and waiting (bounded) until every live stage
    peer's contribution arrived. Runs on the network loop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    book = exchange.node.books.get(commitment.round)
    if book is None:
        return {}
    with contextlib.suppress(Rejected):
        exchange.node.commit(commitment)
    while loop.time() < deadline:
        await exchange.gossip_round(commitment.round)
        if {p.wallet for p in exchange.stage_peers()} <= set(book.accepted):
            break
        book.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(book.changed.wait(), min(0.2, max(0.0, deadline - loop.time())))
    own = exchange.own
    return {w: c.delta for w, c in book.accepted.items() if w != own and c.delta is not None}


def add_attack_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("attack (TESTING ONLY: makes this node a Byzantine attacker)")
    g.add_argument("--attack", choices=ATTACKS, help="send forged contributions of this kind")
    g.add_argument("--attack-param", type=float, help="the attack's strength (see node/p2p/byzantine.py)")
    g.add_argument("--attack-seed", type=int, default=0, help="seed of the attack's noise")


def attacker_from_args(args: argparse.Namespace) -> Attacker | None:
    if getattr(args, "attack", None) is None:
        return None
    return Attacker(AttackConfig(name=args.attack, param=args.attack_param, seed=args.attack_seed))


def warning(attacker: Attacker) -> str:
    """The loud line a node prints at start when it attacks."""
    p = attacker.config.param
    strength = "" if p is None else f" (param {p:g})"
    return (
        f"WARNING: ATTACK MODE {attacker.name}{strength}: this node is a Byzantine attacker for testing; "
        "its contributions are forged on purpose"
    )
