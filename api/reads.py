"""The read-only endpoints: tracker, training status, history, nodes, network, metrics."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Response
from sqlalchemy.orm import Session

from neuroshard.verifier import summary
from neuroshard.verifier.network import NETWORK_SIGNATURE_HEADER, OPERATOR_HEADER

from .metrics import CONTENT_TYPE, Exposition
from .schemas import (
    DiLoCoOut,
    ErrorOut,
    EvaluationOut,
    GlobalOut,
    HistoryOut,
    NodeDetailOut,
    NodeOut,
    PeerOut,
    RoundOut,
    StageOut,
    VerifyOut,
)
from .services import Services, get_services

router = APIRouter()
ServicesDep = Annotated[Services, Depends(get_services)]


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


@router.get("/api/training/verify", response_model=VerifyOut, tags=["training"])
def training_verify(services: ServicesDep) -> VerifyOut:
    """Is the global model really learning? Judged from the verifier's own held-out measurements only."""
    with services.db.read() as session:
        return _verify(session, services)


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


@router.get("/api/training/global", response_model=GlobalOut, tags=["training"])
def training_global(services: ServicesDep) -> GlobalOut:
    """The full picture: nodes, measured and reported loss, work done, agreement per stage, DiLoCo status."""
    cfg, net = services.config, services.config.network
    now = services.now()
    with services.db.read() as session:
        verify = _verify(session, services)
        totals = summary.totals(session, now=now, ttl=cfg.peer_ttl_s)
        live = summary.live_peers(session, now=now, ttl=cfg.peer_ttl_s)
        rounds = summary.recent_rounds(session, limit=4 * net.num_stages)
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
            outer_lr=net.diloco.outer_lr,
            outer_momentum=net.diloco.outer_momentum,
        ),
    )


@router.get("/api/training/history", response_model=HistoryOut, tags=["training"])
def training_history(services: ServicesDep) -> HistoryOut:
    """Measured loss per evaluation; agreement, sync and reported loss per (stage, round)."""
    with services.db.read() as session:
        evals = summary.evaluations(session)
        rounds = summary.recent_rounds(session, limit=services.config.history_rounds)
    return HistoryOut(
        evaluations=[EvaluationOut.model_validate(e) for e in evals],
        rounds=[RoundOut.model_validate(r) for r in rounds],
    )


@router.get("/api/peers", response_model=list[PeerOut], tags=["tracker"])
def peers(
    services: ServicesDep,
    stage: Annotated[int | None, Query(ge=0, lt=1024, description="Only replicas of this stage.")] = None,
) -> list[PeerOut]:
    """Live peers: registered, not refused, heartbeat within the TTL."""
    with services.db.read() as session:
        live = summary.live_peers(session, now=services.now(), ttl=services.config.peer_ttl_s, stage=stage)
    return [PeerOut.model_validate(n) for n in live]


@router.get("/api/nodes", response_model=list[NodeOut], tags=["nodes"])
def nodes(services: ServicesDep) -> list[NodeOut]:
    """Every registered wallet with its status, reputation and last heartbeat."""
    with services.db.read() as session:
        records = summary.nodes(session, now=services.now(), ttl=services.config.peer_ttl_s)
    return [NodeOut.model_validate(n) for n in records]


@router.get(
    "/api/nodes/{wallet}", response_model=NodeDetailOut, responses={404: {"model": ErrorOut}}, tags=["nodes"]
)
def node(
    services: ServicesDep,
    wallet: Annotated[
        str, Path(pattern=r"^([0-9a-f]{20}|[0-9a-f]{64})$", description="Wallet id or full public key (hex).")
    ],
) -> NodeDetailOut:
    """One node: status, reputation, recent receipts and the verdicts that moved its reputation."""
    with services.db.read() as session:
        detail = summary.node_detail(session, wallet, now=services.now(), ttl=services.config.peer_ttl_s)
    if detail is None:
        raise HTTPException(404, f"wallet {wallet} is not registered")
    return NodeDetailOut.model_validate(detail)


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
def network(services: ServicesDep) -> Response:
    """The run's definition (model, stages, DiLoCo, aggregation, data), signed by the operator key."""
    return Response(
        content=services.network_body,
        media_type="application/json",
        headers={
            NETWORK_SIGNATURE_HEADER: services.network_signature,
            OPERATOR_HEADER: services.config.operator.public_key_hex,
        },
    )


@router.get(
    "/metrics", tags=["metrics"], response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}}
)
def metrics(services: ServicesDep) -> Response:
    """Prometheus text format."""
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
    out.family(
        "neuroshard_http_requests_total",
        "counter",
        "HTTP requests by method, route template and status since the process started.",
        [
            ({"method": method, "route": route, "status": str(status)}, count)
            for (method, route, status), count in sorted(services.requests.snapshot().items())
        ],
    )
    return Response(content=out.render(), media_type=CONTENT_TYPE)
