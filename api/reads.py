"""The read-only endpoints: tracker, training status, history, nodes, fraud proofs, network, metrics.

Each renders its JSON through the read cache (api.cache): computed from the database when
the data changed (at most every few seconds), served from memory with an ETag otherwise.
HEAD is answered wherever GET is (api.cache.HeadAsGet). Lists that grow with the network
(nodes, history) are paged with limit/offset; the total is in X-Total-Count and the next
page in a Link header (RFC 8288).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from fastapi.types import DecoratedCallable
from pydantic import BaseModel, TypeAdapter
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from neuroshard.node.model_file import read_round_header, round_model_path, round_models, round_tokenizer_path
from neuroshard.protocol.refusal import Refused
from neuroshard.verifier import coverage, fraudproofs, summary
from neuroshard.verifier import models as m
from neuroshard.verifier.network import NETWORK_SIGNATURE_HEADER, OPERATOR_HEADER

from .cache import HEAD_SCOPE_KEY, Rendered, _matches, cached_response, etag_of
from .metrics import CONTENT_TYPE, Exposition
from .schemas import (
    CoverageOut,
    DiLoCoOut,
    ErrorOut,
    EvaluationOut,
    FraudProofOut,
    FraudProofsOut,
    GlobalOut,
    HistoryOut,
    ModelFileOut,
    ModelsOut,
    NodeDetailOut,
    NodeOut,
    PeerOut,
    RoundOut,
    SampleOut,
    StageModelOut,
    StageOut,
    TextSampleOut,
    UnnoticedOut,
    VerifyOut,
    WalletCoverageOut,
)
from .services import Services, get_services

router = APIRouter()
ServicesDep = Annotated[Services, Depends(get_services)]

MAX_PAGE = 1000
"""Largest limit a paged endpoint accepts: a page stays a few hundred KB at most."""
Headers = tuple[tuple[str, str], ...]
_NODE_LIST = TypeAdapter(list[NodeOut])
_PEER_LIST = TypeAdapter(list[PeerOut])

_PAGE_HEADERS = {
    "X-Total-Count": {"description": "Items in the whole list.", "schema": {"type": "integer"}},
    "Link": {"description": 'The next page, if any: <URL>; rel="next".', "schema": {"type": "string"}},
    "ETag": {
        "description": "Validator for If-None-Match (304 when unchanged).",
        "schema": {"type": "string"},
    },
}
_CACHED = {
    "ETag": {
        "description": "Validator for If-None-Match (304 when unchanged).",
        "schema": {"type": "string"},
    },
    "Cache-Control": {
        "description": "public, max-age=N: proxies may serve it N seconds.",
        "schema": {"type": "string"},
    },
}
_NOT_MODIFIED: dict[int | str, dict[str, Any]] = {
    304: {"description": "Not modified: the If-None-Match ETag is current."}
}
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE, description=f"Items per page (1..{MAX_PAGE}).")]
Offset = Annotated[int, Query(ge=0, le=10_000_000, description="Items to skip from the start of the list.")]


def _json(model: BaseModel) -> bytes:
    return model.model_dump_json().encode()


def _serve(request: Request, services: Services, entry: Rendered) -> Response:
    return cached_response(request, entry, max_age_s=services.config.reads.max_age_s)


def _cached_get(
    path: str, model: Any, tag: str, *, paged: bool = False, missing: bool = False
) -> Callable[[DecoratedCallable], DecoratedCallable]:
    """The route of a read served through the read cache: its 200 carries an ETag and
    Cache-Control (`paged`: a page's headers), a current If-None-Match gets 304, and `missing`
    documents the 404 of an absent item."""
    responses: dict[int | str, dict[str, Any]] = {
        200: {"headers": _PAGE_HEADERS if paged else _CACHED},
        **_NOT_MODIFIED,
    }
    if missing:
        responses[404] = {"model": ErrorOut}
    return router.get(path, response_model=model, responses=responses, tags=[tag])


async def _cached(
    request: Request, services: Services, key: str, render: Callable[[], tuple[bytes, Headers]]
) -> Response:
    """The read under `key` from the read cache, rendered by `render` when the data changed.

    The routes that use it are async: a body in the cache is served on the event loop, and only
    a render (which reads the database) goes to the thread pool. A sync route would cost every
    request the hop to a thread and back, most of what serving a cached body costs (issue 15)."""
    entry = services.reads.peek(key, render)
    if entry is None:
        entry = await run_in_threadpool(services.reads.get, key, render)
    return _serve(request, services, entry)


def _page_headers(request: Request, total: int, limit: int, offset: int) -> Headers:
    headers: list[tuple[str, str]] = [("X-Total-Count", str(total))]
    if offset + limit < total:
        url = request.url.include_query_params(limit=limit, offset=offset + limit)
        headers.append(("Link", f'<{url.path}?{url.query}>; rel="next"'))
    return tuple(headers)


def _verify(session: Session, services: Services) -> VerifyOut:
    cfg = services.config
    verdict, _ = summary.verdict(session, cfg.verdict)
    head = summary.headline(
        session, now=services.now(), ttl=cfg.peer_ttl_s, window=cfg.agreement_window_rounds
    )
    return VerifyOut(
        training_verified=verdict.training_verified,
        reason=verdict.reason,
        global_loss=verdict.last_loss,
        initial_loss=verdict.first_loss,
        loss_drop=verdict.drop,
        required_drop=verdict.required_drop,
        loss_trend=verdict.trend,
        loss_slope_per_round=verdict.slope,
        evaluations=verdict.evaluations,
        reported_loss=head.reported_loss,
        hash_agreement_rate=head.rates.hash_agreement_rate,
        sync_success_rate=head.rates.sync_success_rate,
        active_nodes=head.active_nodes,
        rounds=0 if head.latest_round is None else head.latest_round + 1,
        rounds_settled=head.rates.rounds_settled,
    )


@_cached_get("/api/training/verify", VerifyOut, "training")
async def training_verify(request: Request, services: ServicesDep) -> Response:
    """Is the global model really learning? Judged from the verifier's own held-out measurements only."""

    def render() -> tuple[bytes, Headers]:
        with services.db.read() as session:
            return _json(_verify(session, services)), ()

    return await _cached(request, services, "verify", render)


def _stages(
    rounds: list[summary.RoundRecord], live: list[summary.NodeRecord], num_stages: int
) -> list[StageOut]:
    out = []
    for stage in range(num_stages):
        mine = [r for r in rounds if r.stage == stage]
        settled = [r for r in mine if r.settled]
        latest = mine[-1] if mine else None
        last_settled = settled[-1] if settled else None
        out.append(
            StageOut(
                stage=stage,
                replicas_alive=sum(1 for n in live if n.stage == stage),
                latest_round=latest.round if latest else None,
                settled=bool(latest and latest.settled),
                majority_hash=last_settled.majority_hash if last_settled else None,
                hash_agreement_rate=last_settled.agreement_rate if last_settled else None,
                accepted_contributions=latest.accepted if latest else 0,
                rejected_contributions=latest.rejected if latest else 0,
            )
        )
    return out


@_cached_get("/api/training/global", GlobalOut, "training")
async def training_global(request: Request, services: ServicesDep) -> Response:
    """The full picture: nodes, measured and reported loss, work done, agreement per stage, DiLoCo status."""
    return await _cached(request, services, "global", lambda: (_json(_global(services)), ()))


def _global(services: Services) -> GlobalOut:
    cfg, net = services.config, services.config.network
    now = services.now()
    with services.db.read() as session:
        verify = _verify(session, services)
        totals = summary.totals(session, now=now, ttl=cfg.peer_ttl_s)
        live = summary.live_peers(session, now=now, ttl=cfg.peer_ttl_s)
        # Per stage: stages need not keep pace (a lone pipeline replica runs ahead), so the
        # newest rounds overall may all be one stage's.
        rounds = [r for s in range(net.num_stages) for r in summary.recent_rounds(session, limit=4, stage=s)]
        rounds.sort(key=lambda r: (r.round, r.stage))
    progress = [n.steps_in_round / net.diloco.inner_steps for n in live if n.steps_in_round is not None]
    return GlobalOut(
        network=net.name,
        training_verified=verify.training_verified,
        reason=verify.reason,
        nodes_training=totals.active_nodes,
        nodes_registered=totals.registered,
        nodes_refused=totals.refused,
        global_loss_measured=verify.global_loss,
        global_loss_reported=verify.reported_loss,
        total_inner_steps=totals.inner_steps,
        total_tokens=totals.tokens,
        data_shards_covered=totals.shards_covered,
        hash_agreement_rate=verify.hash_agreement_rate,
        sync_success_rate=verify.sync_success_rate,
        stages=_stages(rounds, live, net.num_stages),
        diloco=DiLoCoOut(
            inner_steps_per_round=net.diloco.inner_steps,
            outer_rounds=verify.rounds,
            inner_progress=min(1.0, sum(progress) / len(progress)) if progress else None,
            aggregation_rule=net.aggregation_rule,
            aggregation_f=net.aggregation_f,
            outer_lr=net.diloco.outer_step_lr,
            outer_momentum=net.diloco.outer_momentum,
        ),
    )


@_cached_get("/api/training/history", HistoryOut, "training", paged=True)
async def training_history(
    request: Request,
    services: ServicesDep,
    limit: Annotated[
        int | None,
        Query(
            ge=1, le=MAX_PAGE, description="(stage, round)s per page; default: the configured history length."
        ),
    ] = None,
    offset: Annotated[int, Query(ge=0, le=10_000_000, description="Newest (stage, round)s to skip.")] = 0,
) -> Response:
    """Measured loss per evaluation; agreement, sync and reported loss per (stage, round), a page
    of the newest ones (returned oldest first). X-Total-Count counts (stage, round)s."""
    rows = limit or services.config.history_rounds

    def render() -> tuple[bytes, Headers]:
        with services.db.read() as session:
            evals = summary.evaluations(session)
            rounds = summary.recent_rounds(session, limit=rows, offset=offset)
            total = summary.round_count(session)
        out = HistoryOut(
            evaluations=[EvaluationOut.model_validate(e) for e in evals],
            rounds=[RoundOut.model_validate(r) for r in rounds],
        )
        return _json(out), _page_headers(request, total, rows, offset)

    return await _cached(request, services, f"history:{rows}:{offset}", render)


@_cached_get("/api/training/sample", SampleOut, "training")
async def training_sample(request: Request, services: ServicesDep) -> Response:
    """A short text the verifier generated itself from the latest measured majority model (a
    fixed prompt, seeded sampling), refreshed every few evaluations: what the model says now."""
    evaluation = services.config.live_evaluation
    every = evaluation.sample_every if evaluation is not None and evaluation.sample_every else None

    def render() -> tuple[bytes, Headers]:
        with services.db.read() as session:
            latest = session.scalars(
                select(m.TextSample).order_by(m.TextSample.round.desc()).limit(1)
            ).first()
            sample = None if latest is None else TextSampleOut.model_validate(latest)
        return _json(SampleOut(sample=sample, every_evaluations=every)), ()

    return await _cached(request, services, "sample", render)


def _models_dir(services: Services) -> pathlib.Path | None:
    evaluation = services.config.live_evaluation
    return None if evaluation is None else evaluation.models_dir


@_cached_get("/api/training/models", ModelsOut, "training")
async def training_models(request: Request, services: ServicesDep) -> Response:
    """The measured majority models the verifier keeps (its newest few rounds, stages assembled),
    for `neuroshard-export --verifier URL --checkpoint ROUND`."""
    directory = _models_dir(services)

    def render() -> tuple[bytes, Headers]:
        kept = [] if directory is None else _kept_models(directory)
        return _json(ModelsOut(models=kept)), ()

    return await _cached(request, services, "models", render)


def _kept_models(directory: pathlib.Path) -> list[ModelFileOut]:
    kept = []
    for r in round_models(directory):
        path = round_model_path(directory, r)
        try:
            header, size = read_round_header(path), path.stat().st_size
        except (OSError, ValueError):  # pruned since it was listed
            continue
        stages = [
            StageModelOut(stage=p.stage, round=p.round, theta_hash=p.theta_hash) for p in header.provenance
        ]
        kept.append(
            ModelFileOut(round=r, bytes=size, tokenizer_sha256=header.tokenizer_sha256, stages=stages)
        )
    return kept


def _round_file(services: Services, round_: int) -> pathlib.Path:
    directory = _models_dir(services)
    if directory is None:
        raise HTTPException(404, "this verifier measures no models (--no-evaluation), so it keeps none")
    path = round_model_path(directory, round_)
    if not path.is_file():
        kept = ", ".join(map(str, round_models(directory))) or "none yet"
        raise HTTPException(404, f"round {round_} is not kept; kept: {kept}")
    return path


Round = Annotated[
    int, Path(alias="round", ge=0, le=2**31 - 1, description="Stage 0's round of the measured model.")
]


@router.get(
    "/api/training/models/{round}",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "The round file (safetensors)."},
        **_NOT_MODIFIED,
        404: {"model": ErrorOut},
    },
    tags=["training"],
)
def training_model_file(request: Request, services: ServicesDep, round_: Round) -> Response:
    """The measured majority model of a round as one safetensors file (fp32, stages assembled; its
    header names every stage's round and majority θ hash). Streamed: the file may be gigabytes."""
    path = _round_file(services, round_)
    try:
        f = path.open("rb")  # held open: a round pruned while it is sent is still sent whole
        header = read_round_header(path)
    except (OSError, ValueError) as exc:
        raise HTTPException(404, f"round {round_} is not kept ({exc})") from None
    # Same provenance, same weights: the identity of the content, whichever worker serves it.
    etag = etag_of(json.dumps([vars(p) for p in header.provenance], sort_keys=True).encode())
    cache = {"ETag": etag, "Cache-Control": f"public, max-age={int(services.config.reads.max_age_s)}"}
    if _matches(request.headers.get("if-none-match"), etag):
        f.close()
        return Response(status_code=304, headers=cache)
    size = os.fstat(f.fileno()).st_size

    def chunks() -> Iterator[bytes]:
        with f:
            while block := f.read(1 << 20):
                yield block

    headers = {
        **cache,
        "Content-Length": str(size),
        "Content-Disposition": f'attachment; filename="{path.name}"',
    }
    if request.scope.get(HEAD_SCOPE_KEY):  # HEAD: the headers, without reading gigabytes
        f.close()
        return Response(status_code=200, headers=headers, media_type="application/octet-stream")
    return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)


@router.get(
    "/api/training/models/{round}/tokenizer.json",
    response_class=Response,
    responses={200: {"content": {"application/json": {}}}, **_NOT_MODIFIED, 404: {"model": ErrorOut}},
    tags=["training"],
)
def training_model_tokenizer(request: Request, services: ServicesDep, round_: Round) -> Response:
    """The tokenizer the round's model was trained with (its sha256 is in the round file's header)."""
    path = _round_file(services, round_)
    try:
        sha = read_round_header(path).tokenizer_sha256
        body = round_tokenizer_path(path.parent, sha).read_bytes() if sha else None
    except (OSError, ValueError) as exc:
        raise HTTPException(404, f"round {round_}'s tokenizer is not kept ({exc})") from None
    if body is None:
        raise HTTPException(404, f"round {round_}'s model names no tokenizer")
    entry = Rendered(body, etag_of(body), 0.0, 0, ())
    return _serve(request, services, entry)


@_cached_get("/api/training/spot-checks", CoverageOut, "training")
async def spot_checks(
    request: Request,
    services: ServicesDep,
    window: Annotated[int, Query(ge=1, le=1000, description="Rounds the coverage counts over.")] = 20,
    limit: Limit = 100,
    offset: Offset = 0,
) -> Response:
    """Replay spot-check coverage: wallets checked in the last `window` rounds, each wallet's last
    check and chance of being drawn, and how likely a wallet lying in a fraction of its rounds
    has gone unnoticed."""
    replays = services.config.replay_checks
    budget = replays.budget if replays is not None else None
    rate = replays.sample_rate if replays is not None and budget is None else None

    def render() -> tuple[bytes, Headers]:
        with services.db.read() as session:
            c = coverage.coverage(
                session, window=window, sample_rate=rate, budget=budget, limit=limit, offset=offset
            )
        out = CoverageOut(
            mode="off" if replays is None else "budget" if budget is not None else "rate",
            budget_replicas=budget.replicas if budget is not None else None,
            sample_rate=rate,
            latest_round=c.latest_round,
            window_rounds=c.window_rounds,
            wallets_reporting=c.wallets_reporting,
            wallets_checked=c.wallets_checked,
            max_gap_rounds=c.max_gap_rounds,
            mean_check_probability=c.mean_check_probability,
            unnoticed=[UnnoticedOut.model_validate(u) for u in c.unnoticed],
            wallets=[WalletCoverageOut.model_validate(w) for w in c.wallets],
        )
        return _json(out), ()

    return await _cached(request, services, f"spot-checks:{window}:{limit}:{offset}", render)


FRAUD_PROOFS = "/api/fraud-proofs"


def _fraud_proof_out(row: m.FraudProof) -> FraudProofOut:
    return FraudProofOut(
        sha256=row.sha256, wallet_id=row.wallet_id, stage=row.stage, round=row.round, segment=row.segment,
        kind=row.kind, reason=row.reason, size_bytes=row.size_bytes, data_spans=row.data_spans, device=row.device,
        precision=row.precision, created_at=row.created_at, download=f"{FRAUD_PROOFS}/{row.sha256}",
    )  # fmt: skip


@_cached_get(FRAUD_PROOFS, FraudProofsOut, "fraud proofs", paged=True)
async def fraud_proofs(
    request: Request, services: ServicesDep, limit: Limit = 100, offset: Offset = 0
) -> Response:
    """Fraud proofs the replay checks found (verifier.fraudproofs), newest first: whose, of which
    kind (a failed segment replay, or a sender's log against a header it signed), which stage,
    round and segment, why, and where to download each. A proof re-checks alone with
    `neuroshard-check-proof FILE --network network.toml [--spans DATA_SPANS]` (a sender proof
    needs no --network). X-Total-Count is
    the number kept (the newest few); Link names the next page."""
    served = services.config.fraud_proofs_served is not None

    def render() -> tuple[bytes, Headers]:
        with services.db.read() as session:
            rows, total = fraudproofs.page(session, limit=limit, offset=offset)
            proofs = [_fraud_proof_out(r) for r in rows]
        return _json(FraudProofsOut(proofs=proofs, served=served)), _page_headers(
            request, total, limit, offset
        )

    return await _cached(request, services, f"fraud-proofs:{limit}:{offset}", render)


@router.get(
    FRAUD_PROOFS + "/{sha256}",
    response_class=Response,
    responses={
        200: {
            "content": {"application/octet-stream": {}},
            "description": "The proof's bytes (SegmentFraudProof.encode: safetensors; "
            "SenderFraudProof.encode: a NSSENDER1 line and canonical JSON).",
            "headers": {
                "ETag": {"description": "The proof's sha256, quoted.", "schema": {"type": "string"}},
                "Content-Length": {"description": "Size in bytes.", "schema": {"type": "integer"}},
            },
        },
        **_NOT_MODIFIED,
        404: {"model": ErrorOut, "description": "No such proof kept here, or not a sha256."},
    },
    tags=["fraud proofs"],
)
def fraud_proof_file(
    request: Request,
    services: ServicesDep,
    sha256: Annotated[str, Path(description="The proof's sha256: 64 lowercase hex digits.")],
) -> Response:
    """One fraud proof's bytes, streamed. Anyone can check it alone (a segment proof with the
    run's definition and, at stage 0, its data): `neuroshard-check-proof`."""
    if not fraudproofs.is_sha256(sha256):
        raise Refused(
            "not_found", f"a fraud proof is named by its sha256, 64 lowercase hex digits; not {sha256[:80]!r}"
        )
    directory = services.config.fraud_proofs_served
    if directory is None:
        raise Refused("not_held", "this verifier process keeps no fraud proofs (no fraud-proof directory)")
    with services.db.read() as session:  # only listed proofs: not an orphan, not one being pruned
        listed = session.get(m.FraudProof, sha256) is not None
    if not listed:
        raise Refused("not_found", f"fraud proof {sha256} is not kept here")
    try:
        # Held open: a proof pruned meanwhile is still sent whole.
        f = fraudproofs.proof_path(directory, sha256).open("rb")
    except OSError:
        raise Refused("not_found", f"fraud proof {sha256} is not kept here") from None
    etag = f'"{sha256}"'
    cache = {"ETag": etag, "Cache-Control": f"public, max-age={int(services.config.reads.max_age_s)}"}
    if _matches(request.headers.get("if-none-match"), etag):
        f.close()
        return Response(status_code=304, headers=cache)
    size = os.fstat(f.fileno()).st_size
    headers = {
        **cache,
        "Content-Length": str(size),
        "Content-Disposition": f'attachment; filename="{sha256}{fraudproofs.SUFFIX}"',
    }
    if request.scope.get(HEAD_SCOPE_KEY):
        f.close()
        return Response(status_code=200, headers=headers, media_type="application/octet-stream")

    def chunks() -> Iterator[bytes]:
        with f:
            while block := f.read(1 << 20):
                yield block

    return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)


@_cached_get("/api/peers", list[PeerOut], "tracker")
async def peers(
    request: Request,
    services: ServicesDep,
    stage: Annotated[int | None, Query(ge=0, lt=1024, description="Only replicas of this stage.")] = None,
) -> Response:
    """Live peers: registered, not refused, heartbeat within the TTL."""

    def render() -> tuple[bytes, Headers]:
        with services.db.read() as session:
            live = summary.live_peers(
                session, now=services.now(), ttl=services.config.peer_ttl_s, stage=stage
            )
        return _PEER_LIST.dump_json([PeerOut.model_validate(n) for n in live]), ()

    return await _cached(request, services, f"peers:{stage}", render)


@_cached_get("/api/nodes", list[NodeOut], "nodes", paged=True)
async def nodes(request: Request, services: ServicesDep, limit: Limit = 100, offset: Offset = 0) -> Response:
    """Registered wallets by wallet id, a page at a time, with status, reputation and last heartbeat.
    X-Total-Count is the number of wallets; Link names the next page."""

    def render() -> tuple[bytes, Headers]:
        with services.db.read() as session:
            records = summary.nodes(
                session, now=services.now(), ttl=services.config.peer_ttl_s, limit=limit, offset=offset
            )
            total = summary.wallet_count(session)
        body = _NODE_LIST.dump_json([NodeOut.model_validate(n) for n in records])
        return body, _page_headers(request, total, limit, offset)

    return await _cached(request, services, f"nodes:{limit}:{offset}", render)


@_cached_get("/api/nodes/{wallet}", NodeDetailOut, "nodes", missing=True)
async def node(
    request: Request,
    services: ServicesDep,
    wallet: Annotated[
        str, Path(pattern=r"^([0-9a-f]{20}|[0-9a-f]{64})$", description="Wallet id or full public key (hex).")
    ],
) -> Response:
    """One node: status, reputation, recent receipts and the verdicts that moved its reputation."""

    def render() -> tuple[bytes, Headers]:
        with services.db.read() as session:
            detail = summary.node_detail(session, wallet, now=services.now(), ttl=services.config.peer_ttl_s)
        if detail is None:
            raise HTTPException(404, f"wallet {wallet} is not registered")
        return _json(NodeDetailOut.model_validate(detail)), ()

    return await _cached(request, services, f"node:{wallet}", render)


@router.get(
    "/api/network",
    tags=["network"],
    response_class=Response,
    responses={
        200: {
            "content": {"application/json": {}},
            "description": "The run's definition as canonical JSON; "
            f"{NETWORK_SIGNATURE_HEADER} is the operator's hex Ed25519 signature of exactly these bytes, "
            f"{OPERATOR_HEADER} the operator's public key.",
        }
    },
)
def network(request: Request, services: ServicesDep) -> Response:
    """The run's definition (model, stages, DiLoCo, aggregation, data), signed by the operator key."""
    body = services.network_body
    entry = Rendered(
        body,
        etag_of(body),
        0.0,
        0,
        (
            (NETWORK_SIGNATURE_HEADER, services.network_signature),
            (OPERATOR_HEADER, services.config.operator.public_key_hex),
        ),
    )
    return _serve(request, services, entry)


@router.get(
    "/metrics", tags=["metrics"], response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}}
)
def metrics(services: ServicesDep) -> Response:
    """Prometheus text format. The database-derived gauges come through the read cache; the
    process's own counters are read live."""
    gauges = services.reads.get("metrics", lambda: (_gauges(services), ())).body
    out = Exposition()
    out.family(
        "neuroshard_http_requests_total",
        "counter",
        "HTTP requests by method, route template and status since the process started.",
        [
            ({"method": method, "route": route, "status": str(status)}, count)
            for (method, route, status), count in sorted(services.requests.snapshot().items())
        ],
    )
    lease = services.lease
    out.gauge("neuroshard_worker_pid", "This worker process's id (workers share the port).", os.getpid())
    out.gauge(
        "neuroshard_background_leader",
        "1 when this process runs the evaluations and spot checks (verifier.leader).",
        int(lease is not None and lease.is_leader),
    )
    out.family(
        "neuroshard_background_jobs",
        "gauge",
        "Background jobs running in this process (only the leader runs any).",
        [({"job": name}, n) for name, n in sorted((lease.running() if lease is not None else {}).items())],
    )
    out.gauge(
        "neuroshard_read_renders",
        "Read responses rendered from the database by this process.",
        services.reads.renders,
    )
    out.family(
        "neuroshard_write_groups_total",
        "counter",
        "Transactions of this process's group commit (verifier.groupcommit): all, and reruns (a "
        "group committed again without a write that raised, or tried again after a deadlock).",
        [({"outcome": "all"}, services.writes.groups), ({"outcome": "rerun"}, services.writes.retried)],
    )
    return Response(content=gauges + out.render().encode(), media_type=CONTENT_TYPE)


def _gauges(services: Services) -> bytes:
    with services.db.read() as session:
        verify = _verify(session, services)
        totals = summary.totals(session, now=services.now(), ttl=services.config.peer_ttl_s)
    out = Exposition()
    out.gauge(
        "neuroshard_training_verified",
        "1 when the measured held-out loss fell significantly.",
        int(verify.training_verified),
    )
    out.gauge(
        "neuroshard_global_loss_measured",
        "Latest held-out loss measured by the verifier (nats).",
        verify.global_loss,
    )
    out.gauge(
        "neuroshard_global_loss_reported",
        "Mean self-reported loss of the latest round (nats).",
        verify.reported_loss,
    )
    out.gauge("neuroshard_evaluations", "Held-out evaluations recorded.", verify.evaluations)
    out.gauge(
        "neuroshard_hash_agreement_rate",
        "Votes agreeing with their round's majority hash, recent settled rounds.",
        verify.hash_agreement_rate,
    )
    out.gauge(
        "neuroshard_sync_success_rate",
        "Receipts that started from the previous majority θ, recent settled rounds.",
        verify.sync_success_rate,
    )
    out.gauge("neuroshard_active_nodes", "Not refused, heartbeat within the peer TTL.", totals.active_nodes)
    out.gauge("neuroshard_registered_wallets", "Wallets ever registered.", totals.registered)
    out.gauge("neuroshard_refused_wallets", "Wallets refused for low reputation.", totals.refused)
    out.gauge("neuroshard_outer_rounds", "Highest round in any receipt + 1.", verify.rounds)
    out.family("neuroshard_receipts_total", "counter", "Receipts recorded.", [({}, totals.receipts)])
    out.family(
        "neuroshard_inner_steps_total",
        "counter",
        "Inner steps reported in receipts.",
        [({}, totals.inner_steps)],
    )
    out.family("neuroshard_tokens_total", "counter", "Tokens reported in receipts.", [({}, totals.tokens)])
    return out.render().encode()
