"""GET /p2p/replay/{round}: the verifier's operator gets a round's θ_round, Δ and inner state as
safetensors; anyone else gets 403, a round not held 404, and a body of the wrong layout is refused."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from aiohttp import ClientSession, test_utils
from tests_support import refused

from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.p2p.replay import (
    SEGMENT,
    ReplayService,
    SegmentService,
    decode_replay,
    encode_replay,
    replay_size_bound,
    segment_size_bound,
)
from neuroshard.node.p2p.server import build_app
from neuroshard.node.replay import InnerState, ReplayArchive, ReplayRecord
from neuroshard.node.segment_store import SegmentMaterial, SegmentStore
from neuroshard.node.segments import SegmentConfig, SegmentRecorder
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.peer import REPLAY
from neuroshard.protocol.signing import sign_request

NUMEL, TENSORS = 50, 3
OPERATOR = Wallet.from_token("replay-route-operator")


def _record(round_: int) -> ReplayRecord:
    gen = torch.Generator().manual_seed(round_)
    inner = InnerState(
        exp_avg=torch.randn(NUMEL, generator=gen),
        exp_avg_sq=torch.rand(NUMEL, generator=gen),
        steps=torch.full((TENSORS,), 4.0),
    )
    return ReplayRecord(round_, torch.randn(NUMEL, generator=gen), inner, torch.randn(NUMEL, generator=gen))


@pytest_asyncio.fixture
async def served(make_node, wallets) -> AsyncIterator[tuple[test_utils.TestServer, ClientSession]]:  # type: ignore[no-untyped-def]
    archive = ReplayArchive(keep_rounds=2)
    for r in (5, 6):
        archive.add(_record(r))
    service = ReplayService(archive, allowed_wallet=OPERATOR.public_key_hex)
    server = test_utils.TestServer(build_app(make_node(wallets[0]), window_s=60.0, extensions=[service]))
    await server.start_server()
    async with ClientSession() as session:
        yield server, session
    await server.close()


async def _get(served, wallet: Wallet, round_: str) -> tuple[int, bytes]:  # type: ignore[no-untyped-def]
    server, session = served
    path = REPLAY.format(round=round_)
    async with session.get(
        server.make_url(path), headers=sign_request(wallet, "GET", path, b"", time.time())
    ) as r:
        return r.status, await r.read()


@pytest.mark.asyncio
async def test_the_operator_gets_the_round_as_committed(served) -> None:  # type: ignore[no-untyped-def]
    status, body = await _get(served, OPERATOR, "6")
    assert status == 200 and len(body) <= replay_size_bound(NUMEL, TENSORS)
    got, want = decode_replay(body, 6, NUMEL, TENSORS), _record(6)
    assert torch.equal(got.theta_round, want.theta_round) and torch.equal(got.delta, want.delta)
    assert got.inner.digest() == want.inner.digest()


@pytest.mark.asyncio
async def test_others_unheld_rounds_and_bad_rounds_are_refused(served, wallets) -> None:  # type: ignore[no-untyped-def]
    assert (await _get(served, wallets[1], "6"))[0] == 403
    status, body = await _get(served, OPERATOR, "4")
    assert status == 404 and b"not_held" in body
    assert (await _get(served, OPERATOR, "-1"))[0] in (400, 404)
    assert (await _get(served, OPERATOR, "1" * 20))[0] == 400


def test_a_body_of_another_layout_is_malformed() -> None:
    body = encode_replay(_record(1))
    with refused("malformed"):
        decode_replay(body, 1, NUMEL + 1, TENSORS)  # the verifier's model is another size
    with refused("malformed"):
        decode_replay(body[:-4], 1, NUMEL, TENSORS)  # truncated


def _stored_segments(directory: Path) -> tuple[SegmentStore, int, int]:
    """A store holding one recorded round of a tiny replica (two segments of two steps)."""
    torch.manual_seed(0)
    model = ModelConfig(vocab_size=32, dim=8, n_layers=1, n_heads=2, ffn_dim=16, max_seq_len=8)
    diloco = DiLoCo(build_stage(model, 0, 1), DiLoCoConfig(inner_steps=4, warmup_steps=1, total_steps=20))
    config = SegmentConfig(segment_steps=2)
    store = SegmentStore(directory, config, log=lambda _: None)
    recorder = SegmentRecorder(config, stage=0, sink=store)
    recorder.start_round(diloco)
    for i in range(4):
        tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(i))
        diloco.inner_step(tokens[:, :-1], tokens[:, 1:])
        recorder.record_step(diloco, data=(0, 2 * i, 2 * i + 2))
    recorder.end_round(diloco)
    diloco.outer_step(diloco.pseudo_gradient())
    recorder.close_round(OPERATOR)
    return store, sum(p.numel() for p in diloco.params), len(diloco.params)


@pytest.mark.asyncio
async def test_segment_material_is_served_to_the_operator_as_stored(
    make_node, wallets, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    store, numel, n_tensors = _stored_segments(tmp_path)
    service = SegmentService(store, allowed_wallet=OPERATOR.public_key_hex)
    server = test_utils.TestServer(build_app(make_node(wallets[0]), window_s=60.0, extensions=[service]))
    await server.start_server()
    try:
        async with ClientSession() as session:

            async def get(wallet: Wallet, round_: str, segment: str) -> tuple[int, bytes]:
                path = SEGMENT.format(round=round_, segment=segment)
                headers = sign_request(wallet, "GET", path, b"", time.time())
                async with session.get(server.make_url(path), headers=headers) as r:
                    return r.status, await r.read()

            status, body = await get(OPERATOR, "0", "1")
            assert status == 200 and len(body) <= segment_size_bound(numel, n_tensors, 2, 0)
            got = SegmentMaterial.decode(body, numel=numel, n_tensors=n_tensors)
            want = store.material(0, 1)
            assert want is not None and got.log == want.log and got.commitment == want.commitment
            assert torch.equal(got.end.weights, want.end.weights) and torch.equal(
                got.theta_round, want.theta_round
            )
            assert (await get(wallets[1], "0", "1"))[0] == 403
            status, body = await get(OPERATOR, "0", "2")
            assert status == 404 and b"not_held" in body
            assert (await get(OPERATOR, "1", "0"))[0] == 404
            assert (await get(OPERATOR, "0", "x"))[0] in (400, 404)
    finally:
        await server.close()
