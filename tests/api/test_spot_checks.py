"""GET /api/training/spot-checks: replay coverage and the unnoticed-liar bound, as configured."""

import pytest
from fastapi.testclient import TestClient

from neuroshard.api.app import create_app
from neuroshard.node.wallet import Wallet
from neuroshard.testing.api import Harness, receipt_doc, test_config
from neuroshard.testing.verifier import ManualClock
from neuroshard.verifier import ledger
from neuroshard.verifier.budget import ReplayBudget
from neuroshard.verifier.replaycheck import ReplayCheckConfig

NODES = [Wallet.from_token(f"covered-{i}") for i in range(4)]


def report_rounds(h: Harness, rounds: int) -> None:
    for w in NODES:
        h.register(w)
    for r in range(rounds):
        for w in NODES:
            assert h.post(w, "/api/receipts", receipt_doc(r, f"{r:064x}")).status_code == 201


def test_coverage_without_replays(harness: Harness) -> None:
    report_rounds(harness, 3)
    with harness.services.db.write() as s:
        ledger.record_spot_check(
            s, NODES[1].wallet_id, stage=0, round_=2, ok=True, detail="replay: cosine 1.000000",
            now=harness.clock(), cfg=harness.config.reputation,
        )  # fmt: skip
    body = harness.client.get("/api/training/spot-checks?window=2").json()
    assert body["mode"] == "off" and body["mean_check_probability"] == 0
    assert (body["latest_round"], body["wallets_reporting"], body["wallets_checked"]) == (2, 4, 1)
    checked = {w["wallet_id"]: w["last_check_round"] for w in body["wallets"]}
    assert checked[NODES[1].wallet_id] == 2 and checked[NODES[0].wallet_id] is None
    assert all(u["probability"] == 1 for u in body["unnoticed"]), "nothing replayed: nothing caught"
    assert harness.client.get("/api/training/spot-checks?window=0").status_code == 422
    assert harness.client.head("/api/training/spot-checks").status_code == 200


@pytest.mark.parametrize("replays", ["rate", "budget"])
def test_coverage_reports_the_configured_draw(database_url: str, replays: str) -> None:
    clock = ManualClock()
    config = test_config(
        database_url,
        clock,
        # poll_s: the checker's thread never wakes during the test (it would fetch from the nodes).
        replay_checks=ReplayCheckConfig(sample_rate=0.25, poll_s=3600)
        if replays == "rate"
        else ReplayCheckConfig(budget=ReplayBudget(replicas=2.0), poll_s=3600),
    )
    with TestClient(create_app(config)) as client:
        h = Harness(client, clock, config)
        report_rounds(h, 2)
        body = client.get("/api/training/spot-checks?limit=2").json()
    assert body["mode"] == replays and len(body["wallets"]) == 2
    if replays == "rate":
        assert body["sample_rate"] == 0.25 and body["mean_check_probability"] == pytest.approx(0.25)
        assert body["max_gap_rounds"] is None
    else:
        # 4 equally new wallets share the random half of 2 replays a round: 0.25 each.
        assert body["budget_replicas"] == 2.0 and body["mean_check_probability"] == pytest.approx(0.25)
        assert body["max_gap_rounds"] == 4  # ceil(4 wallets / (0.5 x 2))
    bound = {(u["lie_fraction"], u["rounds"]): u["probability"] for u in body["unnoticed"]}
    assert bound[(0.5, 10)] == pytest.approx((1 - 0.25 * 0.5) ** 10)
