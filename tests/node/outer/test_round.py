"""The partitioned round over the in-memory carrier: honest replicas agree bit for bit, the result
equals the whole-vector rule where it decomposes, and each kind of cheating owner is caught."""

from __future__ import annotations

import asyncio

import pytest
import torch

from neuroshard.adversary.owners import Equivocator, MismatchedPart, Withholder, WrongAggregate
from neuroshard.node.aggregation import aggregate as whole_vector
from neuroshard.node.outer.partition import part_bounds
from neuroshard.node.outer.port import MemoryHub
from neuroshard.node.outer.reduce import decode_part, encode_part
from neuroshard.node.outer.round import OuterRound, RoundConfig, RoundInput, RoundResult
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
    ds = deltas(n)
    inputs = [
        RoundInput(stage=0, round=1, base_hash=BASE, members=members, delta=ds[i], tokens=100)
        for i in range(n)
    ]
    results = await asyncio.gather(*(r.run(x) for r, x in zip(rounds, inputs, strict=True)))
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


@pytest.mark.asyncio
async def test_an_owner_that_signs_two_aggregates_is_caught_as_an_equivocator() -> None:
    Equivocator.delay_s = 0.0
    wallets, results = await run_stage(6, {3: Equivocator})
    bad = wallets[3].public_key_hex
    honest = [r for i, r in enumerate(results) if i != 3]
    assert all(r is not None for r in honest)
    # Replicas read the first or the second claim; the digests expose the two signatures.
    caught = [r for r in honest if r is not None and bad in r.cheats]
    assert caught, "no honest replica saw the two claims"
