"""GET /api/training/sample: the latest text sample of the measured majority model, cached
with an ETag like the other reads, its text returned exactly as stored (SQLite and PostgreSQL)."""

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from neuroshard.api.app import create_app
from neuroshard.testing.api import Harness, test_config
from neuroshard.testing.verifier import ManualClock
from neuroshard.verifier import models as m
from neuroshard.verifier.evaluator import EvaluatorConfig

HOSTILE = "</pre><script>alert('x')</script> & <b>bold</b>\n  \"quoted\" ünïcode"


def store(h: Harness, round_: int, text: str) -> None:
    with h.services.db.write() as session:
        session.add(m.TextSample(round=round_, prompt="The ", text=text, max_new_tokens=40, temperature=0.8,
                                 seed=0, created_at=h.clock()))  # fmt: skip


def test_no_sample_until_the_evaluator_writes_one(harness: Harness) -> None:
    reply = harness.client.get("/api/training/sample")
    assert reply.status_code == 200
    # This harness runs no live evaluation: nothing will ever write one.
    assert reply.json() == {"sample": None, "every_evaluations": None}


def test_the_latest_sample_is_served_as_stored_with_an_etag(harness: Harness) -> None:
    store(harness, 1, "an early sample")
    first = harness.client.get("/api/training/sample")
    assert first.json()["sample"]["round"] == 1
    etag = first.headers["etag"]
    assert first.headers["cache-control"].startswith("public, max-age=")
    assert harness.client.get("/api/training/sample", headers={"If-None-Match": etag}).status_code == 304
    store(harness, 6, HOSTILE)
    store(harness, 3, "an older round written late")
    reply = harness.client.get("/api/training/sample", headers={"If-None-Match": etag})
    assert reply.status_code == 200 and reply.headers["etag"] != etag
    sample = reply.json()["sample"]
    assert sample["round"] == 6
    assert sample["text"] == HOSTILE  # JSON carries the text; escaping is the page's job
    assert (sample["prompt"], sample["max_new_tokens"], sample["temperature"], sample["seed"]) == (
        "The ",
        40,
        0.8,
        0,
    )
    head = harness.client.head("/api/training/sample")
    assert head.status_code == 200 and head.content == b"" and head.headers["etag"] == reply.headers["etag"]


@pytest.fixture
def sampling_harness(database_url: str) -> Iterator[Harness]:
    """A verifier whose evaluator writes a sample every 3 evaluations (polling too rarely to run here)."""
    clock = ManualClock()
    config = test_config(database_url, clock, live_evaluation=EvaluatorConfig(poll_s=3600, sample_every=3))
    with TestClient(create_app(config)) as client:
        yield Harness(client, clock, config)


def test_the_reply_says_how_often_samples_come(sampling_harness: Harness) -> None:
    assert sampling_harness.client.get("/api/training/sample").json() == {
        "sample": None,
        "every_evaluations": 3,
    }


def test_openapi_documents_the_sample(harness: Harness) -> None:
    spec = harness.client.get("/openapi.json").json()
    assert "/api/training/sample" in spec["paths"]
    assert "text" in spec["components"]["schemas"]["TextSampleOut"]["properties"]
