"""A real browser (headless Chromium) shows the verifier's latest text sample beside the loss
chart, as text: markup in what the model wrote is shown, never run (issue 14). Follows
test_dashboard_browser.py; the screenshot stays in the test's tmp_path."""

import html
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from neuroshard.testing.api import start_verifier_process
from neuroshard.testing.ports import free_port
from neuroshard.verifier import ledger
from neuroshard.verifier import models as m
from neuroshard.verifier.db import Database

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="needs a chromium binary (Debian: apt-get install chromium)"),
]
HOSTILE = (
    "</p><script>document.title='pwned'</script><img src=x onerror=\"document.title='pwned'\"> & <b>bold</b>"
)


def seed(url: str, samples: dict[int, str]) -> None:
    db = Database(url)
    db.upgrade()
    now = time.time()
    with db.write() as s:
        for r, loss in ((0, 8.0), (2, 6.5), (4, 5.25)):
            ledger.record_evaluation(s, r, loss, 4096, stderr=0.01, now=now)
        for r, text in samples.items():
            s.add(m.TextSample(round=r, prompt="The ", text=text, max_new_tokens=40, temperature=0.8, seed=0,
                               created_at=now - 30))  # fmt: skip
    db.dispose()


def dump(tmp_path: Path, url: str, *, screenshot: bool = False) -> str:
    assert CHROMIUM is not None
    port = free_port()
    # The evaluator runs (it finds no rounds to measure); --sample-every reaches the page.
    process = start_verifier_process(tmp_path, url, port, extra_args=["--sample-every", "3"])
    page = f"http://127.0.0.1:{port}/"
    base = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--virtual-time-budget=5000",
    ]
    try:
        dom = subprocess.run([*base, "--dump-dom", page], capture_output=True, timeout=120, check=True).stdout
        if screenshot:
            shot = [*base, "--window-size=1300,1100", f"--screenshot={tmp_path / 'sample.png'}", page]
            subprocess.run(shot, capture_output=True, timeout=120, check=True)
    finally:
        process.terminate()
        process.wait(timeout=10)
    return dom.decode("utf-8")


def text_of(dom: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
    assert match, f"#{element_id} not in the rendered page"
    return match.group(1)


def test_the_latest_sample_is_shown_escaped_beside_the_loss_chart(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'verifier.sqlite3'}"
    seed(url, {1: "an older sample", 4: HOSTILE})
    dom = dump(tmp_path, url, screenshot=True)
    print(f"screenshot: {tmp_path / 'sample.png'}")
    assert 'data-loaded="true"' in dom
    # In the loss chart's panel, after the chart.
    assert (
        dom.index('id="loss-chart"') < dom.index('data-testid="sample"') < dom.index('id="agreement-chart"')
    )
    assert text_of(dom, "sample-round") == "(round 4)"
    assert text_of(dom, "sample-prompt") == "The "
    assert html.unescape(text_of(dom, "sample-text")) == HOSTILE
    # Shown as characters, never parsed: no element came out of the model's text, nothing ran.
    assert dom.count("<script") == 1, "only the page's own script element"
    assert "<img" not in dom and "<b>" not in dom
    assert "pwned" not in re.search(r"<title>([^<]*)</title>", dom).group(1)  # type: ignore[union-attr]
    note = text_of(dom, "sample-note")
    assert "40 tokens at most, temperature 0.8, seed 0" in note and "every 3 evaluations" in note
    assert (tmp_path / "sample.png").stat().st_size > 10_000


def test_before_the_first_sample_the_page_says_when_one_comes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'verifier.sqlite3'}"
    seed(url, {})
    dom = dump(tmp_path, url)
    assert 'data-loaded="true"' in dom
    assert text_of(dom, "sample-text") == "no sample yet"
    assert (
        text_of(dom, "sample-note")
        == "the verifier writes one after its first evaluation, then every 3 evaluations"
    )
