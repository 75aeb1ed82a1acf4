"""A real browser (headless Chromium) loads the dashboard from a running verifier: the rendered
numbers and charts match the API. The screenshot stays in the test's tmp_path."""

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from neuroshard.api.testing import free_port, start_verifier_process
from neuroshard.node.wallet import Wallet
from neuroshard.verifier import ledger
from neuroshard.verifier.auth import SignedBy, new_nonce
from neuroshard.verifier.db import Database
from neuroshard.verifier.reputation import ReputationConfig
from neuroshard.verifier.wire import DataSpan, HeartbeatRequest, ReceiptRequest, RegisterRequest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="needs a chromium binary (Debian: apt-get install chromium)"),
]
ROUNDS = 6
MEASURED = {0: 8.0, 2: 6.5, 4: 5.25}


def seed(url: str) -> None:
    """3 honest replicas agreeing for 6 rounds, an attacker refused after two, 3 falling evaluations."""
    db = Database(url)
    db.upgrade()
    cfg = ledger.LedgerConfig(reputation=ReputationConfig(), num_stages=1, nonce_window_s=60)
    now = time.time()
    honest = [Wallet.from_token(f"browser-{i}") for i in range(3)]
    attacker = Wallet.from_token("browser-attacker")

    def who(w: Wallet) -> SignedBy:
        return SignedBy(public_key_hex=w.public_key_hex, timestamp=now, nonce=new_nonce())

    with db.write() as s:
        for w in [*honest, attacker]:
            req = RegisterRequest(address="http://127.0.0.1:9000", stage=0, software_version="0.1.0")
            ledger.register(s, who(w), req, now=now, cfg=cfg)
    for r in range(ROUNDS):
        with db.write() as s:
            for w in honest + ([attacker] if r < 2 else []):
                result = f"{r:064x}" if w in honest else f"f{r:063x}"
                req = ReceiptRequest(
                    stage=0,
                    round=r,
                    inner_steps=4,
                    start_step=4 * r,
                    tokens=1024,
                    data=[DataSpan(shard_id=r % 3, offset_start=0, offset_end=8)],
                    losses=[7.0 - 0.5 * r] * 4,
                    base_hash=f"{r - 1:064x}" if r else "0" * 64,
                    result_hash=result,
                    delta_digest="d" * 64,
                    rejected=[{"wallet": attacker.wallet_id, "reason": "norm 40x the median"}]
                    if w in honest and r < 2
                    else [],
                )
                ledger.submit_receipt(s, who(w), req, body_sha256=f"{r}-{w.wallet_id}", now=now, cfg=cfg)
            if r in MEASURED:
                ledger.record_evaluation(s, r, MEASURED[r], 4096, stderr=0.01, now=now)
        with db.write() as s:
            ledger.settle_rounds(s, 0, now=now, cfg=cfg)
    with db.write() as s:
        for w in honest:
            ledger.heartbeat(
                s, who(w), HeartbeatRequest(stage=0, round=ROUNDS, steps_in_round=2), now=now, cfg=cfg
            )
    db.dispose()


def chromium(*args: str) -> str:
    assert CHROMIUM is not None
    argv = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--virtual-time-budget=5000",
        *args,
    ]
    return subprocess.run(argv, capture_output=True, timeout=120, check=True).stdout.decode("utf-8")


def text_of(dom: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
    assert match, f"#{element_id} not in the rendered page"
    return match.group(1)


def test_dashboard_renders_the_run(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'verifier.sqlite3'}"
    seed(url)
    port = free_port()
    process = start_verifier_process(tmp_path, url, port)
    page = f"http://127.0.0.1:{port}/"
    try:
        dom = chromium("--dump-dom", page)
        chromium("--window-size=1300,1500", f"--screenshot={tmp_path / 'dashboard.png'}", page)
    finally:
        process.terminate()
        process.wait(timeout=10)
    print(f"screenshot: {tmp_path / 'dashboard.png'}")
    assert 'data-loaded="true"' in dom, "the page's script did not finish a refresh"
    assert text_of(dom, "verdict-label") == "Training verified"
    assert "fell 2.7500 nats" in text_of(dom, "verdict-reason")
    assert text_of(dom, "nodes-training") == "3"
    assert text_of(dom, "nodes-detail") == "4 registered · 1 refused"
    assert text_of(dom, "loss-measured") == "5.250"
    assert text_of(dom, "loss-reported") == f"{7.0 - 0.5 * (ROUNDS - 1):.3f}"
    assert text_of(dom, "total-steps") == f"{4 * (3 * ROUNDS + 2)}"
    assert text_of(dom, "outer-rounds") == str(ROUNDS)
    # settled rounds 0-4 (round 5 waits for the next): 3 of 4 agree twice, 3 of 3 three times
    assert text_of(dom, "agreement") == f"{100 * 15 / 17:.1f}%"
    # charts: 3 measured + 6 reported points, agreement for all 6 rounds
    assert re.search(r'id="loss-chart"[^>]*data-points="9"', dom)
    assert re.search(r'id="agreement-chart"[^>]*data-points="6"', dom)
    rows = re.findall(r'<tr data-wallet="([0-9a-f]{20})">', dom)
    assert len(rows) == 4
    assert text_of(dom, "nodes-page") == "1–4 of 4", "the node table is a page of /api/nodes"
    assert dom.count('class="status-refused"') == 1
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
