"""Probationers in the partitioned round (issue #19): screened by owners, never aggregated, and
unable to hold the members' round up; and the membership split that picks them."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from neuroshard.node.aggregation import aggregate as whole_vector
from neuroshard.node.membership import ProbationCap, StageRoster, split_members
from neuroshard.node.outer.port import MemoryHub
from neuroshard.node.outer.round import OuterRound
from neuroshard.node.outer.state import Held, RoundConfig, RoundInput, RoundResult
from neuroshard.node.wallet import Wallet

D = 3000
BASE = "cd" * 32


def median_rule(stack: torch.Tensor) -> torch.Tensor:
    return whole_vector("median", stack)


def config() -> RoundConfig:
    return RoundConfig(
        commit_timeout_s=2.0, part_timeout_s=2.0, gather_timeout_s=1.0, agree_timeout_s=2.0, checks=1
    )


class SilentAfterCommit(OuterRound):
    """A flooding probationer: commits, then never publishes its Δ (owners' reads of it time out)."""

    async def _scatter(self, held: Held) -> None:
        return None


class PatientOwner(OuterRound):
    """A member that lets its probationers' screenings finish before the round ends, so the verdicts
    do not depend on the scheduler (how a member that does not wait behaves is the flood test's)."""

    async def _settle_probation(self, held: Held) -> None:
        pending = [*held.screening, *([held.probation_reads] if held.probation_reads is not None else [])]
        if pending:
            await asyncio.wait(pending, timeout=30.0)
        await super()._settle_probation(held)


def wallets(prefix: str, n: int) -> list[Wallet]:
    return sorted((Wallet.from_token(f"{prefix}-{i}") for i in range(n)), key=lambda w: w.public_key_hex)


def honest_deltas(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    common = torch.randn(D, generator=g) * 0.01
    return [common + torch.randn(D, generator=g) * 0.003 for _ in range(n)]


async def run(
    n_members: int,
    probation: dict[int, tuple[type[OuterRound], float]] | None = None,
    member: type[OuterRound] = OuterRound,
) -> tuple[list[RoundResult], list[RoundResult]]:
    """n_members admitted replicas with honest Δs, plus probationers i -> (class, scale of an honest Δ)."""
    members_w = wallets("member", n_members)
    prob_w = wallets("probationer", len(probation or {}))
    members = tuple(w.public_key_hex for w in members_w)
    probationers = tuple(sorted(w.public_key_hex for w in prob_w))
    hub = MemoryHub()
    ds = honest_deltas(n_members + len(prob_w))
    runs = []
    for i, w in enumerate(members_w):
        inp = RoundInput(
            stage=0,
            round=3,
            base_hash=BASE,
            members=members,
            delta=ds[i],
            tokens=10,
            probationers=probationers,
        )
        runs.append(member(hub.store(w.public_key_hex), w, median_rule, config()).run(inp))
    for i, w in enumerate(prob_w):
        cls, scale = (probation or {})[i]
        inp = RoundInput(
            stage=0,
            round=3,
            base_hash=BASE,
            members=members,
            delta=scale * ds[n_members + i],
            tokens=10,
            probationers=probationers,
        )
        runs.append(cls(hub.store(w.public_key_hex), w, median_rule, config()).run(inp))
    results = await asyncio.gather(*runs)
    return list(results[:n_members]), list(results[n_members:])


@pytest.mark.asyncio
async def test_probationers_are_screened_but_never_change_the_aggregate() -> None:
    alone, _ = await run(4)
    with_probation, probationers = await run(
        4, {0: (OuterRound, 1.0), 1: (OuterRound, -4.0)}, member=PatientOwner
    )
    for r in with_probation + probationers:
        # Bit for bit the aggregate of the members alone: a probationer carries no weight.
        assert torch.equal(r.aggregate, alone[0].aggregate)
    honest_p, flipping_p = sorted(w.public_key_hex for w in wallets("probationer", 2))
    # Which probationer got which Δ: index 0 of the sorted wallets is the honest one.
    verdicts: dict[str, set[str]] = {}
    for r in with_probation:
        assert set(r.committed) <= {w.public_key_hex for w in wallets("member", 4)}
        for wallet, verdict in r.probation.items():
            verdicts.setdefault(wallet, set()).add(verdict.split(": ", 1)[1])
    assert verdicts[honest_p] == {"passed screening (no weight)"}, verdicts
    assert all(v.startswith("refused") for v in verdicts[flipping_p]), verdicts
    for r in with_probation:
        assert honest_p not in r.refused and flipping_p not in r.refused and r.cheats == {}


@pytest.mark.asyncio
async def test_a_flood_of_probationers_that_never_send_their_parts_does_not_slow_the_members() -> None:
    started = time.monotonic()
    await run(4)
    alone_s = time.monotonic() - started
    started = time.monotonic()
    members, _ = await run(4, {i: (SilentAfterCommit, 1.0) for i in range(12)})
    flooded_s = time.monotonic() - started
    # A member waits for no probationer: their part reads (2 s deadline here) run beside the round
    # and are cancelled when it ends.
    assert flooded_s < alone_s + 1.0, (alone_s, flooded_s)
    for r in members:
        assert torch.equal(r.aggregate, members[0].aggregate)
        assert r.probation and all(v.startswith("not screened") for v in r.probation.values()), r.probation


def test_the_split_counts_only_listed_wallets_and_caps_probationers() -> None:
    admitted = {f"a{i}" for i in range(8)}
    flood = {f"p{i:04d}" for i in range(1000)}
    roster = StageRoster(
        stage=0, policy="probation", admitted=frozenset(admitted), probation=frozenset(flood)
    )
    live = admitted | flood | {"stranger"}
    split = split_members(live, "a0", roster, round_=5)
    assert split.members == tuple(sorted(admitted))
    assert len(split.probationers) == ProbationCap().of(8) == 2 and split.waiting == 998
    assert "stranger" not in split.members + split.probationers
    # A probationer the cap leaves out is in neither list: it observes the round.
    waiting = next(w for w in sorted(flood) if w not in split.probationers)
    left_out = split_members(live, waiting, roster, round_=5)
    assert waiting not in left_out.members + left_out.probationers and left_out.members == split.members
    # The picks change from round to round (a hash of round and wallet), and every replica picks alike.
    assert split_members(live, "a3", roster, round_=5).probationers == split.probationers
    assert split_members(live, "a0", roster, round_=6).probationers != split.probationers
    # No roster: every live wallet is a member, as before.
    assert split_members({"x", "y"}, "z", None, round_=1).members == ("x", "y", "z")


def test_a_wallet_off_the_list_observes() -> None:
    roster = StageRoster(
        stage=2, policy="allowlist", admitted=frozenset({"a", "b"}), source="network definition"
    )
    split = split_members({"a", "b"}, "c", roster, round_=0)
    assert split.members == ("a", "b") and split.probationers == () and not split.listed
    with pytest.raises(ValueError, match="no probationers"):
        StageRoster(stage=0, policy="allowlist", admitted=frozenset({"a"}), probation=frozenset({"b"}))


def test_only_admitted_members_are_asked_for_their_vote() -> None:
    from neuroshard.node.p2p.plane import PeerPlane, PeerPlaneConfig

    me, other, newcomer = (Wallet.from_token(f"vote-{i}").public_key_hex for i in range(3))
    network = PeerPlane(PeerPlaneConfig(port=0), Wallet.from_token("vote-0"), stage=0, log=lambda line: None)
    exchange = network._exchange
    assert exchange.counts(newcomer)  # no roster: every live peer votes, as before
    network.set_roster(
        StageRoster(
            stage=0, policy="probation", admitted=frozenset({me, other}), probation=frozenset({newcomer})
        )
    )
    assert exchange.counts(other) and not exchange.counts(newcomer) and not exchange.counts("ab" * 32)
    with pytest.raises(ValueError, match="stage 1"):
        network.set_roster(StageRoster(stage=1, policy="allowlist", admitted=frozenset({me})))


@pytest.mark.asyncio
async def test_a_probationer_left_out_by_the_cap_observes_and_steps_with_the_stage() -> None:
    members_w = wallets("member", 3)
    members = tuple(w.public_key_hex for w in members_w)
    observer = Wallet.from_token("observer")
    hub = MemoryHub()
    ds = honest_deltas(4)

    def inp(i: int) -> RoundInput:
        return RoundInput(stage=0, round=3, base_hash=BASE, members=members, delta=ds[i], tokens=10)

    runs = [
        OuterRound(hub.store(w.public_key_hex), w, median_rule, config()).run(inp(i))
        for i, w in enumerate(members_w)
    ]
    runs.append(OuterRound(hub.store(observer.public_key_hex), observer, median_rule, config()).run(inp(3)))
    results = await asyncio.gather(*runs)
    assert all(torch.equal(r.aggregate, results[0].aggregate) for r in results)
    assert not any(author == observer.public_key_hex for author, _ in hub.objects)  # it published nothing


def test_a_new_member_list_takes_effect_at_its_round_on_every_replica() -> None:
    from neuroshard.node.p2p.plane import PeerPlane, PeerPlaneConfig

    network = PeerPlane(PeerPlaneConfig(port=0), Wallet.from_token("sched"), stage=0, log=lambda line: None)
    old = StageRoster(stage=0, policy="probation", admitted=frozenset({"a"}), probation=frozenset({"b"}))
    new = StageRoster(stage=0, policy="probation", admitted=frozenset({"a", "b"}))
    network.set_roster(old, effective_round=4)  # the first list is in force at once (a joiner)
    assert network._roster_for(0) is old
    network.set_roster(new, effective_round=9)
    assert network._roster_for(8) is old and network._counts("a") and not network._counts("b")
    assert network._roster_for(9) is new and network._counts("b")
    assert network._roster_for(10) is new
