"""GET /p2p/replay/{round} and GET /p2p/segment/{round}/{segment}: a replica serves what the
verifier needs to replay one of its rounds, or one segment of it (node.segments).

The body is safetensors (never pickle) of five float32 tensors: θ_round, Δ, AdamW's first and
second moments at the round's start (each (d,)) and the per-parameter step counts (k,). No
signed header rides along: every part is checked against the replica's signed receipt for
that round (base_hash, delta_digest, inner_state_digest), so a replica cannot serve anything
but what it committed to before it was asked. Served for the rounds the node's ReplayArchive
still holds (node.replay), and only to the verifier's operator wallet when it is known: the
moments are twice the model's size, not something to hand every peer that asks.

A segment's material (node.segment_store.SegmentMaterial, safetensors with the log and the
signed commitment in its metadata) is served the same way by `SegmentService`, from the rounds
the node's SegmentStore holds; it is checked against the receipt's segment_root by the verifier.
GET /p2p/segment-log/{round} serves the round's log and signed commitment alone (JSON,
protocol.segments.SignedSegmentLog, ~0.3 KB a step): the verifier reads a sender's log to hold
what it recorded sending against the headers it signed for the replica being checked.
"""

from __future__ import annotations

import asyncio
import re

from aiohttp import web
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from neuroshard.protocol.peer import REPLAY
from neuroshard.protocol.refusal import Refused, malformed
from neuroshard.protocol.segments import SignedSegmentLog, max_failed_in_segment

from ..codec import HEADER_SLACK, check_layout
from ..replay import InnerState, ReplayArchive, ReplayRecord
from ..segment_store import SegmentStore
from .auth import PEER_WALLET

SEGMENT = "/p2p/segment/{round}/{segment}"
SEGMENT_LOG = "/p2p/segment-log/{round}"
REPLAY_PATH = re.compile(r"^/p2p/replay/([^/]+)$")
SEGMENT_PATH = re.compile(r"^/p2p/segment/([^/]+)/([^/]+)$")
SEGMENT_LOG_PATH = re.compile(r"^/p2p/segment-log/([^/]+)$")
"""The routes as `answer` matches them (a relay replica's challenges carry the path, node.p2p.relay)."""


def segment_log_bound(inner_steps: int) -> int:
    """Largest signed-log body of a round of `inner_steps` steps: a step's record is at most ~3 KB
    (a span, a micro-batch id, 8 received and 8 sent references; ~0.3 KB in practice) and its
    share of the signed headers ~1.8 KB (8 of ~225 bytes: protocol.segments.max_headers; two or
    three in practice), a middle stage's failed steps (at most one a step plus 64, ~0.6 KB each:
    protocol.segments.max_failed), plus the checkpoint hashes, the headers' slack and the
    commitment."""
    return 6784 * inner_steps + (128 << 10)


THETA, DELTA, EXP_AVG, EXP_AVG_SQ, STEPS = "theta_round", "delta", "exp_avg", "exp_avg_sq", "steps"


def segment_size_bound(
    numel: int, n_tensors: int, steps: int, message_bytes: int, segment_steps: int | None = None
) -> int:
    """Largest segment body: θ_round and two checkpoints (weights, two moments; step counts), `steps`
    inner steps each with up to two messages received and two payloads sent of at most
    `message_bytes`, a middle stage's failed steps (at most `max_failed_in_segment(k)` for the
    log's k, `segment_steps`, default `steps`: a round's shorter last segment may hold as many as
    any; each one message received and one payload offered), the log (~0.5 KB a step of the round,
    at most 1,000,000 steps: MAX_MATERIAL_HEADER bounds it) and the commitment."""
    messages = 4 * steps + 2 * max_failed_in_segment(steps if segment_steps is None else segment_steps)
    return 4 * (7 * numel + 2 * n_tensors) + messages * message_bytes + (16 << 20) + HEADER_SLACK


def replay_size_bound(numel: int, n_tensors: int) -> int:
    """Largest replay body for a stage of `numel` values in `n_tensors` parameter tensors."""
    return 4 * (4 * numel + n_tensors) + HEADER_SLACK


def encode_replay(record: ReplayRecord) -> bytes:
    return st_save(
        {
            THETA: record.theta_round.contiguous(),
            DELTA: record.delta.contiguous(),
            EXP_AVG: record.inner.exp_avg.contiguous(),
            EXP_AVG_SQ: record.inner.exp_avg_sq.contiguous(),
            STEPS: record.inner.steps.contiguous(),
        }
    )


def decode_replay(body: bytes, round_: int, numel: int, n_tensors: int) -> ReplayRecord:
    """Safetensors bytes -> ReplayRecord, with exactly the expected tensors and shapes; raises
    Refused otherwise (values are judged by their digests, not here)."""
    vector = ("F32", (numel,))
    check_layout(
        body,
        {THETA: vector, DELTA: vector, EXP_AVG: vector, EXP_AVG_SQ: vector, STEPS: ("F32", (n_tensors,))},
    )
    try:
        t: dict[str, Tensor] = st_load(body)
    except (SafetensorError, ValueError) as exc:
        raise malformed(f"replay body does not load: {exc}") from None
    inner = InnerState(exp_avg=t[EXP_AVG], exp_avg_sq=t[EXP_AVG_SQ], steps=t[STEPS])
    return ReplayRecord(round=round_, theta_round=t[THETA], inner=inner, delta=t[DELTA])


class ReplayService:
    """The route, as a ServerExtension of the node's peer server."""

    ROUTE = "replay"

    def __init__(self, archive: ReplayArchive, *, allowed_wallet: str | None = None) -> None:
        self.archive = archive
        self.allowed_wallet = allowed_wallet
        """Hex public key allowed to ask (the verifier's operator); None: any signed peer."""

    def body_limit(self, route: str) -> int | None:
        return 0 if route == self.ROUTE else None  # a GET carries no body

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(REPLAY, self._serve, name=self.ROUTE)

    async def answer(self, path: str, peer_wallet: str) -> bytes | None:
        """The body GET `path` serves `peer_wallet`; None for a path not this service's. Raises
        Refused like the route (the relay answers challenges through its bucket with it)."""
        match = REPLAY_PATH.match(path)
        return None if match is None else await self._body(match[1], peer_wallet)

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request.match_info["round"], request[PEER_WALLET])
        return web.Response(status=200, body=body, content_type="application/octet-stream")

    async def _body(self, text: str, peer_wallet: str) -> bytes:
        if self.allowed_wallet is not None and peer_wallet != self.allowed_wallet:
            raise Refused("not_verifier", "replay material is served to the verifier's operator key only")
        if not text.isdigit() or len(text) > 16:
            raise Refused("malformed", f"round {text[:20]!r} is not a non-negative integer")
        record = self.archive.get(int(text))
        if record is None:
            held = self.archive.rounds()
            raise Refused("not_held", f"round {text} is not held here (held: {held})")
        return await asyncio.get_running_loop().run_in_executor(None, encode_replay, record)


class SegmentService:
    """GET /p2p/segment/{round}/{segment} and GET /p2p/segment-log/{round}, as a ServerExtension
    of the node's peer server."""

    ROUTE = "segment"
    LOG_ROUTE = "segment-log"

    def __init__(self, store: SegmentStore, *, allowed_wallet: str | None = None) -> None:
        self.store = store
        self.allowed_wallet = allowed_wallet
        """Hex public key allowed to ask (the verifier's operator); None: any signed peer."""

    def body_limit(self, route: str) -> int | None:
        return 0 if route in (self.ROUTE, self.LOG_ROUTE) else None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(SEGMENT, self._serve, name=self.ROUTE)
        app.router.add_get(SEGMENT_LOG, self._serve_log, name=self.LOG_ROUTE)

    async def answer(self, path: str, peer_wallet: str) -> bytes | None:
        """The body GET `path` serves `peer_wallet`; None for a path not this service's. Raises
        Refused like the routes (the relay answers challenges through its bucket with it)."""
        match = SEGMENT_LOG_PATH.match(path)
        if match is not None:
            return await self._log_body(match[1], peer_wallet)
        match = SEGMENT_PATH.match(path)
        return None if match is None else await self._segment_body(match[1], match[2], peer_wallet)

    def _only_the_verifier(self, peer_wallet: str) -> None:
        if self.allowed_wallet is not None and peer_wallet != self.allowed_wallet:
            raise Refused("not_verifier", "segment material is served to the verifier's operator key only")

    async def _serve_log(self, request: web.Request) -> web.StreamResponse:
        body = await self._log_body(request.match_info["round"], request[PEER_WALLET])
        return web.Response(status=200, body=body, content_type="application/json")

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        round_, segment = request.match_info["round"], request.match_info["segment"]
        body = await self._segment_body(round_, segment, request[PEER_WALLET])
        return web.Response(status=200, body=body, content_type="application/octet-stream")

    async def _log_body(self, text: str, peer_wallet: str) -> bytes:
        self._only_the_verifier(peer_wallet)
        if not (text.isdigit() and len(text) <= 16):
            raise Refused("malformed", f"round {text[:20]!r} is not a non-negative integer")
        loop = asyncio.get_running_loop()
        held = await loop.run_in_executor(None, self.store.log, int(text))
        if held is None or held[1] is None:
            raise Refused(
                "not_held", f"no signed log of round {text} is held here (rounds: {self.store.rounds()})"
            )
        end = await loop.run_in_executor(None, self.store.end_opening, int(text))
        return SignedSegmentLog(held[0], held[1], end).encode()

    async def _segment_body(self, round_text: str, segment_text: str, peer_wallet: str) -> bytes:
        self._only_the_verifier(peer_wallet)
        numbers = [round_text, segment_text]
        if not all(t.isdigit() and len(t) <= 16 for t in numbers):
            raise Refused("malformed", f"round and segment {numbers!r} must be non-negative integers")
        round_, segment = int(numbers[0]), int(numbers[1])
        loop = asyncio.get_running_loop()
        material = await loop.run_in_executor(None, self.store.material, round_, segment)
        if material is None:
            held = self.store.rounds()
            raise Refused(
                "not_held", f"segment {segment} of round {round_} is not held here (rounds: {held})"
            )
        body: bytes = await loop.run_in_executor(None, material.encode)
        return body
