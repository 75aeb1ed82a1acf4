"""Cached reads: ETag and 304, Cache-Control, HEAD, pagination, and how rarely the database is read."""

import threading
import time

import pytest
from fastapi.testclient import TestClient

from neuroshard.api.app import create_app
from neuroshard.api.cache import ReadCache
from neuroshard.node.wallet import Wallet
from neuroshard.testing.api import Harness, receipt_doc, test_config
from neuroshard.testing.verifier import ManualClock
from neuroshard.verifier import ledger
from neuroshard.verifier.config import ReadCacheConfig

WALLETS = [Wallet.from_token(f"page-{i}") for i in range(7)]
READS = ["/api/training/verify", "/api/training/global", "/api/training/history", "/api/nodes", "/api/peers"]


def test_etag_and_304_until_the_data_changes(harness: Harness) -> None:
    first = harness.client.get("/api/training/verify")
    etag = first.headers["etag"]
    assert first.status_code == 200 and etag.startswith('"') and etag.endswith('"')
    assert first.headers["cache-control"] == f"public, max-age={int(harness.config.reads.max_age_s)}"
    again = harness.client.get("/api/training/verify", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == etag
    # A proxy may weaken the tag, or send several.
    weak = harness.client.get("/api/training/verify", headers={"If-None-Match": f'"x", W/{etag}'})
    assert weak.status_code == 304
    with harness.services.db.write() as session:
        ledger.record_evaluation(session, 0, 6.1, 4096, stderr=0.01, now=harness.clock())
    changed = harness.client.get("/api/training/verify", headers={"If-None-Match": etag})
    assert changed.status_code == 200 and changed.headers["etag"] != etag
    assert changed.json()["global_loss"] == 6.1


@pytest.mark.parametrize("path", [*READS, "/api/network", "/", "/static/dashboard.js"])
def test_head_answers_wherever_get_does(harness: Harness, path: str) -> None:
    get = harness.client.get(path)
    head = harness.client.head(path)
    assert get.status_code == 200 and head.status_code == 200
    assert head.content == b""
    assert head.headers["content-length"] == get.headers["content-length"] != "0"
    assert head.headers.get("etag") == get.headers.get("etag")


def test_head_where_get_is_not_served_is_refused(harness: Harness) -> None:
    assert harness.client.head("/api/receipts").status_code == 405
    assert harness.client.head("/api/nowhere").status_code == 404


def test_reads_are_rendered_once_until_a_write_or_max_age(harness: Harness) -> None:
    reads = harness.services.reads
    for path in READS:
        harness.client.get(path)
    rendered = reads.renders
    for _ in range(5):
        for path in READS:
            assert harness.client.get(path).status_code == 200
    assert reads.renders == rendered, "served from memory while nothing changed"
    harness.register(WALLETS[0])
    assert harness.client.get("/api/nodes").json()[0]["wallet_id"] == WALLETS[0].wallet_id
    assert reads.renders == rendered + 1
    harness.clock.advance(harness.config.reads.max_age_s)
    harness.client.get("/api/nodes")
    assert reads.renders == rendered + 2, "re-rendered once max_age passed"


def test_background_mode_serves_the_stale_body_while_one_thread_renders() -> None:
    clock, generation = ManualClock(), [0]
    cache = ReadCache(
        ReadCacheConfig(max_age_s=2.0, min_interval_s=0.5, background=True),
        clock=clock,
        generation=lambda: generation[0],
    )
    release, calls = threading.Event(), [0]

    def render() -> tuple[bytes, tuple[tuple[str, str], ...]]:
        calls[0] += 1
        if calls[0] > 1:
            assert release.wait(10)
        return f"v{calls[0]}".encode(), ()

    try:
        assert cache.get("k", render).body == b"v1"  # the first one renders in the request
        generation[0] += 1
        assert cache.get("k", render).body == b"v1", "min_interval not passed: still fresh"
        clock.advance(0.6)
        for _ in range(20):  # stale: every request still gets v1 at once, one render is started
            assert cache.get("k", render).body == b"v1"
        release.set()
        deadline = time.monotonic() + 10
        while cache.get("k", render).body != b"v2" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cache.get("k", render).body == b"v2"
        assert calls[0] == 2
    finally:
        release.set()
        cache.close()


def test_cache_keeps_at_most_max_entries() -> None:
    cache = ReadCache(
        ReadCacheConfig(max_entries=3, background=False), clock=ManualClock(), generation=lambda: 0
    )
    for i in range(10):
        cache.get(f"k{i}", lambda i=i: (str(i).encode(), ()))
    assert len(cache._entries) == 3 and set(cache._entries) == {"k7", "k8", "k9"}


def test_nodes_are_paged_with_total_and_next_link(harness: Harness) -> None:
    for w in WALLETS:
        harness.register(w)
    seen: list[str] = []
    path: str | None = "/api/nodes?limit=3"
    for _ in range(len(WALLETS)):  # bounded: at most one page per wallet
        if path is None:
            break
        page = harness.client.get(path)
        assert page.status_code == 200 and page.headers["x-total-count"] == str(len(WALLETS))
        seen += [n["wallet_id"] for n in page.json()]
        link = page.headers.get("link")
        path = link.split(">")[0].lstrip("<") if link else None
    assert seen == sorted(w.wallet_id for w in WALLETS)
    assert harness.client.get("/api/nodes?limit=2&offset=6").json()[0]["wallet_id"] == seen[6]
    assert harness.client.get("/api/nodes?offset=100").json() == []
    for bad in ("limit=0", "limit=1001", "offset=-1", "limit=x"):
        assert harness.client.get(f"/api/nodes?{bad}").status_code == 422


def test_history_is_paged_and_aggregated_like_the_receipts(harness: Harness) -> None:
    for w in WALLETS[:3]:
        harness.register(w)
    for r in range(5):
        for i, w in enumerate(WALLETS[:3]):
            doc = receipt_doc(
                r,
                f"{r:064x}" if i != r % 3 else "e" * 64,  # each wallet in the minority once in 3
                losses=[5.0 + i, 6.0 + i],
                accepted=[{"wallet": x.wallet_id} for x in WALLETS[: i + 1]],
            )
            assert harness.post(w, "/api/receipts", doc).status_code == 201
    full = harness.client.get("/api/training/history")
    assert full.headers["x-total-count"] == "5" and "link" not in full.headers
    rounds = full.json()["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3, 4]
    for r in rounds:
        assert (r["votes"], r["agreeing"], r["accepted"]) == (3, 2, 1 + 2 + 3)
        assert r["reported_loss"] == pytest.approx((5 + 6 + 6 + 7 + 7 + 8) / 6)
    page = harness.client.get("/api/training/history?limit=2&offset=1")
    assert [r["round"] for r in page.json()["rounds"]] == [2, 3]
    assert page.headers["link"] == '</api/training/history?limit=2&offset=3>; rel="next"'
    assert harness.client.get("/api/training/history?limit=1001").status_code == 422


def test_openapi_documents_paging_and_validators(harness: Harness) -> None:
    paths = harness.client.get("/openapi.json").json()["paths"]
    for path in ("/api/nodes", "/api/training/history"):
        get = paths[path]["get"]
        assert {p["name"] for p in get["parameters"]} >= {"limit", "offset"}
        assert {"X-Total-Count", "Link", "ETag"} <= set(get["responses"]["200"]["headers"])
        assert "304" in get["responses"]
    assert paths["/api/training/verify"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]


def test_default_service_renders_in_the_background(database_url: str) -> None:
    """The service's own settings: a stale read never waits for the database."""
    clock = ManualClock()
    config = test_config(database_url, clock, reads=ReadCacheConfig())
    with TestClient(create_app(config)) as client:
        h = Harness(client, clock, config)
        h.register(WALLETS[0])
        before = client.get("/api/nodes").json()
        h.register(WALLETS[1])
        clock.advance(config.reads.max_age_s + 1)
        assert client.get("/api/nodes").json() == before, "the stale page is answered at once"
        deadline = time.monotonic() + 10
        while len(client.get("/api/nodes").json()) != 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(client.get("/api/nodes").json()) == 2
