"""The S3 carrier of the outer round's port against a real S3 HTTP endpoint (moto in server mode) on loopback.

The moto server and the dummy-credential environment mirror tests/data/conftest.py, whose fixtures
are not visible from this directory.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Iterator

import pytest

from neuroshard.node.outer.port import object_name
from neuroshard.node.p2p.bucket import (
    BucketStore,
    RelayConfig,
    RelayError,
    bucket_lifecycle_rule,
    make_s3_client,
    parse_url,
    replica_policy,
)

A, B = (hashlib.sha256(seed).hexdigest() for seed in (b"wallet-a", b"wallet-b"))
MB = 1 << 20


pytestmark = pytest.mark.usefixtures("aws_env")


@pytest.fixture
def config(endpoint: str) -> RelayConfig:
    """A fresh bucket on the moto server, with short polls."""
    config = RelayConfig(
        url=f"s3://ns-{uuid.uuid4().hex[:12]}/runs/stage-net",
        endpoint_url=endpoint,
        poll_interval_s=0.05,
        max_poll_s=0.2,
        request_timeout_s=2.0,
        max_workers=4,
    )
    make_s3_client(config).create_bucket(Bucket=config.bucket)
    return config


@pytest.fixture
def stores(config: RelayConfig) -> Iterator[tuple[BucketStore, BucketStore]]:
    client = make_s3_client(config)  # thread-safe; one per test saves loading botocore's models thrice
    a, b = BucketStore(config, A, client=client), BucketStore(config, B, client=client)
    yield a, b
    a.close()
    b.close()


def keys(config: RelayConfig) -> set[str]:
    listing = make_s3_client(config).list_objects_v2(Bucket=config.bucket)
    return {o["Key"] for o in listing.get("Contents", [])}


def test_relay_url_is_parsed_and_checked() -> None:
    assert parse_url("s3://my-bucket/a/b/") == ("my-bucket", "a/b")
    assert parse_url("s3://my-bucket") == ("my-bucket", "")
    for bad in ("http://b/p", "s3://", "s3://B_ad/p", "s3://ok-bucket/a//b", "s3://ok-bucket/a/../b"):
        with pytest.raises(ValueError, match="relay URL"):
            RelayConfig(url=bad)
    with pytest.raises(ValueError, match="poll_interval_s"):
        RelayConfig(url="s3://ok-bucket/p", poll_interval_s=2.0, max_poll_s=1.0)


@pytest.mark.asyncio
async def test_publish_then_fetch_between_wallets(stores: tuple[BucketStore, BucketStore]) -> None:
    a, b = stores
    name = object_name(0, 7, "delta")
    data = bytes(range(256)) * 40
    await a.publish(name, data)
    assert f"runs/stage-net/{A}/0/7/delta" in keys(a.config)
    assert await b.fetch(A, name, max_bytes=len(data)) == data
    assert await b.fetch(A, name, max_bytes=MB, span=(1000, 1300)) == data[1000:1300]
    assert await b.fetch(A, name, max_bytes=MB, span=(5, 5)) == b""
    assert await b.fetch(A, name, max_bytes=MB, span=(len(data) - 10, len(data) + 10)) is None  # short
    assert await b.fetch(A, name, max_bytes=MB, span=(len(data) + 1, len(data) + 9)) is None  # 416
    assert await b.fetch(B, name, max_bytes=MB) is None  # b never published it


@pytest.mark.asyncio
async def test_an_object_over_multipart_bytes_goes_up_in_parts_and_reads_back_whole(
    config: RelayConfig,
) -> None:
    """A relay's answer to a segment challenge holds 28 bytes a parameter: past one PUT's 5 GB at
    ~180M parameters. Above `multipart_bytes` a publish uploads in parts."""
    config.multipart_bytes = 5 * MB
    a, b = BucketStore(config, A), BucketStore(config, B)
    try:
        data = bytes(range(256)) * (11 * MB // 256 + 3)  # three parts, the last one short
        await a.publish("check/segment/3/1", data)
        assert await b.fetch(A, "check/segment/3/1", max_bytes=len(data)) == data
        head = make_s3_client(config).head_object(Bucket=config.bucket, Key=a.key(A, "check/segment/3/1"))
        assert head["ETag"].strip('"').endswith("-3")  # S3's multipart ETag: the number of parts
        assert a.traffic.bytes_sent == len(data)
        await a.delete("check/segment/3/1")
        assert await b.fetch(A, "check/segment/3/1", max_bytes=len(data)) is None
    finally:
        a.close()
        b.close()
    with pytest.raises(ValueError, match="5 MiB"):
        RelayConfig(url="s3://ok-bucket/p", multipart_bytes=MB)


@pytest.mark.asyncio
async def test_traffic_counts_requests_and_bodies(stores: tuple[BucketStore, BucketStore]) -> None:
    a, b = stores
    await a.publish("0/1/commit", b"x" * 100)
    await b.fetch(A, "0/1/commit", max_bytes=MB, span=(10, 30))
    await b.fetch(A, "0/1/commit", max_bytes=MB, span=(3, 3))  # no request
    await b.fetch(A, "0/1/absent", max_bytes=MB)
    assert (a.traffic.requests, a.traffic.bytes_sent, a.traffic.bytes_received) == (1, 100, 0)
    assert (b.traffic.requests, b.traffic.bytes_sent, b.traffic.bytes_received) == (2, 0, 20)


@pytest.mark.asyncio
async def test_fetch_refuses_objects_over_max_bytes(stores: tuple[BucketStore, BucketStore]) -> None:
    a, b = stores
    await a.publish("0/1/delta", b"y" * 5000)
    assert await b.fetch(A, "0/1/delta", max_bytes=4999) is None
    assert await b.fetch(A, "0/1/delta", max_bytes=100, span=(0, 101)) is None
    assert b.traffic.bytes_received == 0  # refused from ContentLength (or the span) before any body
    assert await b.fetch(A, "0/1/delta", max_bytes=5000) == b"y" * 5000


@pytest.mark.asyncio
async def test_fetch_waits_for_an_object_published_during_the_wait(
    stores: tuple[BucketStore, BucketStore],
) -> None:
    a, b = stores

    async def publish_later() -> None:
        await asyncio.sleep(0.3)
        await a.publish("0/2/part/1", b"late")

    started = time.monotonic()
    fetched, _ = await asyncio.gather(b.fetch(A, "0/2/part/1", max_bytes=MB, wait_s=5.0), publish_later())
    assert fetched == b"late"
    assert 0.3 <= time.monotonic() - started < 1.5  # polls at most max_poll_s apart
    assert b.traffic.requests >= 3  # it polled while absent

    started = time.monotonic()
    assert await b.fetch(A, "0/2/never", max_bytes=MB, wait_s=0.4) is None
    assert 0.4 <= time.monotonic() - started < 1.5


@pytest.mark.asyncio
async def test_retire_deletes_only_own_old_rounds(stores: tuple[BucketStore, BucketStore]) -> None:
    a, b = stores
    for store in stores:
        for stage, round_ in ((0, 1), (0, 2), (0, 3), (0, 12), (1, 1)):
            await store.publish(object_name(stage, round_, "commit"), b"c")
            await store.publish(object_name(stage, round_, "part", 0), b"p")
    await a.retire(0, 3)
    root = "runs/stage-net"
    left = {k.removeprefix(f"{root}/{A}/") for k in keys(a.config) if k.startswith(f"{root}/{A}/")}
    assert left == {"0/3/commit", "0/3/part/0", "0/12/commit", "0/12/part/0", "1/1/commit", "1/1/part/0"}
    assert sum(k.startswith(f"{root}/{B}/") for k in keys(a.config)) == 10  # b's objects untouched
    assert await b.fetch(A, "0/2/commit", max_bytes=MB) is None


@pytest.mark.asyncio
async def test_invalid_names_and_wallets_are_refused(stores: tuple[BucketStore, BucketStore]) -> None:
    a, _ = stores
    for bad in ("../x", "0/1/Delta", "a" * 200, "", "0//1"):
        with pytest.raises(ValueError, match="object name"):
            await a.publish(bad, b"x")
    with pytest.raises(ValueError, match="wallet"):
        await a.fetch("not-a-wallet", "0/1/commit", max_bytes=MB)
    with pytest.raises(ValueError, match="wallet"):
        BucketStore(a.config, A.upper())
    assert a.traffic.requests == 0


@pytest.mark.asyncio
async def test_unreachable_endpoint_returns_none_and_publish_raises_relay_error() -> None:
    config = RelayConfig(url="s3://ns-down/p", endpoint_url="http://127.0.0.1:1", request_timeout_s=0.5)
    store = BucketStore(config, A)
    try:
        started = time.monotonic()
        assert await store.fetch(B, "0/1/commit", max_bytes=MB) is None
        assert time.monotonic() - started < 4.0  # botocore's 3 attempts, no wait asked
        started = time.monotonic()  # asked to wait, a fetch polls through a down endpoint, no longer
        assert await store.fetch(B, "0/1/commit", max_bytes=MB, wait_s=1.0) is None
        assert 1.0 <= time.monotonic() - started < 6.0
        with pytest.raises(RelayError, match="cannot publish s3://ns-down/p/"):
            await store.publish("0/1/commit", b"x")
    finally:
        store.close()


def test_lifecycle_rule_is_accepted_by_the_bucket(config: RelayConfig) -> None:
    rule = bucket_lifecycle_rule(config.prefix, days=3)
    client = make_s3_client(config)
    client.put_bucket_lifecycle_configuration(Bucket=config.bucket, LifecycleConfiguration=rule)
    (installed,) = client.get_bucket_lifecycle_configuration(Bucket=config.bucket)["Rules"]
    assert installed["Expiration"] == {"Days": 3}
    assert installed["Filter"] == {"Prefix": "runs/stage-net/"}
    with pytest.raises(ValueError, match="days"):
        bucket_lifecycle_rule("p", days=0)


def test_a_replica_s_policy_lets_it_write_its_own_names_and_read_the_stage_and_no_more() -> None:
    import json

    from neuroshard.node.wallet import Wallet

    wallet = Wallet.from_token("policy").public_key_hex
    policy = replica_policy("stage", "/run1/", wallet)
    json.dumps(policy)  # what an operator pastes into IAM
    allowed = {(a, r) for st in policy["Statement"] for a in st["Action"] for r in st["Resource"]}
    root = "arn:aws:s3:::stage/run1/"
    assert ("s3:PutObject", f"{root}{wallet}/*") in allowed
    assert ("s3:PutObject", f"{root}_pipe/*/{wallet}/*") in allowed
    assert ("s3:DeleteObject", f"{root}_pipe/{wallet}/*") in allowed
    assert ("s3:GetObject", f"{root}*") in allowed
    written = {r for a, r in allowed if a in ("s3:PutObject", "s3:DeleteObject")}
    assert not any("_check" in r for r in written)  # the verifier's alone
    assert written == {
        f"{root}{wallet}/*",
        f"{root}_want/*",
        f"{root}_pipe/*/{wallet}/*",
        f"{root}_pipe/{wallet}/*",
    }
    (listing,) = [st for st in policy["Statement"] if st["Action"] == ["s3:ListBucket"]]
    assert listing["Condition"]["StringLike"]["s3:prefix"] == ["run1/*"]
    assert (
        replica_policy("stage", "", wallet)["Statement"][0]["Resource"][0] == f"arn:aws:s3:::stage/{wallet}/*"
    )
    with pytest.raises(ValueError):
        replica_policy("stage", "run1", "not-a-wallet")
