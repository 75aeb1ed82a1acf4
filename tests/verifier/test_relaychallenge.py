"""Challenges through a stage bucket, both sides against a real S3 endpoint (moto) on loopback: the
verifier's RelayChallenges asks and reads, a relay replica's RelayControl.serve_challenges answers
what its server would, and refuses what its server would refuse."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest

from neuroshard.node.p2p.bucket import BucketStore, RelayConfig, make_s3_client
from neuroshard.node.p2p.relay import RelayControl, challenge_key
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.refusal import Refused
from neuroshard.verifier.background import BodyTooLarge
from neuroshard.verifier.relaychallenge import NotAnswered, RelayChallenges

pytestmark = pytest.mark.usefixtures("aws_env")

OPERATOR = Wallet.from_token("relay-challenge-operator")
HOLDER = Wallet.from_token("relay-challenge-holder").public_key_hex
LOG = "/p2p/segment-log/3"


class Service:
    """An answerer like node.p2p.replay.SegmentService: round 3's log, to the operator only."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def answer(self, path: str, peer_wallet: str) -> bytes | None:
        if not path.startswith("/p2p/segment-log/"):
            return None
        self.asked.append(path)
        if peer_wallet != OPERATOR.public_key_hex:
            raise Refused("not_verifier", "served to the verifier's operator key only")
        if path != LOG:
            raise Refused("not_held", f"{path} is not held here")
        return b"the signed log of round 3"


@pytest.fixture
def config(endpoint: str) -> RelayConfig:
    config = RelayConfig(
        url=f"s3://ns-{uuid.uuid4().hex[:12]}/run1", endpoint_url=endpoint, request_timeout_s=2.0
    )
    make_s3_client(config).create_bucket(Bucket=config.bucket)
    return config


@pytest.fixture
def holder(config: RelayConfig) -> Iterator[tuple[RelayControl, list[str]]]:
    lines: list[str] = []
    store = BucketStore(config, HOLDER, log=lines.append)
    yield RelayControl(store, 0, lines.append), lines
    store.close()


def keys(config: RelayConfig) -> set[str]:
    listing = make_s3_client(config).list_objects_v2(Bucket=config.bucket)
    return {str(o["Key"]).removeprefix("run1/") for o in listing.get("Contents", [])}


def serve(control: RelayControl, service: Service, now: float | None = None) -> None:
    asyncio.run(control.serve_challenges([service], time.time() if now is None else now))


def test_a_challenge_is_asked_answered_read_and_cleaned_up(
    config: RelayConfig, holder: tuple[RelayControl, list[str]]
) -> None:
    control, lines = holder
    service = Service()
    asker = RelayChallenges(config, OPERATOR, time.time, lines.append)
    with pytest.raises(NotAnswered):
        asker.get(HOLDER, LOG, 1 << 10)
    assert keys(config) == {challenge_key(HOLDER, "segment-log/3")}
    serve(control, service)
    assert service.asked == [LOG] and f"{HOLDER}/check/segment-log/3" in keys(config)
    assert asker.get(HOLDER, LOG, 1 << 10) == b"the signed log of round 3"
    assert keys(config) == {f"{HOLDER}/check/segment-log/3"}  # the challenge is released once read
    serve(control, service)
    assert keys(config) == set() and service.asked == [LOG]  # the holder deletes its answer in turn


def test_the_holder_refuses_what_its_server_would_refuse_and_uploads_nothing(
    config: RelayConfig, holder: tuple[RelayControl, list[str]]
) -> None:
    control, lines = holder
    service = Service()
    stranger = RelayChallenges(config, Wallet.from_token("not-the-operator"), time.time, lines.append)
    with pytest.raises(NotAnswered):
        stranger.get(HOLDER, LOG, 1 << 10)
    stale = RelayChallenges(config, OPERATOR, lambda: time.time() - 120, lines.append)
    with pytest.raises(NotAnswered):
        stale.get(HOLDER, "/p2p/segment-log/4", 1 << 10)
    asker = RelayChallenges(config, OPERATOR, time.time, lines.append)
    for path in ("/p2p/segment-log/5", "/p2p/replay/3"):  # not held; a route the holder does not serve
        with pytest.raises(NotAnswered):
            asker.get(HOLDER, path, 1 << 10)
    client = make_s3_client(config)
    client.put_object(
        Bucket=config.bucket, Key=f"run1/{challenge_key(HOLDER, 'segment/3/0')}", Body=b"{not json"
    )
    for _ in range(3):  # 4 a pass; later passes read none of them again (RETRY_REFUSED_S)
        serve(control, service)
    refusals = sorted(line.split(": ")[2] for line in lines if "not answered" in line)
    assert refusals == ["malformed", "not_held", "not_verifier", "stale", "unknown_route"], lines
    assert not any("/check/" in k and not k.startswith("_want/") for k in keys(config))
    assert service.asked == [LOG, "/p2p/segment-log/5"]  # the stale one never reached the service


def test_an_answer_larger_than_the_verifier_takes_is_refused_and_released(
    config: RelayConfig, holder: tuple[RelayControl, list[str]]
) -> None:
    control, lines = holder
    asker = RelayChallenges(config, OPERATOR, time.time, lines.append)
    with pytest.raises(NotAnswered):
        asker.get(HOLDER, LOG, 10)
    serve(control, Service())
    with pytest.raises(BodyTooLarge):
        asker.get(HOLDER, LOG, 10)
    assert keys(config) == {f"{HOLDER}/check/segment-log/3"}
    serve(control, Service())
    assert keys(config) == set()
