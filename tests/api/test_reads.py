"""Read endpoints: the verdict, the training picture, tracker, nodes, network, metrics, dashboard."""

import re

import pytest
from fastapi.testclient import TestClient

from neuroshard.api.app import STATIC_DIR, create_app
from neuroshard.node.wallet import Wallet
from neuroshard.testing.api import OPERATOR, Harness, receipt_doc, test_config
from neuroshard.testing.verifier import ManualClock, small_network
from neuroshard.verifier import ledger
from neuroshard.verifier.network import NETWORK_SIGNATURE_HEADER, OPERATOR_HEADER, verify_network

HONEST = [Wallet.from_token(f"honest-{i}") for i in range(3)]
ATTACKER = Wallet.from_token("attacker")


def theta(round_: int) -> str:
    return f"{round_:064x}"


def record(h: Harness, round_: int, loss: float, stderr: float | None = 0.01) -> None:
    with h.services.db.write() as session:
        ledger.record_evaluation(session, round_, loss, 4096, stderr=stderr, now=h.clock())


def run_rounds(h: Harness, rounds: int, attacker_rounds: int) -> None:
    """3 honest replicas agree on θ every round; the attacker reports its own hash."""
    for w in [*HONEST, ATTACKER]:
        h.register(w)
    for r in range(rounds):
        for w in HONEST:
            assert h.post(w, "/api/receipts", receipt_doc(r, theta(r))).status_code == 201
        if r < attacker_rounds:
            assert h.post(ATTACKER, "/api/receipts", receipt_doc(r, "e" * 64)).status_code == 201
        h.clock.advance(10)
        for w in HONEST:
            h.post(w, "/api/heartbeat", {"stage": 0, "round": r + 1, "steps_in_round": 2})


def test_verdict_needs_measurements(harness: Harness) -> None:
    v = harness.client.get("/api/training/verify").json()
    assert v["training_verified"] is False
    assert v["reason"] == "insufficient data: 0 evaluations, need 3"
    record(harness, 0, 6.2)
    v = harness.client.get("/api/training/verify").json()
    assert v["reason"] == "insufficient data: 1 evaluation, need 3"
    assert v["global_loss"] == 6.2


def test_self_reported_losses_never_verify_training(harness: Harness) -> None:
    run_rounds(harness, rounds=5, attacker_rounds=0)  # receipts report losses falling 6.0 → 5.6
    v = harness.client.get("/api/training/verify").json()
    assert v["reported_loss"] == pytest.approx(5.6)
    assert v["training_verified"] is False
    assert v["global_loss"] is None


def test_measured_fall_verifies_training(harness: Harness) -> None:
    for r, loss in ((0, 6.2), (5, 5.6), (10, 5.1)):
        record(harness, r, loss)
    v = harness.client.get("/api/training/verify").json()
    assert v["training_verified"] is True
    assert v["initial_loss"] == 6.2 and v["global_loss"] == 5.1
    assert v["loss_trend"] == "falling"
    assert v["evaluations"] == 3
    history = harness.client.get("/api/training/history").json()
    assert [(e["round"], e["loss"]) for e in history["evaluations"]] == [(0, 6.2), (5, 5.6), (10, 5.1)]


def test_attacker_is_refused_and_honest_hashes_agree(harness: Harness) -> None:
    run_rounds(harness, rounds=4, attacker_rounds=3)
    v = harness.client.get("/api/training/verify").json()
    assert v["hash_agreement_rate"] == pytest.approx(0.75)  # rounds 0-2 settled: 3 of 4 agree
    assert v["sync_success_rate"] == 1.0
    assert v["rounds"] == 4 and v["rounds_settled"] == 3
    assert v["active_nodes"] == 3  # the attacker stopped heart-beating and is refused

    nodes = {n["wallet_id"]: n for n in harness.client.get("/api/nodes").json()}
    assert nodes[ATTACKER.wallet_id]["status"] == "refused"
    assert "minority hash" in nodes[ATTACKER.wallet_id]["status_reason"]
    assert all(nodes[w.wallet_id]["status"] == "active" for w in HONEST)
    assert all(nodes[w.wallet_id]["reputation"] > 0.5 for w in HONEST)

    r = harness.post(ATTACKER, "/api/receipts", receipt_doc(4, "e" * 64))
    assert r.status_code == 403
    r = harness.post(
        ATTACKER, "/api/register", {"address": "http://127.0.0.1:9999", "stage": 0, "software_version": "1"}
    )
    assert r.status_code == 403

    detail = harness.client.get(f"/api/nodes/{ATTACKER.wallet_id}").json()
    assert detail["receipts"] == 3
    assert [rc["in_majority"] for rc in detail["recent_receipts"]] == [False, False, False]
    assert len(detail["recent_events"]) == 3
    assert detail["recent_events"][0]["delta"] < 0
    by_key = harness.client.get(f"/api/nodes/{ATTACKER.public_key_hex}").json()
    assert by_key["node"]["wallet_id"] == ATTACKER.wallet_id

    g = harness.client.get("/api/training/global").json()
    assert g["nodes_training"] == 3 and g["nodes_registered"] == 4 and g["nodes_refused"] == 1
    assert g["total_inner_steps"] == 4 * (3 * 4 + 3)
    assert g["data_shards_covered"] == 4
    stage = g["stages"][0]
    assert stage["latest_round"] == 3 and stage["replicas_alive"] == 3
    assert stage["majority_hash"] == theta(2)
    assert g["diloco"]["inner_steps_per_round"] == 4
    assert g["diloco"]["inner_progress"] == pytest.approx(0.5)

    rounds = harness.client.get("/api/training/history").json()["rounds"]
    assert [(r["round"], r["votes"], r["settled"]) for r in rounds] == [
        (0, 4, True),
        (1, 4, True),
        (2, 4, True),
        (3, 3, False),
    ]


def test_peer_list_follows_heartbeats(harness: Harness) -> None:
    a, b = HONEST[0], HONEST[1]
    harness.register(a, stage=0)
    harness.register(b, stage=0)
    assert {p["wallet_id"] for p in harness.client.get("/api/peers?stage=0").json()} == {
        a.wallet_id,
        b.wallet_id,
    }
    harness.clock.advance(harness.config.peer_ttl_s - 1)
    assert harness.post(a, "/api/heartbeat", {"stage": 0, "round": 1, "steps_in_round": 0}).status_code == 200
    harness.clock.advance(2)
    peers = harness.client.get("/api/peers", params={"stage": 0}).json()
    assert [p["wallet_id"] for p in peers] == [a.wallet_id]
    assert peers[0]["address"] == "http://127.0.0.1:9000"
    assert harness.client.get("/api/peers?stage=1").json() == []
    assert harness.client.get("/api/peers?stage=-1").status_code == 422


def test_node_lookup_errors(harness: Harness) -> None:
    assert harness.client.get(f"/api/nodes/{'a' * 20}").status_code == 404
    assert harness.client.get("/api/nodes/not-a-wallet").status_code == 422


def test_network_definition_is_signed_by_the_operator(harness: Harness) -> None:
    r = harness.client.get("/api/network")
    assert r.status_code == 200
    assert r.headers[OPERATOR_HEADER] == OPERATOR.public_key_hex
    net = verify_network(r.content, r.headers[NETWORK_SIGNATURE_HEADER], OPERATOR.public_key)
    assert net == harness.config.network


def test_metrics_exposition(harness: Harness) -> None:
    run_rounds(harness, rounds=2, attacker_rounds=0)
    record(harness, 0, 6.0)
    r = harness.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = r.text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert samples["neuroshard_active_nodes"] == "4"  # the idle attacker registered 20 s ago: still live
    assert samples["neuroshard_receipts_total"] == "6"
    assert samples["neuroshard_global_loss_measured"] == "6.0"
    assert samples["neuroshard_training_verified"] == "0"
    assert samples['neuroshard_http_requests_total{method="POST",route="/api/receipts",status="201"}'] == "6"
    # Every heartbeat and receipt went through the group commit (one request at a time here).
    assert int(samples['neuroshard_write_groups_total{outcome="all"}']) >= 6
    assert samples['neuroshard_write_groups_total{outcome="rerun"}'] == "0"
    for line in text.splitlines():
        assert line.startswith("#") or re.fullmatch(r"[a-z_]+(\{[^}]*\})? (NaN|[-+0-9.e]+)", line), line
    names = re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)
    assert all(kind == "counter" for name, kind in names if name.endswith("_total"))


def test_dashboard_is_served_from_the_package_without_a_cdn(harness: Harness) -> None:
    page = harness.client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text)
    assert sorted(assets) == ["/static/dashboard.css", "/static/dashboard.js"]
    for asset in assets:
        assert harness.client.get(asset).status_code == 200
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        assert not re.search(r"(src|href)=[\"']?(https?:)?//", text), (
            f"{path.name} loads something from outside"
        )
        assert "import(" not in text and "@import" not in text


def test_openapi_documents_every_endpoint(harness: Harness) -> None:
    spec = harness.client.get("/openapi.json").json()
    paths = set(spec["paths"])
    assert {
        "/api/register",
        "/api/heartbeat",
        "/api/receipts",
        "/api/admin/reinstate",
        "/api/peers",
        "/api/training/verify",
        "/api/training/global",
        "/api/training/history",
        "/api/nodes",
        "/api/nodes/{wallet}",
        "/api/network",
        "/metrics",
    } <= paths
    receipt_schema = spec["paths"]["/api/receipts"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    assert receipt_schema["additionalProperties"] is False
    assert set(spec["paths"]["/api/receipts"]["post"]["responses"]) >= {
        "200",
        "201",
        "401",
        "403",
        "409",
        "413",
        "422",
        "429",
    }


def test_app_migrates_an_empty_database_at_start(empty_database_url: str) -> None:
    clock = ManualClock()
    with TestClient(create_app(test_config(empty_database_url, clock))) as client:
        h = Harness(client, clock, test_config(empty_database_url, clock))
        h.register(HONEST[0])
        assert h.post(HONEST[0], "/api/receipts", receipt_doc(0, theta(0))).status_code == 201
    with TestClient(
        create_app(test_config(empty_database_url, clock))
    ) as client:  # second start: no-op upgrade
        assert [n["wallet_id"] for n in client.get("/api/nodes").json()] == [HONEST[0].wallet_id]


def test_every_stage_shows_its_own_latest_round_when_one_runs_ahead(database_url: str) -> None:
    """A lone stage-1 replica can finish many rounds while stage 0 does a few; the picture per
    stage must not come from the newest rounds overall (they would all be stage 1's)."""
    clock = ManualClock()
    config = test_config(database_url, clock, network=small_network(stages={"count": 2}))
    with TestClient(create_app(config)) as client:
        h = Harness(client, clock, config)
        h.register(HONEST[0], stage=0)
        h.register(HONEST[1], stage=1)
        assert h.post(HONEST[0], "/api/receipts", receipt_doc(0, theta(0), stage=0)).status_code == 201
        for r in range(12):
            doc = receipt_doc(r, theta(r), stage=1, data=[])
            assert h.post(HONEST[1], "/api/receipts", doc).status_code == 201
        stages = client.get("/api/training/global").json()["stages"]
    assert [(s["stage"], s["latest_round"]) for s in stages] == [(0, 0), (1, 11)]
