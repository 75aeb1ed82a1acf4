"""Membership routes (issue 19): the signed member lists, the operator's roster, admission terms.

| route                              | what                                                         |
|------------------------------------|--------------------------------------------------------------|
| GET  /api/stages/{stage}/members   | protocol.roster.MemberList of the stage at its epoch, signed      |
| GET  /api/roster                   | the operator's roster in force (protocol.roster.Roster), or 404   |
| GET  /api/admission                | policy, rounds and spot checks to earn admission, PoW bits    |
| POST /api/admin/roster             | operator-signed request carrying an operator-signed Roster    |

Member lists are rendered through the read cache like every read (api.cache): a list is
re-signed when the stage's membership changed, or when its expiry window moved on.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Request, Response

from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.roster import Roster
from neuroshard.verifier import ledger, members

from .cache import Rendered, cached_response, etag_of
from .schemas import AdmissionOut, ErrorOut, MemberListOut, WriteAck
from .services import Services, get_services
from .writes import Signed

router = APIRouter(tags=["membership"])
ServicesDep = Annotated[Services, Depends(get_services)]

_ROSTER_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorOut, "description": "The body is not a roster (strict JSON, exact schema)."},
    401: {"model": ErrorOut, "description": "Unsigned, stale or forged request."},
    403: {"model": ErrorOut, "description": "The request is not signed by the operator key."},
    409: {"model": ErrorOut, "description": "A roster of this or a newer version is already held."},
    422: {
        "model": ErrorOut,
        "description": "Not signed by the operator, another network, expired, bad stage.",
    },
}


@router.get(
    "/api/stages/{stage}/members",
    response_model=MemberListOut,
    responses={404: {"model": ErrorOut}},
)
def stage_members(
    request: Request,
    services: ServicesDep,
    stage: Annotated[int, Path(ge=0, lt=1024, description="The stage.")],
) -> Response:
    """The stage's admitted members and probationers at its current epoch, signed by the verifier's
    key (the operator key of GET /api/network): a node counts only `admitted` in its rounds."""
    cfg = services.config
    if stage >= cfg.network.num_stages:
        raise HTTPException(404, f"stage {stage} does not exist: this network has {cfg.network.num_stages}")

    def render() -> tuple[bytes, tuple[tuple[str, str], ...]]:
        now = services.now()
        with services.db.read() as session:
            doc = members.member_list(
                session, stage, cfg.membership, network=cfg.network.name, signer=cfg.operator, now=now
            )
        return doc.to_json(), ()

    # The expiry window is in the key: a list is re-signed when its window moves on.
    window = members.expiry(services.now(), cfg.membership.list_ttl_s)
    return cached_response(
        request, services.reads.get(f"members:{stage}:{window}", render), max_age_s=cfg.reads.max_age_s
    )


@router.get("/api/roster", responses={200: {"content": {"application/json": {}}}, 404: {"model": ErrorOut}})
def roster(request: Request, services: ServicesDep) -> Response:
    """The operator-signed roster in force (protocol.roster.Roster), exactly as accepted."""
    with services.db.read() as session:
        held = members.current_roster(session, now=services.now())
    if held is None:
        raise HTTPException(404, "no roster is in force")
    body = held.to_json()
    return cached_response(
        request, Rendered(body, etag_of(body), 0.0, 0), max_age_s=services.config.reads.max_age_s
    )


@router.get("/api/admission", response_model=AdmissionOut)
def admission(services: ServicesDep) -> AdmissionOut:
    """What a new wallet must do to count in this run."""
    cfg = services.config
    with services.db.read() as session:
        held = members.current_roster(session, now=services.now())
    limit = cfg.registration_limit
    return AdmissionOut(
        network=cfg.network.name,
        policy=cfg.membership.policy,
        admission_rounds=cfg.membership.admission_rounds,
        spot_checks_required=cfg.membership.spot_checks_required,
        pow_bits=cfg.registration_pow_bits,
        new_wallets_per_source_per_hour=None if limit is None else limit.per_hour,
        roster_version=None if held is None else held.version,
    )


@router.post(
    "/api/admin/roster", response_model=WriteAck, responses=_ROSTER_ERRORS, tags=["operator"], status_code=200
)
def post_roster(auth: Signed, services: ServicesDep) -> WriteAck:
    """Operator only: install a roster (protocol.roster.Roster, signed by the operator key). A newer
    version replaces the one in force; an older one, or an expired one, is refused."""
    cfg = services.config
    if auth.signed.public_key_hex != cfg.operator.public_key_hex:
        raise Refused("not_operator", "only the operator key may install a roster")
    try:
        doc = Roster.from_json(auth.body)
    except Refused as exc:
        raise Refused("not_a_roster", f"not a roster: {exc}") from None
    now = services.now()
    with services.db.write() as session:
        ledger.use_nonce(session, auth.signed, window_s=cfg.freshness_window_s)
        status = members.accept_roster(
            session,
            doc,
            operator_key=cfg.operator.public_key_hex,
            network=cfg.network.name,
            num_stages=cfg.network.num_stages,
            now=now,
        )
    return WriteAck(
        status="duplicate" if status == "duplicate" else "accepted", wallet_id=auth.signed.wallet_id
    )
