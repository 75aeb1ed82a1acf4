"""Challenges through a stage bucket, both sides against a real S3 endpoint (moto) on loopback: the
verifier's RelayChallenges asks and reads, a relay replica's RelayControl.serve_challenges answers
what its server would, and refuses what its server would refuse (and a challenge meant for another
replica, or one written again unchanged)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from neuroshard.node.p2p.bucket import BucketStore, RelayConfig, make_s3_client
from neuroshard.node.p2p.relay import Answerer, RelayControl, challenge_key, challenge_name
from neuroshard.node.p2p.replay import ReplayService, SegmentService, decode_replay, encode_replay
from neuroshard.node.replay import InnerState, ReplayArchive, ReplayRecord
from neuroshard.node.segment_store import SegmentStore
from neuroshard.node.segments import SegmentConfig
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.refusal import Refused
from neuroshard.verifier.background import BodyTooLarge
from neuroshard.verifier.relaychallenge import Looked, NotAnswered, RelayChallenges

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


def serve(control: RelayControl, service: Answerer) -> None:
    asyncio.run(control.serve_challenges([service], time.time))


def put(config: RelayConfig, key: str, body: bytes) -> None:
    make_s3_client(config).put_object(Bucket=config.bucket, Key=f"run1/{key}", Body=body)


def read(config: RelayConfig, key: str) -> bytes:
    got = make_s3_client(config).get_object(Bucket=config.bucket, Key=f"run1/{key}")
    return bytes(got["Body"].read())


def test_a_challenge_is_asked_answered_read_and_cleaned_up(
    config: RelayConfig, holder: tuple[RelayControl, list[str]]
) -> None:
    control, lines = holder
    service = Service()
    asker = RelayChallenges(config, OPERATOR, time.time, lines.append)
    with pytest.raises(NotAnswered):
        asker.get(HOLDER, LOG, 1 << 10)
    assert keys(config) == {f"_check/{HOLDER}/segment-log/3"} == {challenge_key(HOLDER, "segment-log/3")}
    serve(control, service)
    assert service.asked == [LOG] and f"{HOLDER}/check/segment-log/3" in keys(config)
    assert asker.get(HOLDER, LOG, 1 << 10) == b"the signed log of round 3"
    assert keys(config) == {f"{HOLDER}/check/segment-log/3"}  # the challenge is released once read
    serve(control, service)
    assert keys(config) == set() and service.asked == [LOG]  # the holder deletes its answer in turn


def test_look_finds_answers_without_reading_them_and_asks_again_for_the_rest(
    config: RelayConfig, holder: tuple[RelayControl, list[str]]
) -> None:
    """What a check looks at before it downloads (verifier.replaycheck._poll): one HEAD a path says
    which answers are there and when the oldest was written; nothing is read or released, only
    the absent ones are asked again, and an answer archived where GetObject cannot read it counts
    as absent."""
    control, lines = holder
    service = Service()
    asker = RelayChallenges(config, OPERATOR, time.time, lines.append)
    wanted = [LOG, "/p2p/segment-log/4"]  # the holder has round 3's log, not round 4's
    assert asker.look(HOLDER, wanted).missing == wanted
    assert keys(config) == {challenge_key(HOLDER, "segment-log/3"), challenge_key(HOLDER, "segment-log/4")}
    serve(control, service)
    first = read(config, challenge_key(HOLDER, "segment-log/4"))
    looked = asker.look(HOLDER, wanted)
    assert looked.missing == ["/p2p/segment-log/4"]
    assert looked.oldest is not None and abs(looked.oldest - time.time()) < 60
    assert read(config, challenge_key(HOLDER, "segment-log/4")) != first  # asked again, signed afresh
    assert f"{HOLDER}/check/segment-log/3" in keys(config)
    assert challenge_key(HOLDER, "segment-log/3") in keys(config)  # not read, so not released
    assert asker.look(HOLDER, [LOG]).missing == [] and asker.look(HOLDER, []) == Looked([], None)
    assert asker.get(HOLDER, LOG, 1 << 10) == b"the signed log of round 3"

    make_s3_client(config).put_object(  # what an honest holder never does
        Bucket=config.bucket, Key=f"run1/{HOLDER}/check/segment-log/5", Body=b"x", StorageClass="GLACIER"
    )
    assert asker.look(HOLDER, ["/p2p/segment-log/5"]).missing == ["/p2p/segment-log/5"]
    with pytest.raises(NotAnswered, match="cannot be read"):
        asker.get(HOLDER, "/p2p/segment-log/5", 1 << 10)


def test_a_restarted_holder_deletes_the_answers_its_last_run_left_once_read(
    config: RelayConfig, holder: tuple[RelayControl, list[str]]
) -> None:
    """Which answers are waiting to be read dies with the process: the next run's first pass keeps
    (and does not upload again) an answer whose challenge still waits and deletes the others."""
    control, lines = holder
    service = Service()
    asker = RelayChallenges(config, OPERATOR, time.time, lines.append)
    put(config, f"{HOLDER}/check/segment-log/9", b"left by a run before")  # its challenge is gone
    for path in (LOG, "/p2p/segment-log/4"):
        with pytest.raises(NotAnswered):
            asker.get(HOLDER, path, 1 << 10)
    put(config, f"{HOLDER}/check/segment-log/4", b"answered by the run before")
    restarted = RelayControl(control.store, 0, lines.append)
    serve(restarted, service)
    assert service.asked == [LOG]  # round 4's answer is there: not asked, not uploaded again
    assert {k for k in keys(config) if k.startswith(f"{HOLDER}/")} == {
        f"{HOLDER}/check/segment-log/3",
        f"{HOLDER}/check/segment-log/4",
    }
    assert asker.get(HOLDER, "/p2p/segment-log/4", 1 << 10) == b"answered by the run before"
    serve(restarted, service)
    assert f"{HOLDER}/check/segment-log/4" not in keys(config)  # read and released: deleted in turn


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
    put(config, challenge_key(HOLDER, "segment/3/0"), b"{not json")
    put(config, f"_check/{HOLDER}/segment/x", b"{}")  # not a route: never even read
    # A challenge to another replica, copied over: its signature names that replica, not this one.
    other = Wallet.from_token("relay-challenge-other").public_key_hex
    with pytest.raises(NotAnswered):
        asker.get(other, "/p2p/segment/3/1", 1 << 10)
    put(config, challenge_key(HOLDER, "segment/3/1"), read(config, challenge_key(other, "segment/3/1")))
    for _ in range(3):  # 4 a pass; later passes read none of them again (RETRY_REFUSED_S)
        serve(control, service)
    refusals = sorted(line.split(": ")[2] for line in lines if "not answered" in line)
    expected = ["bad_signature", "malformed", "not_held", "not_verifier", "stale", "unknown_route"]
    assert refusals == expected, lines
    assert not any(k.startswith(f"{HOLDER}/") for k in keys(config))  # no answer uploaded
    assert service.asked == [LOG, "/p2p/segment-log/5"]  # the stale and copied ones never reached it


def test_a_challenge_written_again_unchanged_is_a_replay(
    config: RelayConfig, holder: tuple[RelayControl, list[str]]
) -> None:
    """Its nonce was seen: a copy put back after the answer was read and released is refused, so it
    cannot make the holder upload again."""
    control, lines = holder
    service = Service()
    asker = RelayChallenges(config, OPERATOR, time.time, lines.append)
    with pytest.raises(NotAnswered):
        asker.get(HOLDER, LOG, 1 << 10)
    signed = read(config, challenge_key(HOLDER, "segment-log/3"))
    serve(control, service)
    assert asker.get(HOLDER, LOG, 1 << 10) == b"the signed log of round 3"
    serve(control, service)  # released: the holder deletes its answer and forgets the challenge
    put(config, challenge_key(HOLDER, "segment-log/3"), signed)
    serve(control, service)
    assert service.asked == [LOG] and any("not answered: replayed" in line for line in lines), lines
    assert keys(config) == {challenge_key(HOLDER, "segment-log/3")}


def test_whole_round_replay_material_is_served_through_the_bucket(
    config: RelayConfig, holder: tuple[RelayControl, list[str]]
) -> None:
    """The real ReplayService answers a challenge of GET /p2p/replay/{round} through the bucket with
    the bytes its route serves, and refuses a round it does not hold."""
    control, lines = holder
    archive = ReplayArchive()
    theta = torch.arange(6, dtype=torch.float32)
    inner = InnerState(theta.clone(), theta.clone(), torch.ones(2))
    record = ReplayRecord(round=2, theta_round=theta, inner=inner, delta=theta.clone())
    archive.add(record)
    service = ReplayService(archive, allowed_wallet=OPERATOR.public_key_hex)
    asker = RelayChallenges(config, OPERATOR, time.time, lines.append)
    for path in ("/p2p/replay/2", "/p2p/replay/7"):
        with pytest.raises(NotAnswered):
            asker.get(HOLDER, path, 1 << 20)
    serve(control, service)
    body = asker.get(HOLDER, "/p2p/replay/2", 1 << 20)
    assert body == encode_replay(record) and decode_replay(body, 2, 6, 2).theta_round.equal(theta)
    with pytest.raises(NotAnswered):
        asker.get(HOLDER, "/p2p/replay/7", 1 << 20)
    assert any("challenge replay/7 not answered: not_held" in line for line in lines), lines


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


def test_a_restarted_verifier_clears_what_its_last_run_asked(
    config: RelayConfig, holder: tuple[RelayControl, list[str]]
) -> None:
    control, lines = holder
    asker = RelayChallenges(config, OPERATOR, time.time, lines.append)
    for path in (LOG, "/p2p/segment/3/0"):
        with pytest.raises(NotAnswered):
            asker.get(HOLDER, path, 1 << 10)
    serve(control, Service())
    assert f"{HOLDER}/check/segment-log/3" in keys(config)
    assert RelayChallenges(config, OPERATOR, time.time, lines.append).clear() == 2
    serve(control, Service())
    assert keys(config) == set()


@pytest.mark.asyncio
async def test_the_segment_routes_answer_by_path_as_they_serve(tmp_path: Path) -> None:
    """SegmentService.answer matches the routes a challenge may name, and refuses like the route."""
    service = SegmentService(
        SegmentStore(tmp_path, SegmentConfig(segment_steps=2), log=lambda _: None),
        allowed_wallet=OPERATOR.public_key_hex,
    )
    for path in ("/p2p/segment-log/3", "/p2p/segment/3/1"):
        with pytest.raises(Refused, match="held here"):
            await service.answer(path, OPERATOR.public_key_hex)
        with pytest.raises(Refused, match="operator key only"):
            await service.answer(path, HOLDER)
    assert await service.answer("/p2p/replay/3", OPERATOR.public_key_hex) is None
    with pytest.raises(ValueError, match="not a route"):
        challenge_name("/p2p/segment/3/1/x")
