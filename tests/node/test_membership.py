"""Pipeline neighbours (node.membership.Neighbours): whom a replica sends micro-batches to and takes
them from, by the neighbouring stage's member list. The round's split is tested with the round
(tests/node/outer/test_probation.py)."""

from __future__ import annotations

import pytest

from neuroshard.node import reporting as reporting_module
from neuroshard.node.membership import Neighbours, StageRoster
from neuroshard.node.reporting import Reporting
from neuroshard.node.verifier_client import VerifierUnreachable
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.roster import MemberList

ADMITTED = frozenset(f"a{i}" for i in range(8))
FLOOD = frozenset(f"p{i:04d}" for i in range(1000))


def probation(stage: int = 1) -> StageRoster:
    return StageRoster(
        stage=stage, policy="probation", admitted=ADMITTED, probation=FLOOD, source="verifier epoch 3"
    )


def test_without_a_roster_everyone_is_taken() -> None:
    neighbours = Neighbours(1)
    assert neighbours.takes("anyone") and neighbours.roster is None


def test_admitted_wallets_are_taken_and_wallets_off_the_list_are_not() -> None:
    neighbours = Neighbours(1)
    neighbours.set(StageRoster(stage=1, policy="allowlist", admitted=ADMITTED, source="verifier epoch 2"))
    assert all(neighbours.takes(w) for w in ADMITTED)
    why = neighbours.refusal("stranger")
    assert why is not None and "not on stage 1's member list (verifier epoch 2)" in why
    neighbours.set(None)  # the stage went open
    assert neighbours.takes("stranger")


def test_listed_probationers_are_taken_as_admitted_wallets_are() -> None:
    neighbours = Neighbours(1)
    neighbours.set(probation())
    assert all(neighbours.takes(w) for w in ADMITTED | FLOOD) and not neighbours.takes("p9999")


def test_a_roster_of_another_stage_is_refused() -> None:
    with pytest.raises(ValueError, match="roster of stage 2 given for stage 1"):
        Neighbours(1).set(probation(stage=2))


def test_the_tracker_s_lists_reach_the_neighbours_a_replica_built() -> None:
    operator = Wallet.from_token("neighbours-operator")
    lines: list[str] = []
    reporting = Reporting(url="http://127.0.0.1:9", operator_key=operator.public_key_hex, log=lines.append)
    before, after = reporting.neighbours_of(0), reporting.neighbours_of(2)
    assert reporting.neighbours_of(2) is after

    def listing(stage: int, policy: str, epoch: int) -> MemberList:
        return MemberList.create(
            operator, network="n", expires_at=2**40, stage=stage, epoch=epoch, effective_round=0, policy=policy,
            admitted=(operator.public_key_hex,), probation=(), admission_rounds=3,
        )  # fmt: skip

    reporting._take_neighbours(listing(2, "allowlist", 1))
    reporting._take_neighbours(listing(2, "allowlist", 2))  # the same members again: said once
    assert (
        before.roster is None
        and after.roster is not None
        and after.takes(operator.public_key_hex)
        and not after.takes("stranger")
    )
    assert lines == [
        "membership: pipeline neighbours of stage 2: 1 admitted, 0 on probation (allowlist, verifier epoch 1); no others"
    ]
    reporting._take_neighbours(listing(2, "open", 3))
    assert after.takes("stranger") and lines[-1].startswith("membership: stage 2 is open")
    # Asked for once the tracker runs, a stage's lists would never be read: refused.
    reporting.tracker = object()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="after the tracker started"):
        reporting.neighbours_of(3)


def test_a_replica_reads_its_neighbours_lists_before_it_works_with_anyone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`neighbours_of` reads the stage's list at once (the tracker only keeps it current), so a
    replica does not start by taking micro-batches from anyone; a list it cannot read is said."""
    operator = Wallet.from_token("neighbours-operator")
    asked: list[int] = []

    def fetch(url: str, stage: int, operator_key: str, network: str, **_: object) -> MemberList:
        asked.append(stage)
        if stage == 2:
            raise VerifierUnreachable("GET /api/stages/2/members: timed out")
        return MemberList.create(
            operator, network=network, expires_at=2**40, stage=stage, epoch=1, effective_round=0,
            policy="allowlist", admitted=(operator.public_key_hex,), probation=(), admission_rounds=3,
        )  # fmt: skip

    monkeypatch.setattr(reporting_module, "fetch_member_list", fetch)
    lines: list[str] = []
    reporting = Reporting(
        url="http://127.0.0.1:9", operator_key=operator.public_key_hex, log=lines.append, network_name="n"
    )
    before, after = reporting.neighbours_of(0), reporting.neighbours_of(2)
    reporting.neighbours_of(0)
    assert asked == [0, 2]  # once each
    assert not before.takes("stranger") and before.takes(operator.public_key_hex)
    assert after.roster is None and after.takes("stranger")
    assert "membership: pipeline neighbours of stage 0: 1 admitted" in lines[0]
    assert "stage 2's member list not read at start (GET /api/stages/2/members: timed out)" in lines[1]
