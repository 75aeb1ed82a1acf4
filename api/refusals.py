"""The verifier's HTTP answer to a `Refused`: the status its code maps to, and a JSON body.

Bookkeeping code (verifier.ledger, verifier.members, the protocol's parsers and signature
checks) raises ``neuroshard.protocol.refusal.Refused(code, detail)`` and knows nothing of
HTTP; `STATUS` here is the one place a verifier refusal becomes a status. The body is
``{"detail": <sentence>, "error": <code>}`` (FastAPI's ``detail`` shape, plus the code), with
a Retry-After header when the refusal says how long to wait.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

from neuroshard.protocol import refusal
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.schema import Message

STATUS: Mapping[str, int] = {
    # a body that is not the schema, or a value out of range: 422, as FastAPI answers bad bodies
    refusal.MALFORMED: 422,
    refusal.INVALID: 422,
    refusal.UNSIGNED: 401,
    refusal.BAD_AUTH: 401,
    refusal.STALE: 401,
    refusal.BAD_SIGNATURE: 401,
    refusal.REPLAYED: 409,
    refusal.BUSY: 503,
    refusal.TOO_LARGE: 413,
    refusal.UNKNOWN_WALLET: 403,
    "wallet_refused": 403,
    "not_operator": 403,
    "pow_required": 403,
    "not_on_roster": 403,
    "key_mismatch": 409,
    "wrong_stage": 409,
    "conflict": 409,
    "not_found": 404,
    "not_held": 404,
    "not_a_roster": 400,
    "bad_roster": 422,
    "rate_limited": 429,
}
"""The verifier's HTTP status for each refusal code; a code not listed answers 400."""


def refusal_response(exc: Refused) -> JSONResponse:
    headers = None if exc.retry_after_s is None else {"Retry-After": str(math.ceil(exc.retry_after_s))}
    return JSONResponse(
        {"detail": exc.detail, "error": exc.code}, status_code=STATUS.get(exc.code, 400), headers=headers
    )


def request_body(cls: type[Message]) -> dict[str, Any]:
    """OpenAPI `openapi_extra` for a route whose JSON body is `cls` (parsed in the handler from the
    signed bytes, so FastAPI does not see it): the schema derived from the message's declaration."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": cls.json_schema()}},
        }
    }
