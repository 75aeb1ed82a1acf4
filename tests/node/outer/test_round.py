"""The partitioned round over the in-memory carrier: honest replicas agree bit for bit, the result
equals the whole-vector rule where it decomposes, and each kind of cheating owner is caught."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
import torch

from neuroshard.adversary.owners import (
    Equivocator,
    MismatchedPart,
    SplitEquivocator,
    Withholder,
    WrongAggregate,
)
from neuroshard.node.aggregation import aggregate as whole_vector
from neuroshard.node.outer.partition import backup_chain, owners, part_bounds
from neuroshard.node.outer.port import MemoryHub, MemoryStore, object_name
from neuroshard.node.outer.reduce import decode_part, encode_part
from neuroshard.node.outer.round import OuterRound
from neuroshard.node.outer.state import RoundConfig, RoundInput, RoundResult
from neuroshard.node.wallet import Wallet

D = 3000
BASE = "ab" * 32


def median_rule(stack: torch.Tensor) -> torch.Tensor:
    return whole_vector("median", stack)


def fast_config(**kw: object) -> RoundConfig:
    return RoundConfig(
        commit_timeout_s=2.0,
        part_timeout_s=2.0,
        gather_timeout_s=1.0,
        agree_timeout_s=2.0,
        **kw,  # type: ignore[arg-type]
    )


def deltas(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(D, generator=g) * 0.01
    return [common + torch.randn(D, generator=g) * 0.003 for _ in range(n)]


async def run_round(rounds: list[OuterRound], members: tuple[str, ...]) -> list[RoundResult]:
    """Round 1 of stage 0 on every replica at once, replica i contributing `deltas(n)[i]`."""
    ds = deltas(len(rounds))
    inputs = [RoundInput(stage=0, round=1, base_hash=BASE, members=members, delta=d, tokens=100) for d in ds]
    return list(await asyncio.gather(*(r.run(x) for r, x in zip(rounds, inputs, strict=True))))


async def run_stage(
    n: int,
    kinds: dict[int, type[OuterRound]] | None = None,
    config: RoundConfig | None = None,
    checks: int = 2,
) -> tuple[list[Wallet], list[RoundResult | None]]:
    wallets = sorted((Wallet.from_token(f"replica-{i}") for i in range(n)), key=lambda w: w.public_key_hex)
    members = tuple(w.public_key_hex for w in wallets)
    hub = MemoryHub()
    rounds = []
    for i, wallet in enumerate(wallets):
        cls = (kinds or {}).get(i, OuterRound)
        rounds.append(
            cls(hub.store(wallet.public_key_hex), wallet, median_rule, config or fast_config(checks=checks))
        )
    results = await run_round(rounds, members)
    return wallets, list(results)


@pytest.mark.asyncio
@pytest.mark.parametrize("n", [1, 2, 3, 6])
async def test_honest_replicas_agree_and_match_the_whole_vector_rule(n: int) -> None:
    _, results = await run_stage(n)
    first = results[0]
    assert first is not None
    for r in results:
        assert r is not None and torch.equal(r.aggregate, first.aggregate)
        assert r.cheats == {} and r.missing_parts == ()
    # The whole-vector median of the same decoded parts, re-encoded per part as the owners do.
    decoded = [
        torch.cat([decode_part(encode_part(d[a:b], "int8"), "int8", b - a) for a, b in part_bounds(D, n)])
        for d in deltas(n)
    ]
    whole = whole_vector("median", torch.stack(decoded))
    expected = torch.cat(
        [decode_part(encode_part(whole[a:b], "int8"), "int8", b - a) for a, b in part_bounds(D, n)]
    )
    assert torch.equal(first.aggregate, expected)


@pytest.mark.asyncio
@pytest.mark.parametrize("cheat", [WrongAggregate, MismatchedPart])
async def test_a_cheat_is_caught_and_honest_replicas_still_agree(cheat: type[OuterRound]) -> None:
    n = 6
    wallets, results = await run_stage(n, {2: cheat}, checks=n)  # every honest replica checks every part
    bad = wallets[2].public_key_hex
    honest = [r for i, r in enumerate(results) if i != 2]
    for r in honest:
        assert r is not None
        assert torch.equal(r.aggregate, honest[0].aggregate)
        assert all(w == bad for w in r.cheats), r.cheats
    if cheat is WrongAggregate:
        assert all(bad in r.cheats for r in honest if r is not None)
    else:  # the forged parts are refused by their owners (and the cheat's own part is its own business)
        assert any(bad in r.refused for r in honest if r is not None)


@pytest.mark.asyncio
async def test_a_withholding_owner_is_replaced_by_its_backup() -> None:
    wallets, results = await run_stage(5, {1: Withholder})
    honest = [r for i, r in enumerate(results) if i != 1]
    for r in honest:
        assert r is not None and r.missing_parts == ()
        assert torch.equal(r.aggregate, honest[0].aggregate)  # type: ignore[union-attr]
        assert wallets[1].public_key_hex in r.silent
        assert any(c.replaces == wallets[1].public_key_hex for c in r.claims.values())


class ReadGate:
    """Orders an overwriting owner against its readers, per part: the first reader of a claim gets
    it at once and lets the owner overwrite it; later readers wait until the owner has."""

    def __init__(self) -> None:
        self.first: set[str] = set()
        """Parts whose first reader has started (taken before any await: one first reader each)."""
        self.read: dict[str, asyncio.Event] = {}
        self.switched: dict[str, asyncio.Event] = {}

    def event(self, table: dict[str, asyncio.Event], part: str) -> asyncio.Event:
        return table.setdefault(part, asyncio.Event())


class GatedReader(MemoryStore):
    def __init__(self, hub: MemoryHub, wallet: str, cheat: str, gate: ReadGate) -> None:
        super().__init__(hub, wallet)
        self.cheat, self.gate = cheat, gate

    async def fetch(self, author: str, name: str, **kw: Any) -> bytes | None:
        kind, part = name.split("/")[2], name.split("/")[-1]
        if kind == "echo":
            await asyncio.sleep(0.5)  # each witness reads the claim before another's echo
        if author == self.cheat and kind == "claim":
            if part in self.gate.first:
                await asyncio.wait_for(self.gate.event(self.gate.switched, part).wait(), 5.0)
            else:
                self.gate.first.add(part)
                data = await super().fetch(author, name, **kw)
                self.gate.event(self.gate.read, part).set()
                return data
        return await super().fetch(author, name, **kw)


class GatedEquivocator(Equivocator):
    gate: ReadGate

    async def _before_switch(self, j: int) -> None:
        await self.gate.event(self.gate.read, str(j)).wait()

    async def _after_switch(self, j: int) -> None:
        self.gate.event(self.gate.switched, str(j)).set()


@pytest.mark.asyncio
async def test_an_owner_that_overwrites_its_claim_is_caught_as_an_equivocator() -> None:
    """The owner overwrites a claim once its first witness has read it, before the next reads
    it: the witnesses echo two signed claims, and every honest replica reports the owner."""
    n, cheat_at = 6, 3
    wallets = sorted((Wallet.from_token(f"replica-{i}") for i in range(n)), key=lambda w: w.public_key_hex)
    members = tuple(w.public_key_hex for w in wallets)
    cheat, hub, gate = members[cheat_at], MemoryHub(), ReadGate()
    assert len(witnesses_of(cheat, n)) >= 2
    rounds: list[OuterRound] = []
    for i, wallet in enumerate(wallets):
        store = hub.stores[wallet.public_key_hex] = GatedReader(hub, wallet.public_key_hex, cheat, gate)
        if i == cheat_at:
            owner = GatedEquivocator(store, wallet, median_rule, fast_config(checks=0))
            owner.gate = gate
            rounds.append(owner)
        else:
            rounds.append(OuterRound(store, wallet, median_rule, fast_config(checks=0)))
    results = await run_round(rounds, members)
    honest = [r for i, r in enumerate(results) if i != cheat_at]
    for r in honest:
        assert r is not None
        assert torch.equal(r.aggregate, honest[0].aggregate)  # type: ignore[union-attr]
        assert r.cheats.get(cheat, "").startswith("equivocation"), r.cheats


class ClaimRouter(MemoryStore):
    """A reader's view of a carrier that answers it as `cheat` chooses: for part claims of `cheat`,
    "a" reads the claim the cheat published, "b" its ``claim-b`` twin, "none" nothing at all."""

    def __init__(
        self, hub: MemoryHub, wallet: str, cheat: str, answer: str, echo_delay_s: float = 0.0
    ) -> None:
        super().__init__(hub, wallet)
        self.cheat, self.answer, self.echo_delay_s = cheat, answer, echo_delay_s

    async def fetch(self, author: str, name: str, **kw: Any) -> bytes | None:
        if name.split("/")[2] == "echo":
            await asyncio.sleep(self.echo_delay_s)
        if author == self.cheat and name.split("/")[2] == "claim":
            if self.answer == "none":
                return None
            if self.answer == "b":
                name = name.replace("/claim/", "/claim-b/")
        return await super().fetch(author, name, **kw)


async def run_split(
    answers: dict[int, str], cheat_at: int = 2, n: int = 6, echo_delay_s: float = 0.0
) -> tuple[str, list[RoundResult]]:
    wallets = sorted((Wallet.from_token(f"replica-{i}") for i in range(n)), key=lambda w: w.public_key_hex)
    members = tuple(w.public_key_hex for w in wallets)
    cheat = members[cheat_at]
    hub = MemoryHub()
    rounds: list[OuterRound] = []
    for i, wallet in enumerate(wallets):
        store = hub.stores[wallet.public_key_hex] = ClaimRouter(
            hub, wallet.public_key_hex, cheat, answers.get(i, "a"), echo_delay_s
        )
        cls = SplitEquivocator if i == cheat_at else OuterRound
        rounds.append(cls(store, wallet, median_rule, fast_config(checks=0)))
    results = await run_round(rounds, members)
    return cheat, [r for i, r in enumerate(results) if i != cheat_at]


def parts_owned_by(cheat: str, n: int) -> list[int]:
    members = tuple(sorted(Wallet.from_token(f"replica-{i}").public_key_hex for i in range(n)))
    return [j for j, w in enumerate(owners(0, 1, BASE, members)) if w == cheat]


def witnesses_of(cheat: str, n: int) -> list[int]:
    """Indices (in sorted wallet order) of the witnesses of the parts `cheat` owns."""
    members = tuple(sorted(Wallet.from_token(f"replica-{i}").public_key_hex for i in range(n)))
    chains = [backup_chain(owners(0, 1, BASE, members), j, 2) for j in parts_owned_by(cheat, n)]
    return sorted({members.index(w) for chain in chains for w in chain[1:]})


@pytest.mark.asyncio
async def test_an_owner_that_shows_its_witnesses_two_claims_is_caught_by_every_honest_replica() -> None:
    """One witness gets one claim, the other witness the other: every replica reads both echoes,
    holds both signatures, zeroes the part and reports the owner, and all end bit-identical."""
    n = 6
    members = tuple(sorted(Wallet.from_token(f"replica-{i}").public_key_hex for i in range(n)))
    first, second = witnesses_of(members[2], n)[:2]
    # Echoes come late enough that each witness reads the owner's claim before the other's echo
    # (else the later witness takes the first one's claim, and the second claim reaches nobody).
    cheat, honest = await run_split({first: "a", second: "b"}, cheat_at=2, n=n, echo_delay_s=0.5)
    owned = parts_owned_by(cheat, n)
    assert owned
    for r in honest:
        assert torch.equal(r.aggregate, honest[0].aggregate)
        assert r.cheats.get(cheat, "").startswith("equivocation"), r.cheats
        for j in owned:
            assert j not in r.claims
            a, b = part_bounds(D, n)[j]
            assert torch.count_nonzero(r.aggregate[a:b]) == 0


class OneTurnWitness(MemoryStore):
    """The later witness of `cheat`'s part on a loaded machine, where one turn of a starved event
    loop finds several replies: its read of the owner's claim (it is shown ``claim-b``) and its
    read of witness `other`'s echo both wait for that echo, then both finish in one turn, the
    owner's first."""

    def __init__(self, hub: MemoryHub, wallet: str, cheat: str, other: str) -> None:
        super().__init__(hub, wallet)
        self.cheat, self.other = cheat, other

    async def fetch(self, author: str, name: str, **kw: Any) -> bytes | None:
        kind, part = name.split("/")[2], name.split("/")[-1]
        claim = author == self.cheat and kind == "claim"
        if claim or (author == self.other and kind == "echo"):
            echo = object_name(0, 1, "echo", int(part))
            await super().fetch(self.other, echo, max_bytes=1 << 16, wait_s=5.0)
        if claim:
            name = name.replace("/claim/", "/claim-b/")
        return await super().fetch(author, name, **kw)


@pytest.mark.asyncio
async def test_a_witness_holds_the_owner_claim_that_came_before_an_echo_in_the_same_turn() -> None:
    """The later witness reads the owner's second claim and the first witness's echo of its first
    claim in one turn: it holds the one that came first, the owner's, so the witnesses echo two
    claims and every honest replica reports the owner (when each read held its own claim, the
    echo that finished last replaced it, and the equivocation went unseen)."""
    n, cheat_at = 6, 2
    wallets = sorted((Wallet.from_token(f"replica-{i}") for i in range(n)), key=lambda w: w.public_key_hex)
    members = tuple(w.public_key_hex for w in wallets)
    cheat, hub = members[cheat_at], MemoryHub()
    (j,) = parts_owned_by(cheat, n)
    _, first, late = backup_chain(owners(0, 1, BASE, members), j, 2)
    rounds: list[OuterRound] = []
    for i, wallet in enumerate(wallets):
        key = wallet.public_key_hex
        store = OneTurnWitness(hub, key, cheat, first) if key == late else MemoryStore(hub, key)
        hub.stores[key] = store
        cls = SplitEquivocator if i == cheat_at else OuterRound
        rounds.append(cls(store, wallet, median_rule, fast_config(checks=0)))
    honest = [r for i, r in enumerate(await run_round(rounds, members)) if i != cheat_at]
    for r in honest:
        assert torch.equal(r.aggregate, honest[0].aggregate)
        assert r.cheats.get(cheat, "").startswith("equivocation"), r.cheats


@pytest.mark.asyncio
async def test_a_claim_shown_only_to_readers_is_never_used() -> None:
    """The witnesses get one claim, every other reader the other: readers decide from the echoes,
    so all take the witnesses' claim and end bit-identical (the other claim reaches no aggregate)."""
    n = 6
    members = tuple(sorted(Wallet.from_token(f"replica-{i}").public_key_hex for i in range(n)))
    hidden = witnesses_of(members[2], n)
    cheat, honest = await run_split({i: "a" if i in hidden else "b" for i in range(n) if i != 2}, n=n)
    for r in honest:
        assert torch.equal(r.aggregate, honest[0].aggregate)
        assert all(r.claims[j].wallet == cheat for j in parts_owned_by(cheat, n))


@pytest.mark.asyncio
async def test_an_owner_that_hides_from_its_witnesses_cannot_split_the_readers() -> None:
    """The owner shows its witnesses nothing and the other readers one claim or the other: the
    witnesses echo the backup's claim, every replica takes that, and all end bit-identical."""
    n = 8
    members = tuple(sorted(Wallet.from_token(f"replica-{i}").public_key_hex for i in range(n)))
    cheat_at = 2
    hidden = witnesses_of(members[cheat_at], n)
    answers = {i: ("none" if i in hidden else "ab"[i % 2]) for i in range(n) if i != cheat_at}
    assert {"a", "b"} <= set(answers.values())
    cheat, honest = await run_split(answers, cheat_at=cheat_at, n=n)
    for j in parts_owned_by(cheat, n):
        assert all(r.claims[j].wallet != cheat for r in honest)
    for r in honest:
        assert torch.equal(r.aggregate, honest[0].aggregate)


@pytest.mark.asyncio
async def test_a_replica_the_owner_ignored_takes_the_claim_others_hold() -> None:
    """The owner answers replica 5 with nothing: 5 does not fall back to zero alone, it takes the
    signed claim its witnesses echo and reads its aggregate by hash; all end bit-identical."""
    cheat, honest = await run_split({5: "none"})
    owned = parts_owned_by(cheat, 6)
    for r in honest:
        assert torch.equal(r.aggregate, honest[0].aggregate)
        assert r.cheats == {}
        assert all(j in r.claims and r.claims[j].wallet == cheat for j in owned)


@pytest.mark.asyncio
async def test_a_replica_reads_one_echo_per_witness_and_part_and_a_fraud_needs_no_more() -> None:
    """Deciding parts costs `backups` small echo reads per part, O(n) per replica, whatever the
    others hold (no replica reads a claim it does not witness); a fraud proof found by one checker
    reaches the rest through the digests."""
    n = 6
    wallets = sorted((Wallet.from_token(f"replica-{i}") for i in range(n)), key=lambda w: w.public_key_hex)
    members = tuple(w.public_key_hex for w in wallets)
    hub = MemoryHub()
    stores = [hub.store(w.public_key_hex) for w in wallets]
    config = [fast_config(checks=n if i == 0 else 0) for i in range(n)]
    rounds = [
        (WrongAggregate if i == 2 else OuterRound)(stores[i], w, median_rule, config[i])
        for i, w in enumerate(wallets)
    ]
    ds = deltas(n)
    inputs = [
        RoundInput(stage=0, round=1, base_hash=BASE, members=members, delta=ds[i], tokens=100)
        for i in range(n)
    ]
    reads: Counter[str] = Counter()
    original = MemoryStore.fetch

    async def counting(self: MemoryStore, author: str, name: str, **kw: Any) -> bytes | None:
        reads[name.split("/")[2]] += 1
        return await original(self, author, name, **kw)

    MemoryStore.fetch = counting  # type: ignore[method-assign]
    try:
        results = await asyncio.gather(*(r.run(x) for r, x in zip(rounds, inputs, strict=True)))
    finally:
        MemoryStore.fetch = original  # type: ignore[method-assign]
    honest = [r for i, r in enumerate(results) if i != 2]
    assert wallets[2].public_key_hex in honest[0].cheats  # replica 0 checked every part
    assert all(wallets[2].public_key_hex in r.cheats for r in honest)  # the others took its proof
    witnessed = sum(len(backup_chain(owners(0, 1, BASE, members), j, 2)) - 1 for j in range(n))
    # Every replica reads each echo but its own; each witness also watches the other witness's echo
    # while it reads the owner's claim, and only witnesses read claims.
    assert reads["echo"] == (n - 1) * witnessed + witnessed
    assert reads["claim"] == witnessed
    assert reads["equivocation"] == 0
    for r in honest:
        assert torch.equal(r.aggregate, honest[0].aggregate)


def test_the_check_seed_is_the_checkers_own_and_not_computable_without_its_key() -> None:
    """Two replicas holding the same claims draw different checks; the same replica draws the same."""
    import types

    held = types.SimpleNamespace(inp=types.SimpleNamespace(stage=0, round=3), gathered={})
    hub = MemoryHub()
    a, b = (Wallet.from_token(t) for t in ("checker-a", "checker-b"))
    ra = OuterRound(hub.store(a.public_key_hex), a, median_rule)
    rb = OuterRound(hub.store(b.public_key_hex), b, median_rule)
    draws = [r._check_seed(held).random() for r in (ra, ra, rb)]  # type: ignore[arg-type]
    assert draws[0] == draws[1] != draws[2]


# --- a Byzantine witness or member against honest owners (review findings, each once reproduced) ---

J = 0
"""The part the cheats below aim at."""


def stage_chain(n: int = 6) -> tuple[list[Wallet], tuple[str, ...], list[str]]:
    wallets = sorted((Wallet.from_token(f"replica-{i}") for i in range(n)), key=lambda w: w.public_key_hex)
    members = tuple(w.public_key_hex for w in wallets)
    return wallets, members, backup_chain(owners(0, 1, BASE, members), J, 2)


class GroupRouter(MemoryStore):
    """Readers in group "a" read `cheat`'s ``echoa/J`` where others read its ``echo/J``; `slow_from`
    delays every read from that author (a witness that reads the owner late)."""

    def __init__(self, hub: MemoryHub, wallet: str, cheat: str, group: str, slow_from: str | None) -> None:
        super().__init__(hub, wallet)
        self.cheat, self.group, self.slow_from = cheat, group, slow_from

    async def fetch(self, author: str, name: str, **kw: Any) -> bytes | None:
        if author == self.slow_from:
            await asyncio.sleep(0.5)
        if author == self.cheat and name.endswith(f"/echo/{J}") and self.group == "a":
            name = name.replace("/echo/", "/echoa/")
        return await super().fetch(author, name, **kw)


def forged_claim(held: Any, wallet: Wallet, like: Any, **over: Any) -> tuple[Any, bytes]:
    from neuroshard.protocol.identity import sha256_hex
    from neuroshard.protocol.round import AggregateClaim

    a, b = held.bounds[J]
    forged = encode_part(torch.ones(b - a), like.encoding)
    fields = {k: v for k, v in like.to_obj().items() if k not in ("wallet", "signature", "aggregate_sha256")}
    return AggregateClaim.create(wallet, **{**fields, **over}, aggregate_sha256=sha256_hex(forged)), forged


class JumpingWitness(OuterRound):
    """The first witness: at once signs a forged backup claim and echoes it (so the other witness
    might take it while the honest owner's claim is still on its way), and later shows half the
    readers an echo of the owner's real claim instead."""

    async def _gather_part(self, held: Any, j: int) -> None:
        if j != J:
            return await super()._gather_part(held, j)
        from neuroshard.protocol.round import Echo

        chain = self._chain(held, j)
        await self._reduce(held, j, replaces=chain[0])
        claim, forged = forged_claim(held, self.wallet, held.claims[j])
        await self.store.publish(self._agg_name(held.inp, j, claim.aggregate_sha256), forged)
        held.claims[j], held.aggregates[j] = claim, forged
        await self._publish_echo(held, j)
        assert await self._read_claim(held, j, chain[0], "", 5.0)
        real = held.claims[j]
        await self.store.publish(self._agg_name(held.inp, j, real.aggregate_sha256), held.aggregates[j])
        echo = Echo.create(
            self.wallet,
            stage=0,
            round=1,
            base_hash=BASE,
            members_sha256=held.members_sha,
            part=j,
            claims=(real,),
        )
        await self.store.publish(self._name(held.inp, "echoa", j), echo.to_json())


class OutOfRangeWitness(OuterRound):
    """The first witness echoes a signed claim of a part that does not exist."""

    async def _gather_part(self, held: Any, j: int) -> None:
        if j != J:
            return await super()._gather_part(held, j)
        from neuroshard.protocol.round import AggregateClaim, Echo

        claim = AggregateClaim.create(
            self.wallet, stage=0, round=1, base_hash=BASE, members_sha256=held.members_sha, part=999,
            encoding="int8", replaces=self._chain(held, j)[0], inputs_sha256="00" * 32, accepted=1,
            aggregate_sha256="11" * 32,
        )  # fmt: skip
        echo = Echo.create(
            self.wallet,
            stage=0,
            round=1,
            base_hash=BASE,
            members_sha256=held.members_sha,
            part=j,
            claims=(claim,),
        )
        await self.store.publish(self._name(held.inp, "echo", j), echo.to_json())


class SelfConvictingMember(OuterRound):
    """A member outside part J's chain signs a wrong claim of part J over its own input alone and
    publishes a valid fraud proof against it, named in its digest."""

    async def _agree(self, held: Any) -> None:
        from neuroshard.node.outer.reduce import part_spans, split_slot
        from neuroshard.protocol.round import FraudProof, InputList

        n = len(held.inp.members)
        span = part_spans(held.bounds, held.commitment.encoding)[J]
        proof, data = split_slot(held.delta_bytes[span[0] : span[1]], n)
        inputs = InputList(part=J, considered=(held.commitment,), dropped=())
        claim, _ = forged_claim(
            held, self.wallet, held.gathered[J], replaces="", inputs_sha256=inputs.sha256()
        )
        await self.store.publish(
            self._name(held.inp, "fraud", J), FraudProof(claim, inputs, ((proof, data),)).encode()
        )
        held.frauds.add(J)
        await super()._agree(held)


async def run_against(
    cheat_cls: type[OuterRound], cheat: str, slow_reader: str | None = None
) -> list[RoundResult]:
    wallets, members, chain = stage_chain()
    hub = MemoryHub()
    rounds = []
    for i, w in enumerate(wallets):
        key = w.public_key_hex
        store = hub.stores[key] = GroupRouter(
            hub, key, cheat, "a" if i % 2 else "b", chain[0] if key == slow_reader else None
        )
        rounds.append(
            (cheat_cls if key == cheat else OuterRound)(store, w, median_rule, fast_config(checks=0))
        )
    ds = deltas(len(wallets))
    inputs = [
        RoundInput(stage=0, round=1, base_hash=BASE, members=members, delta=ds[i], tokens=100)
        for i in range(len(wallets))
    ]
    results = await asyncio.gather(*(r.run(x) for r, x in zip(rounds, inputs, strict=True)))
    return [r for w, r in zip(members, results, strict=True) if w != cheat]


@pytest.mark.asyncio
async def test_a_witness_cannot_jump_ahead_to_a_backup_claim_and_split_the_readers() -> None:
    _, _, (owner, first, second) = stage_chain()
    honest = await run_against(JumpingWitness, first, slow_reader=second)
    for r in honest:
        assert torch.equal(r.aggregate, honest[0].aggregate)
        assert r.claims[J].wallet == owner and owner not in r.silent


@pytest.mark.asyncio
async def test_an_echo_of_a_part_that_does_not_exist_is_ignored() -> None:
    _, _, (owner, first, second) = stage_chain()
    honest = await run_against(OutOfRangeWitness, first, slow_reader=second)
    for r in honest:
        assert torch.equal(r.aggregate, honest[0].aggregate)
        assert r.claims[J].wallet == owner


@pytest.mark.asyncio
async def test_a_fraud_proof_against_a_claim_nobody_decided_changes_nothing() -> None:
    _, members, chain = stage_chain()
    outsider = next(m for m in members if m not in chain)
    baseline = await run_against(OuterRound, outsider)
    honest = await run_against(SelfConvictingMember, outsider)
    for before, after in zip(baseline, honest, strict=True):
        assert torch.equal(after.aggregate, before.aggregate)
        assert after.claims[J].wallet == chain[0] and after.cheats == {}
