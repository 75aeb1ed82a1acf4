"""A mixed stage: the partitioned round over two carriers at once agrees bit for bit.

Four real `OuterRound`s in one event loop. Two replicas publish through an S3 bucket (a moto server
on loopback; they make outbound requests only, no server of their own), two through their own real
aiohttp peer servers (`build_app` + `ObjectRoutes`, port 0). Every replica reads each author through
the carrier that author publishes on (`RoutedStore`): a bucket replica reads HTTP authors with signed
GETs from its own `PeerClient`, an HTTP replica reads bucket authors through a `BucketStore` it only
reads with. The aggregate must be the one the same round gives over `MemoryHub`: carriers move
bytes, they must not change one.

The moto server and the dummy-credential environment mirror tests/node/p2p/test_bucket.py, whose
fixtures are not visible from this directory.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import AsyncExitStack
from typing import Any

import pytest
import torch
from aiohttp import test_utils

from neuroshard.node.aggregation import aggregate as whole_vector
from neuroshard.node.outer.port import MemoryHub, RoundStore, RoutedStore
from neuroshard.node.outer.round import OuterRound
from neuroshard.node.outer.state import RoundConfig, RoundInput, RoundResult
from neuroshard.node.p2p.auth import PeerClient
from neuroshard.node.p2p.bucket import BucketStore, RelayConfig, make_s3_client
from neuroshard.node.p2p.objects import HttpRoundStore, ObjectRoutes, ObjectShelf
from neuroshard.node.p2p.peers import PeerTable
from neuroshard.node.p2p.server import NodeState, ServerLimits, build_app
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.signing import NonceCache

D = 4000
N = 4
BASE = "cd" * 32
STAGE, ROUND = 0, 5
BUCKET_REPLICAS = (0, 2)
"""Indices (in sorted member order) of the replicas that publish through the bucket; 1 and 3 use HTTP."""


pytestmark = pytest.mark.usefixtures("aws_env")


@pytest.fixture
def relay(endpoint: str) -> RelayConfig:
    """A fresh bucket on the moto server, with short polls."""
    config = RelayConfig(
        url=f"s3://ns-{uuid.uuid4().hex[:12]}/runs/mixed",
        endpoint_url=endpoint,
        poll_interval_s=0.05,
        max_poll_s=0.2,
        request_timeout_s=2.0,
        max_workers=8,
    )
    client = make_s3_client(config)
    client.create_bucket(Bucket=config.bucket)
    client.close()
    return config


def median_rule(stack: torch.Tensor) -> torch.Tensor:
    return whole_vector("median", stack)


def config(encoding: str) -> RoundConfig:
    # checks=N-1: every replica re-reads every other part's inputs, through both carriers.
    return RoundConfig(
        encoding=encoding,
        commit_timeout_s=5,
        part_timeout_s=5,
        gather_timeout_s=5,
        agree_timeout_s=5,
        checks=N - 1,
    )


def stage_inputs() -> tuple[list[Wallet], list[RoundInput]]:
    wallets = sorted(
        (Wallet.from_token(f"mixed-carrier-{i}") for i in range(N)), key=lambda w: w.public_key_hex
    )
    members = tuple(w.public_key_hex for w in wallets)
    g = torch.Generator().manual_seed(7)
    common = torch.randn(D, generator=g) * 0.01
    deltas = [common + torch.randn(D, generator=g) * 0.003 for _ in range(N)]
    inputs = [
        RoundInput(stage=STAGE, round=ROUND, base_hash=BASE, members=members, delta=d, tokens=100 + i)
        for i, d in enumerate(deltas)
    ]
    return wallets, inputs


async def run_over_memory(encodings: list[str]) -> list[RoundResult]:
    wallets, inputs = stage_inputs()
    hub = MemoryHub()
    rounds = [
        OuterRound(hub.store(w.public_key_hex), w, median_rule, config(e))
        for w, e in zip(wallets, encodings, strict=True)
    ]
    return list(await asyncio.gather(*(r.run(x) for r, x in zip(rounds, inputs, strict=True))))


def node_state(wallet: Wallet) -> NodeState:
    return NodeState(
        wallet=wallet,
        stage=STAGE,
        peers=PeerTable(own_wallet=wallet.public_key_hex, ttl_s=30.0, ban_after=3, ban_s=30.0),
        nonces=NonceCache(60.0),
        clock=time.time,
        limits=ServerLimits(),
        log=lambda line: None,
    )


async def run_over_mixed_carriers(
    relay: RelayConfig, encodings: list[str]
) -> tuple[list[RoundResult], dict[str, Any]]:
    """The same round, bucket replicas at BUCKET_REPLICAS and HTTP replicas elsewhere."""
    wallets, inputs = stage_inputs()
    ids = [w.public_key_hex for w in wallets]
    on_bucket = {ids[i] for i in BUCKET_REPLICAS}
    addresses: dict[str, str] = {}  # HTTP authors only: a bucket replica has no address
    seen: dict[str, Any] = {
        "bucket_stores": [],
        "http_stores": [],
        "shelves": {},
        "unserved": [],
        "servers": [],
        "readers": [],
    }

    async with AsyncExitStack() as stack:
        s3 = make_s3_client(relay)  # thread-safe; one for the stage saves loading botocore's models 4 times
        stack.callback(s3.close)

        def bucket_store(wallet: str) -> BucketStore:
            store = BucketStore(relay, wallet, client=s3)
            stack.callback(store.close)
            seen["bucket_stores"].append(store)
            return store

        async def peer_client(wallet: Wallet) -> PeerClient:
            client = PeerClient(wallet, connect_timeout_s=2.0, request_timeout_s=10.0)
            await client.start()
            stack.push_async_callback(client.close)
            return client

        rounds: list[OuterRound] = []
        for wallet, encoding in zip(wallets, encodings, strict=True):
            me = wallet.public_key_hex
            client = await peer_client(wallet)
            if me in on_bucket:
                own: RoundStore = bucket_store(me)
                bucket_reader: RoundStore = own
                # Outbound only: the shelf is never published to nor served (the round never
                # reads its own objects through the carrier), it only satisfies the constructor.
                shelf = ObjectShelf(max_bytes=0, max_objects=1)
                seen["unserved"].append(shelf)
                http_reader: RoundStore = HttpRoundStore(
                    wallet=me, shelf=shelf, client=client, locate=addresses.get
                )
            else:
                shelf = ObjectShelf(max_bytes=16 << 20, max_objects=256)
                app = build_app(node_state(wallet), window_s=60.0, extensions=[ObjectRoutes(shelf)])
                server = test_utils.TestServer(app, host="127.0.0.1", port=0)
                await server.start_server()
                stack.push_async_callback(server.close)
                addresses[me] = f"127.0.0.1:{server.port}"
                seen["servers"].append(server)
                seen["shelves"][me] = shelf
                own = http_reader = HttpRoundStore(
                    wallet=me, shelf=shelf, client=client, locate=addresses.get
                )
                bucket_reader = bucket_store(me)  # read access only: it never publishes
                seen["readers"].append(bucket_reader)
            seen["http_stores"].append(http_reader)

            def route(
                author: str,
                me: str = me,
                own: RoundStore = own,
                b: RoundStore = bucket_reader,
                h: RoundStore = http_reader,
            ) -> RoundStore:
                if author == me:
                    return own
                return b if author in on_bucket else h

            rounds.append(OuterRound(RoutedStore(own, route), wallet, median_rule, config(encoding)))

        results = await asyncio.wait_for(
            asyncio.gather(*(r.run(x) for r, x in zip(rounds, inputs, strict=True))), 12.0
        )
        seen["traffic"] = [r.store.traffic for r in rounds]
    return list(results), seen


def assert_clean_agreement(results: list[RoundResult]) -> torch.Tensor:
    first = results[0].aggregate
    for r in results:
        assert torch.equal(r.aggregate, first)
        assert r.cheats == {}, r.cheats
        assert r.refused == {}, r.refused
        assert r.silent == {}, r.silent
        assert r.missing_parts == ()
        assert len(r.committed) == N
        assert len(r.claims) == N and all(c.replaces == "" for c in r.claims.values())
        assert len(r.checked) == N - 1
    assert first.abs().sum() > 0
    return first


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "encodings",
    [
        pytest.param(["int8"] * N, id="all-int8"),
        # Bucket replicas int8, HTTP replicas fp16: each part's aggregate is in its owner's encoding.
        pytest.param(["int8", "fp16", "int8", "fp16"], id="http-fp16-bucket-int8"),
    ],
)
async def test_a_mixed_stage_agrees_bit_for_bit_with_the_memory_carrier(
    relay: RelayConfig, encodings: list[str]
) -> None:
    started = time.monotonic()
    results, seen = await run_over_mixed_carriers(relay, encodings)
    mixed = assert_clean_agreement(results)

    memory = assert_clean_agreement(await run_over_memory(encodings))
    assert torch.equal(mixed, memory)  # the carriers did not change a bit

    # Each part was aggregated in its owner's own encoding, the same over both carriers.
    wallets, _ = stage_inputs()
    encoding_of = {w.public_key_hex: e for w, e in zip(wallets, encodings, strict=True)}
    for r in results:
        assert {j: c.encoding for j, c in r.claims.items()} == {
            j: encoding_of[c.wallet] for j, c in r.claims.items()
        }

    # Both carriers really carried: the bucket holds only the bucket replicas' objects, the HTTP
    # replicas served from their shelves, and every replica read through both.
    s3 = make_s3_client(relay)
    listing = s3.list_objects_v2(Bucket=relay.bucket)
    s3.close()
    authors = {o["Key"].split("/")[2] for o in listing.get("Contents", [])}
    assert authors == {wallets[i].public_key_hex for i in BUCKET_REPLICAS}
    for shelf in seen["shelves"].values():
        assert shelf.served.requests > 0 and shelf.served.bytes_sent > 0
    assert all(s.traffic.bytes_received > 0 for s in seen["bucket_stores"])
    assert all(s.traffic.bytes_received > 0 for s in seen["http_stores"])
    assert all(t.bytes_received > 0 for t in seen["traffic"])
    assert all(len(shelf) == 0 for shelf in seen["unserved"])  # bucket replicas serve nothing
    assert all(s.traffic.bytes_sent == 0 for s in seen["readers"])  # HTTP replicas put nothing
    assert all(server.closed for server in seen["servers"])
    assert time.monotonic() - started < 15.0
