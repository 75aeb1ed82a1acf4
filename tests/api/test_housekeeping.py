"""The write path's upkeep (issue 15): receipts settle their stage at most every
`settle_interval_s` per process, and the lead process's housekeeping settles what the pauses
left waiting and forgets expired nonces."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from neuroshard.api.app import create_app
from neuroshard.api.services import SettleGate
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.roster import Roster
from neuroshard.testing.api import Harness, receipt_doc
from neuroshard.testing.api import test_config as make_config
from neuroshard.testing.verifier import ManualClock
from neuroshard.verifier import members
from neuroshard.verifier import models as m
from neuroshard.verifier.background import JobContext
from neuroshard.verifier.housekeeping import Housekeeping, HousekeepingConfig
from neuroshard.verifier.members import MembershipConfig

WALLETS = [Wallet.from_token(f"keeper-{i}") for i in range(3)]


def send_two_rounds(harness: Harness) -> None:
    """Every wallet registers and reports rounds 0 and 1 with the same hash."""
    for w in WALLETS:
        harness.register(w)
    for round_ in (0, 1):
        for w in WALLETS:
            response = harness.post(w, "/api/receipts", receipt_doc(round_, f"{round_:064x}"))
            assert response.status_code == 201, response.text


def test_the_gate_lets_one_settlement_per_stage_through_per_interval() -> None:
    gate = SettleGate(3600.0)
    assert gate.due(0) and gate.due(1)
    assert not gate.due(0) and not gate.due(1)
    always = SettleGate(0.0)
    assert all(always.due(0) for _ in range(3))


def test_rounds_the_gate_skipped_are_settled_by_housekeeping_with_the_expired_nonces(
    database_url: str,
) -> None:
    clock = ManualClock()
    # A long housekeeping period: this test runs the sweep itself, the lease's thread stays idle.
    config = make_config(
        database_url, clock, settle_interval_s=3600.0, housekeeping=HousekeepingConfig(period_s=3600.0)
    )
    with TestClient(create_app(config)) as client:
        harness = Harness(client, clock, config)
        send_two_rounds(harness)
        # Every replica moved past round 0, but only the first receipt passed the gate (nothing
        # was waiting then): no round is settled yet.
        assert harness.count(m.Round) == 0
        nonces = harness.count(m.Nonce)
        assert nonces == 9  # 3 registrations + 6 receipts

        services = harness.services
        ctx = JobContext(
            db=services.db, network=config.network, operator=config.operator, log=print, clock=clock
        )
        keeper = Housekeeping(
            ctx,
            ledger_config=services.ledger,
            config=HousekeepingConfig(),
        )
        purged, settled = keeper.run_once()
        assert (purged, settled) == (0, {0: [0]})
        with services.db.read() as session:
            row = session.get(m.Round, (0, 0))
            assert row is not None and row.majority_hash == f"{0:064x}"

        clock.advance(config.freshness_window_s + 1)  # every nonce expired, but only just
        assert keeper.run_once() == (0, {})
        clock.advance(config.freshness_window_s)  # a window after they expired: forgotten
        purged, settled = keeper.run_once()
        assert (purged, settled) == (nonces, {})
        assert harness.count(m.Nonce) == 0


def test_the_lease_holder_runs_the_sweep(database_url: str) -> None:
    clock = ManualClock()
    config = make_config(
        database_url, clock, settle_interval_s=3600.0, housekeeping=HousekeepingConfig(period_s=0.1)
    )
    with TestClient(create_app(config)) as client:
        harness = Harness(client, clock, config)
        send_two_rounds(harness)
        deadline = time.monotonic() + 20.0
        while harness.count(m.Round) == 0:  # settled by the lease holder's own thread
            assert time.monotonic() < deadline, "the housekeeping sweep never settled round 0"
            time.sleep(0.05)
        body = client.get("/api/training/history").json()
        settled = [(r["stage"], r["round"]) for r in body["rounds"] if r["settled"]]
        assert settled == [(0, 0)]  # and the reads show it


def _keeper(harness: Harness) -> Housekeeping:
    """The lead's housekeeping on the harness's database and clock, swept by the test itself."""
    config, services = harness.config, harness.services
    ctx = JobContext(
        db=services.db, network=config.network, operator=config.operator, log=print, clock=harness.clock
    )
    return Housekeeping(ctx, ledger_config=services.ledger, config=HousekeepingConfig())


def test_housekeeping_starts_a_new_turn_of_listed_probationers_once_a_turn(database_url: str) -> None:
    """A full probation list whose turn is over gets a new epoch from the sweep, served at once by
    GET /api/stages/0/members; within a turn, and once handled, the sweep changes nothing."""
    clock = ManualClock()
    membership = MembershipConfig(
        policy="probation", max_probation_listed=1, probation_turns=1.0, probation_turn_s=100.0
    )
    config = make_config(database_url, clock, membership=membership)
    newcomers = [Wallet.from_token(f"keeper-new-{i}") for i in range(4)]
    with TestClient(create_app(config)) as client:
        harness = Harness(client, clock, config)
        assert harness.register(WALLETS[0]).status_code in (200, 201)  # the stage's genesis member
        keeper = _keeper(harness)

        def served() -> tuple[int, tuple[str, ...]]:
            doc = client.get("/api/stages/0/members").json()
            return doc["epoch"], tuple(doc["probation"])

        next_round = 0

        def report(n: int) -> None:  # the genesis member's rounds: a turn needs rounds to work in
            nonlocal next_round
            for r in range(next_round, next_round + n):
                assert (
                    harness.post(WALLETS[0], "/api/receipts", receipt_doc(r, f"{r:064x}")).status_code == 201
                )
            next_round += n

        report(1)
        for w in newcomers:
            assert harness.register(w).status_code in (200, 201)
        first = served()
        named = {first[1]}
        keeper.run_once()
        assert served() == first  # the turn is not over
        for _ in range(6):
            clock.advance(100.0)
            keeper.run_once()
            assert served() == first  # nor are its rounds
            report(membership.lead_rounds + members.TURN_ROUNDS)
            keeper.run_once()
            now = served()
            assert now[0] == first[0] + 1 and len(now[1]) == 1
            keeper.run_once()
            assert served() == now  # once a turn
            first = now
            named.add(now[1])
        assert len(named) > 1  # the one place went round


def test_housekeeping_gives_the_lists_a_new_epoch_when_the_roster_expires(database_url: str) -> None:
    """Past the operator's roster's expiry GET /api/stages/0/members serves the same list at the
    same epoch (a node holding that epoch keeps it), until the sweep moves the epoch: the new list
    leaves the roster's wallets out. Once handled, the sweep changes nothing."""
    clock = ManualClock()
    config = make_config(database_url, clock, membership=MembershipConfig(policy="allowlist"))
    with TestClient(create_app(config)) as client:
        harness = Harness(client, clock, config)
        roster = Roster.build(
            config.operator,
            network=config.network.name,
            version=1,
            expires_at=int(clock()) + 60,
            stages={0: [WALLETS[0].public_key_hex]},
        )
        assert harness.post_raw(config.operator, "/api/admin/roster", roster.to_json()).status_code == 200
        assert harness.register(WALLETS[0]).status_code in (200, 201)
        keeper = _keeper(harness)

        def served() -> tuple[int, tuple[str, ...]]:
            doc = client.get("/api/stages/0/members").json()
            return doc["epoch"], tuple(doc["admitted"])

        before = served()
        assert before[1] == (WALLETS[0].public_key_hex,)
        keeper.run_once()
        assert served() == before  # in force
        clock.advance(61.0)
        assert served() == before  # expired, but this epoch's list named it
        keeper.run_once()
        after = served()
        assert after == (before[0] + 1, ())
        keeper.run_once()
        assert served() == after
