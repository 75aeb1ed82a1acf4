"""A Sybil flood against a stage with a member list (issue #19), with the real round objects.

A stage of 8 admitted honest replicas runs partitioned rounds (``OuterRound`` over the in-memory
carrier ``MemoryHub``, short real deadlines) while an attacker holds 1,000 fresh wallets, all of
them on the stage's probation list (the worst case: each passed the verifier's registration
proof of work and rate limit). Every round each flood wallet commits to the members' list,
publishes a Δ that pushes the model up the loss (−4 × an honest Δ), and publishes a signed
status voting for a θ hash of its own. What a member does with them is what
``neuroshard.node.membership`` and ``PeerPlane`` do:

- the round's probationers are the capped, hash-ranked few of the 1,000
  (``split_members``; ``ProbationCap`` default: 25% of the admitted, at most 16: 2 here);
  owners read and screen their parts and never aggregate them;
- the θ-hash vote counts the statuses of admitted members only (``Exchange.counts``).

Measured, alternating flooded and clean rounds (same Δs, same seed): whether every honest
aggregate equals the clean stage's bit for bit (a probationer's contribution in it would change
it), the vote's winner, the members' round wall time (median) and bytes fetched per member;
then a stage in which 2 of the wallets earned admission and attack as members (10 admitted:
8 honest + 2 sign-flippers): the robust rule's distance from the honest median.

    .venv/bin/python bench/sim_sybil.py            # 8 + 1,000 wallets, 5 rounds each way: ~1 min
    .venv/bin/python bench/sim_sybil.py --quick    # 8 + 100 wallets, 2 rounds each way
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence

import torch

from neuroshard.node.aggregation import network_rule
from neuroshard.node.membership import StageRoster, split_members
from neuroshard.node.outer.port import MemoryHub
from neuroshard.node.outer.round import OuterRound
from neuroshard.node.outer.state import RoundConfig, RoundInput, RoundResult
from neuroshard.node.p2p.quorum import quorum
from neuroshard.node.p2p.rounds import plurality
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.peer import StateInfo

D = 8 * 4096
BASE = "5e" * 32


def config() -> RoundConfig:
    return RoundConfig(commit_timeout_s=3.0, part_timeout_s=3.0, gather_timeout_s=2.0, agree_timeout_s=3.0)


def wallets(prefix: str, n: int) -> list[Wallet]:
    return sorted(
        (Wallet.from_token(f"sybil-bench-{prefix}-{i}") for i in range(n)), key=lambda w: w.public_key_hex
    )


def honest_deltas(n: int, round_: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + round_)
    direction = torch.randn(D, generator=torch.Generator().manual_seed(1)) * 0.01
    return [direction + torch.randn(D, generator=g) * 0.005 for _ in range(n)]


async def run_round(
    hub: MemoryHub,
    members: Sequence[Wallet],
    deltas: Sequence[torch.Tensor],
    round_: int,
    roster: StageRoster | None,
    flood: Sequence[Wallet],
    rule_f: int,
) -> tuple[list[RoundResult], float]:
    """One round of the members; the flood's objects are published first (they cost the attacker,
    not the members). Returns the members' results and their wall time."""
    keys = tuple(w.public_key_hex for w in members)
    live = set(keys) | {w.public_key_hex for w in flood}
    split = split_members(live, keys[0], roster, round_)
    assert split.members == keys
    rule = network_rule("trimmed_mean", rule_f)
    for w in flood:  # every flood wallet commits and publishes its Δ, picked by the cap or not
        attacker = OuterRound(hub.store(w.public_key_hex), w, rule, config())
        forged = RoundInput(
            stage=0, round=round_, base_hash=BASE, members=keys, delta=-4.0 * deltas[0], tokens=1,
            probationers=tuple(sorted({*split.probationers, w.public_key_hex})),
        )  # fmt: skip
        held = await attacker._commit(forged)
        await attacker._scatter(held)
    started = time.perf_counter()
    results = await asyncio.gather(
        *(
            OuterRound(hub.store(w.public_key_hex), w, rule, config()).run(
                RoundInput(
                    stage=0,
                    round=round_,
                    base_hash=BASE,
                    members=keys,
                    delta=deltas[i],
                    tokens=1,
                    probationers=split.probationers,
                )
            )
            for i, w in enumerate(members)
        )
    )
    return list(results), time.perf_counter() - started


def vote(
    members: Sequence[Wallet], flood: Sequence[Wallet], roster: StageRoster, round_: int
) -> tuple[str, int]:
    """The θ-hash vote as a member counts it: statuses of admitted wallets only (Exchange.counts)."""
    honest_hash, fake_hash = "11" * 32, "ff" * 32
    infos = [
        StateInfo.create(w, stage=0, round=round_, theta_hash=honest_hash, momentum_hash="", numel=D)
        for w in members
    ] + [
        StateInfo.create(w, stage=0, round=round_, theta_hash=fake_hash, momentum_hash="", numel=D)
        for w in flood
    ]
    counted = [i for i in infos if roster.counts(i.wallet)]
    result = plurality(counted, round_, None)
    assert result is not None
    return result.theta_hash, len(counted)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--honest", type=int, default=8)
    parser.add_argument("--flood", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="100 flood wallets, 2 rounds each way")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    if args.quick:
        args.flood, args.rounds = 100, 2
    torch.set_num_threads(1)
    members = wallets("member", args.honest)
    flood = wallets("flood", args.flood)
    roster = StageRoster(
        stage=0,
        policy="probation",
        admitted=frozenset(w.public_key_hex for w in members),
        probation=frozenset(w.public_key_hex for w in flood),
        source="sim_sybil",
    )
    f = max(1, round(0.2 * args.honest))
    print(f"[sybil] {args.honest} admitted honest replicas, {args.flood} flood wallets on probation, d = {D}")
    clean_s, flooded_s, clean_b, flooded_b = [], [], [], []
    with_probationer, screened, refused, votes_lost = 0, 0, 0, 0
    for r in range(args.rounds):
        ds = honest_deltas(args.honest, r)
        outcome: dict[bool, tuple[list[RoundResult], float, float]] = {}
        for flooded in (False, True) if r % 2 == 0 else (True, False):  # alternate which goes first
            hub = MemoryHub()
            results, seconds = asyncio.run(
                run_round(hub, members, ds, r, roster if flooded else None, flood if flooded else (), f)
            )
            fetched = statistics.median(hub.stores[w.public_key_hex].traffic.bytes_received for w in members)
            outcome[flooded] = (results, seconds, fetched)
        clean = outcome[False][0][0].aggregate
        results, seconds, fetched = outcome[True]
        clean_s.append(outcome[False][1])
        clean_b.append(outcome[False][2])
        flooded_s.append(seconds)
        flooded_b.append(fetched)
        same = all(torch.equal(x.aggregate, clean) for x in results)
        with_probationer += not same
        for x in results:
            screened += len(x.probation)
            refused += sum("refused" in v for v in x.probation.values())
        winner, counted = vote(members, flood, roster, r)
        votes_lost += winner != "11" * 32
        print(
            f"[sybil] round {r}: aggregate equals the clean stage's: {same}; probation verdicts "
            f"{sum(len(x.probation) for x in results)}; vote counted {counted} statuses (quorum {quorum(counted)}), "
            f"winner honest: {winner == '11' * 32}; round {seconds:.2f} s (clean {clean_s[-1]:.2f} s)"
        )
    # Two wallets that earned admission, then attack as members: the robust rule's job.
    admitted = wallets("member", args.honest) + wallets("earned", 2)
    admitted.sort(key=lambda w: w.public_key_hex)
    earned = {w.public_key_hex for w in wallets("earned", 2)}
    ds = honest_deltas(len(admitted), 99)
    ds = [-4.0 * d if w.public_key_hex in earned else d for w, d in zip(admitted, ds, strict=True)]
    hub = MemoryHub()
    results, _ = asyncio.run(run_round(hub, admitted, ds, 99, None, (), max(1, round(0.2 * len(admitted)))))
    honest_rows = torch.stack(
        [d for w, d in zip(admitted, ds, strict=True) if w.public_key_hex not in earned]
    )
    reference = honest_rows.median(dim=0).values
    error = float((results[0].aggregate - reference).norm() / reference.norm())
    caught = sum(w in results[0].refused for w in earned)
    figures = {
        "honest": args.honest,
        "flood_wallets": args.flood,
        "rounds": args.rounds,
        "rounds_with_a_probationer_in_the_aggregate": with_probationer,
        "votes_decided_by_probationers": votes_lost,
        "probation_verdicts": screened,
        "probation_refused": refused,
        "round_s_clean_median": statistics.median(clean_s),
        "round_s_flooded_median": statistics.median(flooded_s),
        "round_time_ratio": statistics.median(flooded_s) / statistics.median(clean_s),
        "bytes_per_member_clean": statistics.median(clean_b),
        "bytes_per_member_flooded": statistics.median(flooded_b),
        "earned_admission_error_vs_honest_median": error,
        "earned_admission_refused_by_screening": caught,
    }
    print(
        f"[sybil] {with_probationer}/{args.rounds} flooded rounds had a probationer's contribution in the aggregate; "
        f"{votes_lost} votes decided by probationers; round time flooded/clean "
        f"{figures['round_time_ratio']:.3f}× (medians {figures['round_s_flooded_median']:.2f} s / "
        f"{figures['round_s_clean_median']:.2f} s); bytes per member {figures['bytes_per_member_flooded'] / 1e3:.0f} KB "
        f"flooded / {figures['bytes_per_member_clean'] / 1e3:.0f} KB clean"
    )
    print(
        f"[sybil] 2 admitted attackers (sign flip ×−4) among {len(admitted)}: refused by the owners' screening in "
        f"{caught}/2, aggregate within {error:.3f} (relative) of the honest median"
    )
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
