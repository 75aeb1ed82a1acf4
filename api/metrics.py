"""GET /metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

Gauges come from the database at scrape time; the only in-process counter is HTTP requests
by method, route template and status (route templates, not raw paths, so a scan of random
URLs cannot blow up the label set).
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RequestCounter:
    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str, int]] = Counter()
        self._lock = threading.Lock()

    def add(self, method: str, route: str, status: int) -> None:
        with self._lock:
            self._counts[(method, route, status)] += 1

    def snapshot(self) -> dict[tuple[str, str, int], int]:
        with self._lock:
            return dict(self._counts)


class CountRequests:
    """ASGI middleware feeding a RequestCounter."""

    def __init__(self, app: ASGIApp, counter: RequestCounter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.counter.add(scope.get("method", "?"), template, status)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float | int | None) -> str:
    if value is None:
        return "NaN"
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


class Exposition:
    """Accumulates metric families and renders them."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(
        self,
        name: str,
        kind: str,
        help_text: str,
        samples: Iterable[tuple[dict[str, str], float | int | None]],
    ) -> None:
        self._lines.append(f"# HELP {name} {help_text}")
        self._lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            suffix = f"{{{label_text}}}" if label_text else ""
            self._lines.append(f"{name}{suffix} {_number(value)}")

    def gauge(self, name: str, help_text: str, value: float | int | None) -> None:
        self.family(name, "gauge", help_text, [({}, value)])

    def render(self) -> str:
        return "\n".join(self._lines) + "\n"
