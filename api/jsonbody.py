"""JSON request bodies parsed by the peer plane's strict parser, so both sides refuse alike.

FastAPI parses a JSON body with the standard library's `json.loads`, which takes the last of
two duplicate keys, accepts NaN and Infinity, and fails on deep nesting or a 5,000-digit
integer with an exception FastAPI turns into a bare "error parsing the body". Issue 19: the
peer plane refused duplicate keys while the verifier took the last one. Routes of
`StrictJSONRoute` parse with `node.p2p.wire.parse_json` instead (no duplicate keys, no NaN or
Infinity written or by overflow, nesting and number length bounded) and answer what it
refuses with 422 and the parser's sentence, before any schema validation.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute

from neuroshard.node.p2p.wire import MalformedMessage, parse_json

BODY_STATUS = 422
"""The verifier's status for a body that is not acceptable JSON (as FastAPI answers bad JSON)."""


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = parse_json(await self.body(), "request body")
            except MalformedMessage as exc:
                # An HTTPException passes through FastAPI's body reader unchanged; any other
                # exception would become a 400 without the reason.
                raise HTTPException(BODY_STATUS, str(exc)) from None
        return self._json


class StrictJSONRoute(APIRoute):
    """An APIRoute whose JSON body goes through `StrictJSONRequest.json`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict
