"""`create_app(config)`: the verifier's FastAPI application.

Routes: signed writes (api/writes.py), read-only status (api/reads.py), /metrics, and the
dashboard at / (static files shipped in api/static/, no CDN). The database schema is
brought to Alembic head when the app starts, so an upgraded verifier migrates its existing
database in place.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from neuroshard.protocol.refusal import Refused
from neuroshard.verifier import ledger
from neuroshard.verifier.background import JobContext
from neuroshard.verifier.config import VerifierConfig
from neuroshard.verifier.evaluator import Evaluator
from neuroshard.verifier.housekeeping import Housekeeping
from neuroshard.verifier.leader import Job, LeaderLease
from neuroshard.verifier.replaycheck import ReplayChecker
from neuroshard.verifier.vocab import VocabWatch

from . import membership, reads, writes
from .cache import HeadAsGet
from .metrics import CountRequests
from .refusals import refusal_response
from .services import Services

log = logging.getLogger("neuroshard.verifier")

STATIC_DIR = Path(__file__).parent / "static"
VERSION = "0.1.0"


class BodySizeLimit:
    """413 for bodies over `max_bytes`: from Content-Length up front, or counted while streaming
    (chunked uploads), before any route reads or parses a byte past the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            response = JSONResponse({"detail": self._detail()}, status_code=413)
            await response(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise StarletteHTTPException(413, self._detail())
            return message

        await self.app(scope, limited, send)

    def _detail(self) -> str:
        return f"request body larger than {self.max_bytes} bytes"


def create_app(config: VerifierConfig) -> FastAPI:
    """The verifier process wired once from `config`: the routes' Services (api.services) and
    the background jobs, which share one JobContext (verifier.background) and run only in the
    process that holds the leader lease (verifier.leader)."""
    services = Services.build(config)

    def start() -> None:
        services.db.upgrade()
        with services.db.write() as session:
            ledger.purge_nonces(session, now=services.now())

    # The background jobs' collaborators, once for all of them; each job adds its own config.
    ctx = JobContext(
        db=services.db, network=config.network, operator=config.operator, log=log.info,
        reputation=config.reputation, clock=config.clock,
    )  # fmt: skip
    jobs: list[Callable[[], Job]] = []
    if config.live_evaluation is not None:
        evaluation = config.live_evaluation
        jobs.append(lambda: Evaluator(ctx, config=evaluation, peer_ttl_s=config.peer_ttl_s))
    if config.replay_checks is not None:
        replays = config.replay_checks
        jobs.append(lambda: ReplayChecker(ctx, config=replays, membership=config.membership))
    if config.vocab_watch is not None:
        vocab = config.vocab_watch
        jobs.append(lambda: VocabWatch(ctx, config=vocab, membership=config.membership))
    jobs.append(lambda: Housekeeping(ctx, ledger_config=services.ledger, config=config.housekeeping))
    # Evaluations, replay spot checks, vocabulary schedules and the housekeeping sweep run in one
    # process of all that share the database; each job has its own threads, so a measurement never holds up a request.
    lease = LeaderLease(services.db, jobs, config=config.lease, log=log.info)
    services.lease = lease

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Sync routes run on anyio's thread pool (40 threads by default); the database pool is
        # sized to this number plus the group-commit writers and background threads
        # (api.services), so no thread waits for a connection.
        anyio.to_thread.current_default_thread_limiter().total_tokens = config.request_threads
        await run_in_threadpool(start)
        services.writes.start()
        await run_in_threadpool(lease.start)
        # What start-up allocated (torch, SQLAlchemy's mappers, the app) lives as long as the
        # process: frozen out of the collector's sight, a full collection no longer walks it
        # while every request thread waits (issue 15's write load, 1,000 nodes: writes' p99
        # 238-272 ms before, 110-183 ms after, in one run before and two after).
        gc.collect()
        gc.freeze()
        yield
        await run_in_threadpool(lease.stop)
        await run_in_threadpool(services.writes.close)
        await run_in_threadpool(services.reads.close)
        services.db.dispose()

    app = FastAPI(
        title="NeuroShard verifier",
        version=VERSION,
        description=(
            "VerifierClient, signed work receipts, hash agreement, reputation and the measured training "
            "verdict of a NeuroShard run. Writes are signed (see neuroshard.protocol.signing); reads are open."
        ),
        lifespan=lifespan,
    )
    app.state.services = services
    app.state.lease = lease

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Not FastAPI's default: it echoes the offending input, which may be NaN or Infinity
        # (Python's json accepts them) and then fails to encode, turning a 422 into a 500.
        errors = [
            {"type": str(e.get("type")), "loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg"))}
            for e in exc.errors()
        ]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> JSONResponse:
        return refusal_response(exc)

    app.include_router(writes.router)
    app.include_router(reads.router)
    app.include_router(membership.router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    # Added last = outermost: sizes are checked before anything else, every request is counted.
    app.add_middleware(HeadAsGet)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(CountRequests, counter=services.requests)
    return app
