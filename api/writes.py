"""The signed write endpoints: register, heartbeat, receipts, and the operator's reinstate.

Order of checks, cheapest first, nothing written until all pass: body size (middleware,
413) → signature headers, freshness, signature (401; protocol.signing) → per-signer rate limit
(429) → strict JSON and the body's schema (422; the message's own parser in protocol.reports:
duplicate keys, NaN, deep nesting, huge numbers, unknown fields) → in one transaction: nonce
unused (409), wallet registered and not refused (403), the write itself → commit → the 2xx.
Any failure rolls the transaction back, nonce included. Every refusal is a `Refused`; its
status comes from api.refusals. Registrations, heartbeats and receipts share their transaction
with other requests' (verifier.groupcommit), which keeps each write's outcome its own.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.reports import HeartbeatRequest, Receipt, RegisterRequest, ReinstateRequest
from neuroshard.protocol.signing import SignedBy, verify_request
from neuroshard.verifier import ledger
from neuroshard.verifier import models as m
from neuroshard.verifier.ratelimit import source_key

from .refusals import request_body
from .schemas import ErrorOut, WriteAck
from .services import Services, get_services, services_of

log = logging.getLogger(__name__)

router = APIRouter(prefix="/api", tags=["signed writes"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorOut, "description": "Unsigned, malformed signature headers, stale, or forged."},
    403: {"model": ErrorOut, "description": "Wallet not registered, refused, or not the operator."},
    409: {"model": ErrorOut, "description": "Nonce replayed, or conflicts with what is recorded."},
    413: {"model": ErrorOut, "description": "Body larger than the configured limit."},
    422: {
        "model": ErrorOut,
        "description": "Body is not strict JSON (duplicate keys, NaN, nesting, number length) or does not "
        "match the schema (unknown fields refused).",
    },
    429: {
        "model": ErrorOut,
        "description": "Per-wallet rate limit, or new wallets per source; see Retry-After.",
    },
}


@dataclass(frozen=True)
class SignedRequest:
    signed: SignedBy
    body_sha256: str
    body: bytes


def _path_as_sent(request: Request) -> str:
    """The raw path with its query string, as the client signed it (protocol.signing)."""
    raw = request.scope.get("raw_path") or request.url.path.encode("utf-8")
    query = request.scope.get("query_string", b"")
    return raw.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")


async def signed_request(request: Request) -> SignedRequest:
    """Authenticate the raw body before anything parses it (FastAPI caches the bytes it read)."""
    services = services_of(request)
    body = await request.body()
    signed = verify_request(
        request.headers,
        request.method,
        _path_as_sent(request),
        body,
        now=services.now(),
        window_s=services.config.freshness_window_s,
    )
    wait = services.limiter.acquire(signed.public_key_hex)
    if wait > 0:
        raise Refused(
            "rate_limited", f"rate limit for {signed.wallet_id}: retry in {wait:.1f} s", retry_after_s=wait
        )
    return SignedRequest(signed, hashlib.sha256(body).hexdigest(), body)


def acknowledged(ack: WriteAck, status_code: int = 200) -> Response:
    """The acknowledgement's response. The WriteAck was validated when it was built, so the route
    hands FastAPI bytes instead of a model to validate and encode a second time (0.97x the
    verifier's CPU per write, bench/RESULTS.md); `response_model` still documents it in OpenAPI."""
    return Response(ack.model_dump_json(), status_code=status_code, media_type="application/json")


def _order(signed: SignedBy) -> str:
    """Where a write goes in its group (verifier.groupcommit): by wallet, then nonce, the same in
    every process."""
    return f"{signed.wallet_id}/{signed.nonce}"


Signed = Annotated[SignedRequest, Depends(signed_request)]
ServicesDep = Annotated[Services, Depends(get_services)]


async def _limit_new_wallets(request: Request, services: Services, signed: SignedBy) -> None:
    """429 when the request's source registered too many new wallets (verifier.ratelimit.source_key);
    a wallet the verifier knows re-registers freely (a node restarting, moving its address)."""
    limiter, cfg = services.registrations, services.config.registration_limit
    if limiter is None or cfg is None:
        return
    source = source_key(request.client.host if request.client else None, exempt_loopback=cfg.exempt_loopback)
    if source is None:
        return

    def known() -> bool:
        with services.db.read() as session:
            return session.get(m.Wallet, signed.wallet_id) is not None

    if await run_in_threadpool(known):
        return
    wait = limiter.acquire(source)
    if wait > 0:
        raise Refused(
            "rate_limited", f"too many new wallets from {source}: retry in {wait:.0f} s", retry_after_s=wait
        )


def _registration_order(signed: SignedBy, stage: int) -> str:
    """A registration's place in its group: by stage first. A new member moves its stage's
    membership epoch (a row lock held to COMMIT), so two processes' groups of registrations take
    the epoch rows in the same order and cannot deadlock on them (verifier.groupcommit)."""
    return f"{stage:010d}/{_order(signed)}"


@router.post(
    "/register", response_model=WriteAck, responses=_ERRORS, openapi_extra=request_body(RegisterRequest)
)
async def register(auth: Signed, services: ServicesDep, request: Request) -> Response:
    """Register (or re-register) the signing wallet: peer address, stage, software version. A new
    wallet may need a proof of work (`pow_nonce`, GET /api/admission) and is limited per source."""
    payload = RegisterRequest.from_json(auth.body)
    await _limit_new_wallets(request, services, auth.signed)
    now = services.now()

    def write(session: Session) -> float:
        ledger.use_nonce(session, auth.signed, window_s=services.config.freshness_window_s)
        return ledger.register(session, auth.signed, payload, now=now, cfg=services.ledger).reputation

    # A network's launch registers its nodes within seconds: they commit in groups too, and a
    # group moves each stage's epoch once per registration in it, in stage order.
    reputation = await services.writes.submit(write, key=_registration_order(auth.signed, payload.stage))
    return acknowledged(  # only now: the group's transaction has committed
        WriteAck(
            status="registered",
            wallet_id=auth.signed.wallet_id,
            reputation=reputation,
            heartbeat_interval_s=services.config.peer_ttl_s / 3,
        )
    )


@router.post(
    "/heartbeat", response_model=WriteAck, responses=_ERRORS, openapi_extra=request_body(HeartbeatRequest)
)
async def heartbeat(auth: Signed, services: ServicesDep) -> Response:
    """Keep the signing wallet in the peer list and report its DiLoCo progress."""
    payload = HeartbeatRequest.from_json(auth.body)
    now = services.now()

    def write(session: Session) -> None:
        ledger.use_nonce(session, auth.signed, window_s=services.config.freshness_window_s)
        ledger.heartbeat(session, auth.signed, payload, now=now, cfg=services.ledger)

    await services.writes.submit(write, key=_order(auth.signed))  # returns once committed
    return acknowledged(
        WriteAck(
            status="alive",
            wallet_id=auth.signed.wallet_id,
            heartbeat_interval_s=services.config.peer_ttl_s / 3,
        )
    )


@router.post(
    "/receipts",
    response_model=WriteAck,
    status_code=201,
    responses={
        200: {"model": WriteAck, "description": "An identical receipt was already recorded."},
        **_ERRORS,
    },
    openapi_extra=request_body(Receipt),
)
async def submit_receipt(auth: Signed, services: ServicesDep) -> Response:
    """Record a work receipt for one (stage, round). 201 once committed; 200 for an identical resend."""
    payload = Receipt.from_json(auth.body)
    now = services.now()

    def write(session: Session) -> str:
        ledger.use_nonce(session, auth.signed, window_s=services.config.freshness_window_s)
        return ledger.submit_receipt(
            session, auth.signed, payload, body_sha256=auth.body_sha256, now=now, cfg=services.ledger
        )

    # A thousand replicas end a round together: their receipts commit in groups, each answered
    # once its group has committed (verifier.groupcommit).
    status = await services.writes.submit(write, key=_order(auth.signed))
    if status == "duplicate":
        return acknowledged(WriteAck(status="duplicate", wallet_id=auth.signed.wallet_id))
    # The receipt is committed; judging earlier rounds is separate so a settlement race (another
    # receipt settling the same round) cannot cost this receipt its acknowledgement. A round
    # left unsettled here is settled by a later receipt or by the lead process's housekeeping
    # (verifier.housekeeping), which is also what settles during the gate's pauses.
    recorded = acknowledged(WriteAck(status="recorded", wallet_id=auth.signed.wallet_id), 201)
    if services.settle.due(payload.stage):
        await run_in_threadpool(_settle, services, payload.stage, payload.round, now)
    return recorded


def _settle(services: Services, stage: int, round_: int, now: float) -> None:
    try:
        with services.db.write() as session:
            ledger.settle_rounds(session, stage, now=now, cfg=services.ledger)
    except IntegrityError:
        log.debug("stage %d before round %d: settled concurrently by another request", stage, round_)
    except SQLAlchemyError as exc:
        log.warning("settling stage %d before round %d deferred: %s", stage, round_, exc)


@router.post(
    "/admin/reinstate",
    response_model=WriteAck,
    responses=_ERRORS,
    tags=["operator"],
    openapi_extra=request_body(ReinstateRequest),
)
def reinstate(auth: Signed, services: ServicesDep) -> WriteAck:
    """Operator only (signed with the operator key): let a refused wallet back in."""
    payload = ReinstateRequest.from_json(auth.body)
    if auth.signed.public_key_hex != services.config.operator.public_key_hex:
        raise Refused("not_operator", "only the operator key may reinstate wallets")
    now = services.now()
    with services.db.write() as session:
        ledger.use_nonce(session, auth.signed, window_s=services.config.freshness_window_s)
        wallet = ledger.reinstate(
            session, payload.wallet_id, payload.reputation, now=now, cfg=services.config.reputation
        )
        ack = WriteAck(status="reinstated", wallet_id=wallet.wallet_id, reputation=wallet.reputation)
    return ack
