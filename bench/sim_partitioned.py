"""The partitioned outer round at scale: n replicas of one stage, 20% Byzantine, in one process.

Every replica is a real ``OuterRound`` (or one of the cheating subclasses in
``neuroshard.adversary``) over the in-memory carrier (``port.MemoryHub``): every object is
signed, every signature, Merkle proof and hash is checked, every owner screens and aggregates
its part with the network's default rule (centered clipping from the part's median since
2026-11-27, the trimmed mean with f = ⌈0.2·n⌉ before; after the per-part screening), and every check recomputes a claim from its signed inputs. What is simulated:

- **Virtual time.** The event loop's clock moves only when no replica can run (it jumps to the
  next timer), and ``asyncio.to_thread`` work runs inline on the loop's thread. Deadlines are
  the production defaults of ``RoundConfig`` and cost no wall time; CPU work costs no simulated
  time, so a replica is never late because 1,024 replicas share one Python thread.
- **Latency.** Every fetch first waits a seeded uniform [0, 2·latency] of virtual time, so
  readers spread out and an equivocating owner can show different objects to different readers.
- **Two pure functions done once per process.** Ed25519 verification of a (key, message,
  signature) triple that another replica already verified returns that answer (the count per
  replica is still what a real replica pays, and is reported), and the screening's pairwise
  copy check (``validation._copy_groups``, a Python loop over k²/2 pairs: 8.6 s for one part of
  1,024 rows) is replaced by a tensor version that computes the same float64 expressions,
  checked against the original on planted copies before every run.

Honest Δs are a shared random direction (the same every round) plus fresh noise of half its
scale. Byzantine replicas (20%, seeded) take turns among eight kinds: the five cheating owners of
``neuroshard.adversary.owners`` (a SplitEquivocator's claims reach each reader as one of its two
signed claims or not at all, a third each) and three contribution attacks that run the honest round with a
forged Δ (``neuroshard.adversary.attacks``): sign flip ×−4; ALIE and IPM (ε = 0.5), whose colluders
estimate the honest mean and spread from their own honest Δs (commit-then-reveal shows them no
one else's before they commit) and add 10% noise each so they are not copies of one another.
Wallets reported in any honest replica's ``RoundResult.cheats`` are banned in later rounds and
leave the member list (``RoundInput.banned``, ``PeerPlane.members``), as a node does on a fraud
proof that spreads to the whole stage.

Measured per n, over honest replicas and rounds: bytes fetched (received) and served (sent) per
replica per round, and by object kind; requests; signature verifications; whether all honest
aggregates are bit-identical; the rounds until each cheat is reported; honest wallets ever
reported. The all-to-all baseline (every replica reads every other's whole int8 Δ) is
(n − 1)·|int8(Δ)| bytes per replica per round, in and out. Results: bench/RESULTS.md.

    .venv/bin/python bench/sim_partitioned.py --quick               # n = 16, 2 rounds: ~3 s
    .venv/bin/python bench/sim_partitioned.py --sizes 64,256 --rounds 3 --json
        # ~15 s a round at n = 64, ~17 min at n = 256 (one core, 2026-11-25)
    .venv/bin/python bench/sim_partitioned.py --sizes 1024 --rounds 1 \
        --kinds mismatched_part,sign_flip,alie,ipm     # see RESULTS.md for why not every kind
    .venv/bin/python bench/sim_partitioned.py --trials 200  # WrongAggregate caught within 3 rounds,
        # n = 32: ~40 min (n = 64 would take ~2.5 h at ~45 s a trial)
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextvars
import hashlib
import json
import random
import selectors
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from neuroshard.adversary import attacks
from neuroshard.adversary.owners import (
    Equivocator,
    MismatchedPart,
    SplitEquivocator,
    Withholder,
    WrongAggregate,
)
from neuroshard.node import aggregation, validation
from neuroshard.node.outer.port import MemoryHub, MemoryStore
from neuroshard.node.outer.reduce import encoded_size
from neuroshard.node.outer.round import OuterRound
from neuroshard.node.outer.state import RoundConfig, RoundInput, RoundResult
from neuroshard.node.wallet import Wallet
from neuroshard.protocol import schema as protocol_schema

OWNER_CHEATS: dict[str, type[OuterRound]] = {
    "wrong_aggregate": WrongAggregate,
    "equivocator": Equivocator,
    "withholder": Withholder,
    "mismatched_part": MismatchedPart,
    "split_equivocator": SplitEquivocator,
}
CONTRIBUTION_CHEATS = ("sign_flip", "alie", "ipm")
KINDS = (*OWNER_CHEATS, *CONTRIBUTION_CHEATS)
"""Byzantine replica i of k gets KINDS[i mod 8]: at n = 16 (3 Byzantine) only the first three."""

DIRECTION_SCALE = 0.01
"""Per-coordinate std of the shared direction (the 'true' Δ every honest replica estimates)."""
NOISE_SCALE = 0.005
"""Per-coordinate std of each replica's own noise: cosine to the median ≈ 0.9, well inside the
screening's honest range (``ValidationConfig``), and honest pairs ≈ 0.6 apart, far from copies."""
SIGN_FLIP_K = -4.0
IPM_EPSILON = 0.5
COLLUDER_SPREAD = 0.1
"""As in bench/robustness.py: each colluder adds noise of relative norm 0.1 to the shared forgery."""


@dataclass(kw_only=True)
class SimConfig:
    n: int
    """Replicas in the stage (members of every round)."""
    values_per_part: int = 256
    """d = n · this: one int8 block (256 values) per part, the least that gives every member a part."""
    rounds: int = 3
    byzantine: float = 0.2
    """Share of Byzantine replicas, rounded to the nearest count."""
    kinds: tuple[str, ...] = KINDS
    seed: int = 0
    latency_s: float = 0.02
    """Mean virtual latency of a fetch (uniform on [0, 2·latency_s])."""
    checks: int | None = None
    """RoundConfig.checks; None keeps the round's default."""
    carry_bans: bool = True

    @property
    def d(self) -> int:
        return self.n * self.values_per_part

    @property
    def byzantine_count(self) -> int:
        return round(self.byzantine * self.n)


# --- the simulated clock and carrier ---------------------------------------------------------


class _InstantSelector(selectors.DefaultSelector):
    """Never sleeps: a select that would wait moves the loop's virtual clock to the next timer."""

    loop: VirtualClockLoop

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise RuntimeError("simulation deadlock: no replica can run and no timer is set")
        if timeout > 0:
            self.loop.now += timeout
        return super().select(0)


class _InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    """Runs `asyncio.to_thread` work at once on the loop's thread: no thread races the virtual clock."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the awaiting coroutine
            future.set_exception(exc)
        return future


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose time() is simulated seconds: it advances only when nothing can run."""

    def __init__(self) -> None:
        selector = _InstantSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0
        self.set_default_executor(_InlineExecutor(max_workers=1))

    def time(self) -> float:
        return self.now


class LatencyStore(MemoryStore):
    """`MemoryStore` whose every fetch first waits a seeded random latency (virtual seconds)."""

    def __init__(
        self, hub: MemoryHub, wallet: str, latency_s: float, rng: random.Random, splitters: set[str]
    ) -> None:
        super().__init__(hub, wallet)
        self.latency_s, self.rng = latency_s, rng
        self.splitters = splitters
        """SplitEquivocator wallets: each of their claims reaches this reader as one of the two it
        signed, or not at all (a third each, seeded), as a server choosing by who asks would."""
        self.by_kind: Counter[str] = Counter()
        """Bytes received by object kind (commit, delta, claim, agg, inputs, digest, view, fraud)."""
        self.on_fetch: Callable[[], None] = lambda: None
        """Called on every fetch (progress lines: virtual time stands still while replicas compute)."""
        hub.stores[wallet] = self

    async def fetch(
        self,
        author: str,
        name: str,
        *,
        max_bytes: int,
        span: tuple[int, int] | None = None,
        wait_s: float = 0.0,
    ) -> bytes | None:
        self.on_fetch()
        await asyncio.sleep(self.rng.uniform(0.0, 2.0 * self.latency_s))
        if author in self.splitters and name.split("/")[2] == "claim":
            pick = self.rng.randrange(3)
            if pick == 2:
                return None
            if pick == 1:
                name = name.replace("/claim/", "/claim-b/")
        data = await super().fetch(author, name, max_bytes=max_bytes, span=span, wait_s=wait_s)
        if data is not None:
            self.by_kind[name.split("/")[2].split("-")[0]] += len(data)
        return data


# --- signature accounting ----------------------------------------------------------------------

_REPLICA: contextvars.ContextVar[int] = contextvars.ContextVar("replica", default=-1)
"""Which replica's task is running (asyncio copies it into every subtask and to_thread call)."""


class VerifyCounter:
    """Counts Ed25519 verifications per replica, and (with `memo`) verifies each distinct
    (key, message, signature) once per process: verification is a pure function of its bytes, so
    replica B's answer for bytes replica A already checked is A's. Counts are what a real replica
    pays either way."""

    def __init__(self, memo: bool) -> None:
        self.counts: Counter[int] = Counter()
        self.memo = memo
        self._seen: dict[tuple[bytes, bytes, bytes], bool] = {}
        self._real = protocol_schema.verify

    def __call__(self, public_key: bytes, message: bytes, signature: bytes) -> bool:
        self.counts[_REPLICA.get()] += 1
        if not self.memo:
            return self._real(public_key, message, signature)
        key = (public_key, message, signature)
        ok = self._seen.get(key)
        if ok is None:
            ok = self._seen[key] = self._real(public_key, message, signature)
        return ok

    def install(self) -> None:
        protocol_schema.verify = self  # Signed.signature_valid looks it up per call

    def uninstall(self) -> None:
        protocol_schema.verify = self._real

    def forget(self) -> None:
        self._seen.clear()


# --- the copy check, vectorised ----------------------------------------------------------------


def _copy_groups_vectorised(wallets: Sequence[str], moments: Any, tolerance: float) -> list[frozenset[str]]:
    """`validation._copy_groups` with the pair test done as one (k, k) tensor expression.

    The original tests each of the k(k−1)/2 pairs in Python (≈ 13 µs a pair: 8.6 s for one part at
    k = 1,024, and 60% of the simulator's time at n = 64). This computes the same float64
    expressions in the same order — (‖a‖² + ‖b‖²) − 2⟨a, b⟩, clamped at 0, sqrt, against
    tolerance·max(‖a‖, ‖b‖) — so it finds the same pairs, hence the same groups
    (`check_copy_groups` compares the two on planted copies before every run)."""
    k = len(wallets)
    gram = moments.gram[:k, :k]
    sq = gram.diagonal()
    norms = sq.sqrt()
    dist = ((sq[:, None] + sq[None, :]) - 2 * gram).clamp_min(0.0).sqrt()
    close = dist <= tolerance * torch.maximum(norms[:, None], norms[None, :])
    live = norms > 0
    close &= live[:, None] & live[None, :]
    parent = list(range(k))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in close.triu(1).nonzero().tolist():
        parent[root(i)] = root(j)
    groups: dict[int, set[str]] = {}
    for i in range(k):
        if live[i]:
            groups.setdefault(root(i), set()).add(wallets[i])
    return sorted((frozenset(g) for g in groups.values() if len(g) > 1), key=sorted)


def check_copy_groups(original: Callable[..., list[frozenset[str]]]) -> None:
    """Both copy checks agree on rows with planted copies at, just inside and just outside 5%."""
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(256, generator=g) for _ in range(40)]
    for i, rel in ((1, 0.0), (3, 0.01), (5, 0.0499), (7, 0.0501), (9, 0.2)):
        noise = torch.randn(256, generator=g)
        rows[i + 10] = rows[i] + noise * (rel * rows[i].norm() / noise.norm())
    rows[30] = torch.zeros(256)
    rows[31] = torch.zeros(256)
    wallets = [f"{i:064x}" for i in range(len(rows))]
    moments = validation._Moments.of(validation._blocks(rows), len(rows))
    want, got = original(wallets, moments, 0.05), _copy_groups_vectorised(wallets, moments, 0.05)
    if want != got or len(want) < 3:
        raise AssertionError(f"vectorised copy check differs: {got} != {want}")


def install_fast_copy_check() -> None:
    original = validation._copy_groups
    if original is not _copy_groups_vectorised:
        check_copy_groups(original)
        validation._copy_groups = _copy_groups_vectorised  # screen_round looks it up per call


# --- the stage ----------------------------------------------------------------------------------


@dataclass
class Replica:
    index: int
    wallet: Wallet
    role: str
    """"honest" or one of KINDS."""
    store: LatencyStore
    outer: OuterRound

    @property
    def key(self) -> str:
        return self.wallet.public_key_hex


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little")


def assign_roles(config: SimConfig) -> list[str]:
    """Role of each member (in sorted wallet order): a seeded sample is Byzantine, kinds in turn."""
    roles = ["honest"] * config.n
    bad = random.Random(_seed("roles", config.seed, config.n)).sample(range(config.n), config.byzantine_count)
    for k, i in enumerate(bad):
        roles[i] = config.kinds[k % len(config.kinds)]
    return roles


def round_config(config: SimConfig) -> RoundConfig:
    """Production deadlines (they cost virtual time only); `checks` when the run sets it."""
    return RoundConfig() if config.checks is None else RoundConfig(checks=config.checks)


def build_stage(config: SimConfig, hub: MemoryHub, log: Callable[[str], None]) -> list[Replica]:
    wallets = sorted(
        (Wallet.from_token(f"sim/{config.seed}/{i}") for i in range(config.n)), key=lambda w: w.public_key_hex
    )
    rng = random.Random(_seed("latency", config.seed, config.n))
    rule = partial(aggregation.aggregate, "default")
    roles = assign_roles(config)
    splitters = {
        w.public_key_hex for w, role in zip(wallets, roles, strict=True) if role == "split_equivocator"
    }
    replicas = []
    for i, (wallet, role) in enumerate(zip(wallets, roles, strict=True)):
        store = LatencyStore(hub, wallet.public_key_hex, config.latency_s, rng, splitters)
        cls = OWNER_CHEATS.get(role, OuterRound)
        outer = cls(
            store, wallet, rule, round_config(config), log=log if role == "honest" else lambda line: None
        )
        replicas.append(Replica(i, wallet, role, store, outer))
    return replicas


def direction_of(config: SimConfig) -> Tensor:
    g = torch.Generator().manual_seed(_seed("direction", config.seed, config.n))
    return torch.randn(config.d, generator=g) * DIRECTION_SCALE


def own_delta(config: SimConfig, direction: Tensor, round_: int, index: int) -> Tensor:
    """Replica `index`'s trained Δ of `round_`: the shared direction plus its own noise (d,)."""
    g = torch.Generator().manual_seed(_seed("noise", config.seed, config.n, round_, index))
    return direction + torch.randn(config.d, generator=g) * NOISE_SCALE


def forge(kind: str, own: Tensor, colluders: Tensor, n: int, f: int, g: torch.Generator) -> Tensor:
    """The Δ a contribution attacker commits to. `colluders` (k, d) are the Byzantine replicas' own
    honest Δs: their estimate of the honest distribution."""
    if kind == "sign_flip":
        return attacks.scale(own, SIGN_FLIP_K)
    if kind == "alie":
        return attacks.copy(attacks.alie(colluders, n, f), COLLUDER_SPREAD, g)
    if kind == "ipm":
        return attacks.copy(attacks.ipm(colluders, IPM_EPSILON), COLLUDER_SPREAD, g)
    return own


def round_inputs(
    config: SimConfig, replicas: Sequence[Replica], round_: int, base_hash: str, banned: frozenset[str]
) -> tuple[list[RoundInput], Tensor]:
    """Every replica's input to `round_`, and the mean of the honest Δs (d,) (what a perfect rule gives)."""
    direction = direction_of(config)
    members = tuple(r.key for r in replicas if r.key not in banned)  # as PeerPlane.members()
    owns = [own_delta(config, direction, round_, r.index) for r in replicas]
    byzantine = [i for i, r in enumerate(replicas) if r.role != "honest"]
    colluders = torch.stack([owns[i] for i in byzantine]) if byzantine else torch.zeros(0, config.d)
    inputs = []
    for r, own in zip(replicas, owns, strict=True):
        g = torch.Generator().manual_seed(_seed("forge", config.seed, round_, r.index))
        delta = forge(r.role, own, colluders, config.n, len(byzantine), g)
        inputs.append(
            RoundInput(
                stage=0,
                round=round_,
                base_hash=base_hash,
                members=members,
                delta=delta,
                tokens=1000,
                banned=banned,
            )
        )
    honest_mean = torch.zeros(config.d)
    for own, r in zip(owns, replicas, strict=True):
        if r.role == "honest":
            honest_mean += own
    return inputs, honest_mean / sum(r.role == "honest" for r in replicas)


# --- one round ----------------------------------------------------------------------------------


@dataclass(kw_only=True)
class RoundFigures:
    round: int
    received: list[int]
    """Per honest replica: bytes it fetched this round."""
    sent: list[int]
    """Per honest replica: bytes others fetched from it this round."""
    requests: list[int]
    verifies: list[int]
    by_kind: dict[str, float]
    """Object kind -> median over honest replicas of the bytes of that kind received."""
    agree: bool
    failures: int
    """Honest replicas whose run raised."""
    reported: dict[str, int]
    """Wallet -> honest replicas whose RoundResult.cheats name it."""
    refused: dict[str, int]
    """Wallet -> honest replicas that refused it or found it silent (refused, silent or cheats)."""
    honest_refused: dict[str, str]
    """Honest wallet -> why an honest replica refused its input (screening, a part that did not match)."""
    honest_silent: dict[str, str]
    """Honest wallet -> why an honest replica found it silent (no commitment, no valid aggregate)."""
    error: float
    """Worst honest replica's ‖aggregate − mean of honest Δs‖ / ‖mean of honest Δs‖."""
    missing: int
    """Most parts any honest replica ended the round without (stepped with zeros there)."""
    virtual_s: float
    wall_s: float


class Progress:
    """Prints, at most every `every_s` wall seconds, how many replicas are in each phase."""

    def __init__(self, replicas: Sequence[Replica], label: str, every_s: float = 30.0) -> None:
        self.replicas, self.label, self.every_s = replicas, label, every_s
        self.started = self.last = time.monotonic()

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s:
            return
        self.last = now
        phases = Counter(r.outer.phase.value for r in self.replicas)
        detail = ", ".join(f"{p} {c}" for p, c in sorted(phases.items()))
        print(f"  {self.label} {now - self.started:.0f}s wall: {detail}", flush=True)


async def run_round(replicas: Sequence[Replica], inputs: Sequence[RoundInput]) -> list[Any]:
    """Every replica's RoundResult, or the exception its run raised."""

    async def one(replica: Replica, inp: RoundInput) -> RoundResult:
        _REPLICA.set(replica.index)
        return await replica.outer.run(inp)

    return await asyncio.gather(
        *(one(r, x) for r, x in zip(replicas, inputs, strict=True)), return_exceptions=True
    )


def explain_disagreement(results: Sequence[RoundResult]) -> None:
    """Print, for every part on which honest replicas ended apart, who held which claim (--verbose)."""
    if not results:
        return
    for j in sorted(
        {j for res in results for j in res.claims} | {j for res in results for j in res.missing_parts}
    ):
        held = Counter(
            f"{c.wallet[:8]}{'(backup)' if c.replaces else ''}:{c.aggregate_sha256[:8]}"
            if (c := res.claims.get(j)) is not None
            else ("missing" if j in res.missing_parts else "replaced")
            for res in results
        )
        if len(held) > 1:
            print(f"    part {j}: honest replicas hold {dict(held)}", flush=True)


def measure_round(
    loop: VirtualClockLoop,
    config: SimConfig,
    replicas: Sequence[Replica],
    counter: VerifyCounter,
    round_: int,
    base_hash: str,
    banned: frozenset[str],
    verbose: bool = False,
) -> tuple[RoundFigures, list[RoundResult]]:
    inputs, honest_mean = round_inputs(config, replicas, round_, base_hash, banned)
    before = {
        r.index: (r.store.traffic.bytes_received, r.store.served.bytes_sent, r.store.traffic.requests)
        for r in replicas
    }
    for r in replicas:
        r.store.by_kind.clear()
    counter.counts.clear()
    wall, virtual = time.monotonic(), loop.now
    progress = Progress(replicas, f"n={config.n} round {round_}:")
    for r in replicas:
        r.store.on_fetch = progress.tick
    outcomes = loop.run_until_complete(run_round(replicas, inputs))
    wall, virtual = time.monotonic() - wall, loop.now - virtual
    honest = [r for r in replicas if r.role == "honest"]
    if verbose:
        explain_disagreement([o for r in honest if isinstance(o := outcomes[r.index], RoundResult)])
    results: list[RoundResult] = []
    failures = 0
    for r in honest:
        outcome = outcomes[r.index]
        if isinstance(outcome, BaseException):
            failures += 1
            print(f"  honest replica {r.index} failed: {type(outcome).__name__}: {outcome}", flush=True)
        else:
            results.append(outcome)
    reported: Counter[str] = Counter(w for res in results for w in res.cheats)
    refused: Counter[str] = Counter(w for res in results for w in {*res.refused, *res.silent, *res.cheats})
    first = results[0].aggregate if results else torch.zeros(config.d)
    keys = {r.key for r in honest}
    honest_refused = {w: why for res in results for w, why in res.refused.items() if w in keys}
    honest_silent = {w: why for res in results for w, why in res.silent.items() if w in keys}
    figures = RoundFigures(
        round=round_,
        received=[r.store.traffic.bytes_received - before[r.index][0] for r in honest],
        sent=[r.store.served.bytes_sent - before[r.index][1] for r in honest],
        requests=[r.store.traffic.requests - before[r.index][2] for r in honest],
        verifies=[counter.counts[r.index] for r in honest],
        by_kind={
            kind: statistics.median(r.store.by_kind[kind] for r in honest)
            for kind in sorted({k for r in honest for k in r.store.by_kind})
        },
        agree=failures == 0 and all(torch.equal(res.aggregate, first) for res in results),
        failures=failures,
        reported=dict(reported),
        refused=dict(refused),
        honest_refused=honest_refused,
        honest_silent=honest_silent,
        error=max(
            (float((res.aggregate - honest_mean).norm() / honest_mean.norm()) for res in results),
            default=float("nan"),
        ),
        missing=max((len(res.missing_parts) for res in results), default=0),
        virtual_s=virtual,
        wall_s=wall,
    )
    return figures, results


# --- a stage over several rounds ----------------------------------------------------------------


@dataclass(kw_only=True)
class Caught:
    """How one kind of Byzantine replica fared: rounds (1-based) until first reported or refused."""

    wallets: int
    reported: list[int] = field(default_factory=list)
    """Per wallet reported in some honest replica's RoundResult.cheats: the first round it was."""
    refused: list[int] = field(default_factory=list)
    """Per wallet some honest replica refused, found silent or reported: the first round it was."""


@dataclass(kw_only=True)
class StageFigures:
    n: int
    d: int
    byzantine: int
    rounds: int
    received_median: float
    received_max: int
    sent_median: float
    sent_max: int
    requests_median: float
    requests_max: int
    verifies_median: float
    verifies_max: int
    received_by_kind: dict[str, float]
    """Object kind -> median over rounds of the honest replicas' median bytes of that kind received."""
    baseline_bytes: int
    """All-to-all: (n − 1)·|int8(Δ)|, received and sent by every replica every round."""
    agree_rounds: int
    honest_reported: list[str]
    honest_refused: list[str]
    """Honest wallets whose input some honest replica refused, "wallet (12 hex): first reason"."""
    honest_silent: int
    """Round × honest wallet pairs some honest replica found silent (an honest backup that was never
    asked to reduce counts here: see bench/RESULTS.md)."""
    """Honest wallets (12 hex) some honest replica reported as a cheat, in any round."""
    caught: dict[str, Caught]
    error_median: float
    missing_max: int
    wall_s_per_round: float
    virtual_s_per_round: float
    per_round: list[dict[str, Any]]


def summarise(config: SimConfig, replicas: Sequence[Replica], rounds: Sequence[RoundFigures]) -> StageFigures:
    received = [b for f in rounds for b in f.received]
    sent = [b for f in rounds for b in f.sent]
    requests = [b for f in rounds for b in f.requests]
    verifies = [b for f in rounds for b in f.verifies]
    honest = {r.key for r in replicas if r.role == "honest"}
    caught: dict[str, Caught] = {}
    for r in replicas:
        if r.role == "honest":
            continue
        entry = caught.setdefault(r.role, Caught(wallets=0))
        entry.wallets += 1
        for tally, field_ in ((entry.reported, "reported"), (entry.refused, "refused")):
            first = next((f.round for f in rounds if r.key in getattr(f, field_)), None)
            if first is not None:
                tally.append(first)
    return StageFigures(
        n=config.n,
        d=config.d,
        byzantine=config.byzantine_count,
        rounds=len(rounds),
        received_median=statistics.median(received),
        received_max=max(received),
        sent_median=statistics.median(sent),
        sent_max=max(sent),
        requests_median=statistics.median(requests),
        requests_max=max(requests),
        verifies_median=statistics.median(verifies),
        verifies_max=max(verifies),
        received_by_kind={
            kind: statistics.median(f.by_kind.get(kind, 0.0) for f in rounds)
            for kind in sorted({k for f in rounds for k in f.by_kind})
        },
        baseline_bytes=(config.n - 1) * encoded_size("int8", config.d),
        agree_rounds=sum(f.agree for f in rounds),
        honest_reported=sorted({w[:12] for f in rounds for w in f.reported if w in honest}),
        honest_refused=sorted({f"{w[:12]}: {why}" for f in rounds for w, why in f.honest_refused.items()}),
        honest_silent=sum(len(f.honest_silent) for f in rounds),
        caught=caught,
        error_median=statistics.median(f.error for f in rounds),
        missing_max=max(f.missing for f in rounds),
        wall_s_per_round=statistics.mean(f.wall_s for f in rounds),
        virtual_s_per_round=statistics.mean(f.virtual_s for f in rounds),
        per_round=[
            {
                "round": f.round,
                "agree": f.agree,
                "failures": f.failures,
                "error": round(f.error, 4),
                "missing": f.missing,
                "wall_s": round(f.wall_s, 1),
                "virtual_s": round(f.virtual_s, 2),
                "reported": len(f.reported),
                "received_median": statistics.median(f.received),
            }
            for f in rounds
        ],
    )


def run_stage(
    config: SimConfig,
    *,
    memo: bool = True,
    quiet: bool = False,
    verbose: bool = False,
    until_caught: bool = False,
) -> StageFigures:
    """Run `config.rounds` rounds of one stage; bans carried from round to round (`carry_bans`).
    `until_caught`: stop early once every Byzantine wallet has been reported (the trial's question
    is settled)."""
    install_fast_copy_check()
    loop = VirtualClockLoop()
    asyncio.set_event_loop(loop)
    counter = VerifyCounter(memo)
    counter.install()
    hub = MemoryHub()
    replicas = build_stage(
        config,
        hub,
        (lambda line: print(f"    [{_REPLICA.get()}] {line}", flush=True)) if verbose else lambda line: None,
    )
    banned: frozenset[str] = frozenset()
    base_hash = hashlib.sha256(f"sim/{config.seed}/theta/0".encode()).hexdigest()
    rounds: list[RoundFigures] = []
    try:
        for round_ in range(1, config.rounds + 1):
            figures, results = measure_round(
                loop, config, replicas, counter, round_, base_hash, banned, verbose=verbose
            )
            rounds.append(figures)
            if config.carry_bans:
                banned = banned | frozenset(figures.reported)
            aggregate = results[0].aggregate if results else torch.zeros(config.d)
            base_hash = hashlib.sha256(aggregate.numpy().tobytes() + str(round_).encode()).hexdigest()
            for r in replicas:  # keep this round's objects for late readers, drop the one before
                loop.run_until_complete(r.store.retire(0, round_))
            counter.forget()
            if until_caught and all(r.key in banned for r in replicas if r.role != "honest"):
                break
            if not quiet:
                print(
                    f"  n={config.n} round {round_}/{config.rounds}: wall {figures.wall_s:.1f}s, "
                    f"virtual {figures.virtual_s:.2f}s, honest agree {figures.agree}, "
                    f"reported {len(figures.reported)}, banned {len(banned)}, worst error {figures.error:.3f}, "
                    f"most parts missing {figures.missing}, "
                    f"received median {statistics.median(figures.received):,.0f} B",
                    flush=True,
                )
    finally:
        for task in asyncio.all_tasks(loop):  # an equivocator's pending switch
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
        counter.uninstall()
    return summarise(config, replicas, rounds)


# --- the "within 3 rounds" trial ---------------------------------------------------------------


def trials(count: int, n: int, rounds: int, checks: int | None, values_per_part: int) -> dict[str, Any]:
    """`count` seeded stages of n replicas, 20% of them WrongAggregate owners: the share of those
    reported (hence banned) within `rounds` rounds."""
    caught = total = disagree = honest_reported = 0
    started = time.monotonic()
    for seed in range(count):
        config = SimConfig(
            n=n,
            rounds=rounds,
            seed=1000 + seed,
            kinds=("wrong_aggregate",),
            checks=checks,
            values_per_part=values_per_part,
        )
        figures = run_stage(config, quiet=True, until_caught=True)
        entry = figures.caught["wrong_aggregate"]
        caught += len(entry.reported)
        total += entry.wallets
        disagree += figures.rounds - figures.agree_rounds
        honest_reported += len(figures.honest_reported)
        if (seed + 1) % 10 == 0 or seed + 1 == count:
            print(
                f"  trial {seed + 1}/{count}: caught {caught}/{total} ({caught / total:.4f}), "
                f"{time.monotonic() - started:.0f}s",
                flush=True,
            )
    return {
        "trials": count,
        "n": n,
        "rounds": rounds,
        "cheats": total,
        "caught": caught,
        "share": caught / total,
        "rounds_honest_disagreed": disagree,
        "honest_reported": honest_reported,
    }


# --- the command line ---------------------------------------------------------------------------


def _kb(x: float) -> str:
    return f"{x / 1e3:,.1f}"


def _first_rounds(rounds: list[int], wallets: int) -> str:
    if not rounds:
        return f"0/{wallets}"
    return f"{len(rounds)}/{wallets} ({statistics.median(rounds):.0f}, {max(rounds)})"


def print_table(stages: Sequence[StageFigures]) -> None:
    print(
        "\n| n | d | rounds | received KB/replica/round (median, max) | sent KB (median, max) "
        "| all-to-all KB | all-to-all / ours | requests (median, max) | signatures verified (median) "
        "| rounds honest agree | honest reported, refused, silent | worst honest error (median round) "
        "| most parts missing | wall s/round |"
    )
    print("|" + "---|" * 14)
    for s in stages:
        print(
            f"| {s.n} | {s.d:,} | {s.rounds} | {_kb(s.received_median)}, {_kb(s.received_max)} "
            f"| {_kb(s.sent_median)}, {_kb(s.sent_max)} | {_kb(s.baseline_bytes)} "
            f"| {s.baseline_bytes / s.received_median:.2f}× | {s.requests_median:,.0f}, {s.requests_max:,} "
            f"| {s.verifies_median:,.0f} | {s.agree_rounds}/{s.rounds} "
            f"| {len(s.honest_reported)}, {len(s.honest_refused)}, {s.honest_silent} "
            f"| {s.error_median:.3f} | {s.missing_max} | {s.wall_s_per_round:.1f} |"
        )
    kinds = sorted({k for s in stages for k in s.received_by_kind})
    print("\n| n | " + " | ".join(f"{k} KB" for k in kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for s in stages:
        print(f"| {s.n} | " + " | ".join(_kb(s.received_by_kind.get(k, 0.0)) for k in kinds) + " |")
    print(
        "\n| n | kind | wallets | reported as cheats (first round: median, max) | refused or silent (same) |"
    )
    print("|---|---|---|---|---|")
    for s in stages:
        for kind, c in s.caught.items():
            print(
                f"| {s.n} | {kind} | {c.wallets} | {_first_rounds(c.reported, c.wallets)} "
                f"| {_first_rounds(c.refused, c.wallets)} |"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="64,256", help="comma-separated n")
    parser.add_argument("--rounds", default="3", help="rounds per n: one value, or one per size")
    parser.add_argument("--values-per-part", type=int, default=256)
    parser.add_argument(
        "--latency", type=float, default=SimConfig.latency_s, help="mean fetch latency, virtual s"
    )
    parser.add_argument("--checks", type=int, default=None, help="RoundConfig.checks (default: the round's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"Byzantine kinds, in turn: {', '.join(KINDS)}"
    )
    parser.add_argument(
        "--no-bans", action="store_true", help="do not carry reported wallets into later rounds"
    )
    parser.add_argument(
        "--no-memo",
        action="store_true",
        help="verify every signature again in every replica (slower; same outcome)",
    )
    parser.add_argument("--trials", type=int, default=0, help="run the within-3-rounds trial instead")
    parser.add_argument("--trial-n", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="n = 16, 2 rounds (CI smoke)")
    parser.add_argument("--verbose", action="store_true", help="print honest replicas' round logs")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one process simulates every replica; the machine is shared

    if args.trials:
        out = trials(args.trials, args.trial_n, 3, args.checks, args.values_per_part)
        print(
            f"\nWrongAggregate owners reported within 3 rounds: {out['caught']}/{out['cheats']} "
            f"= {out['share']:.4f} (n = {out['n']}, {out['trials']} seeded stages); rounds in which honest "
            f"replicas ended apart: {out['rounds_honest_disagreed']}; honest replicas reported: {out['honest_reported']}"
        )
        if args.json:
            print(json.dumps(out))
        return 0

    kinds = tuple(args.kinds.split(","))
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    sizes = [16] if args.quick else [int(x) for x in args.sizes.split(",")]
    rounds = [2] if args.quick else [int(x) for x in args.rounds.split(",")]
    if len(rounds) == 1:
        rounds = rounds * len(sizes)
    if len(rounds) != len(sizes):
        parser.error(f"--rounds gives {len(rounds)} values for {len(sizes)} sizes")
    stages = []
    for n, r in zip(sizes, rounds, strict=True):
        config = SimConfig(
            n=n,
            rounds=r,
            values_per_part=args.values_per_part,
            latency_s=args.latency,
            checks=args.checks,
            seed=args.seed,
            carry_bans=not args.no_bans,
            kinds=kinds,
        )
        print(f"n={n}: d={config.d:,}, {config.byzantine_count} Byzantine, {r} rounds", flush=True)
        stages.append(run_stage(config, memo=not args.no_memo, verbose=args.verbose))
    print_table(stages)
    if args.json:
        print(json.dumps({"stages": [asdict(s) for s in stages]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
