"""The verifier inside a node process: `neuroshard-node --token T` with no `--join`.

uvicorn serves the API and dashboard from a thread on loopback, backed by SQLite under
the node's home, with the live evaluator on (verifier.evaluator). Started by the node's
composition root (cli.node) when it runs the embedded default.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from neuroshard.api.app import create_app
from neuroshard.verifier.config import VerifierConfig
from neuroshard.verifier.evaluator import EvaluatorConfig, models_dir_for
from neuroshard.verifier.network import NetworkDefinition, load_operator_key

STARTUP_TIMEOUT_S = 30.0


class _ToNodeLog(logging.Handler):
    """The verifier's own lines (the evaluator's measurements, uvicorn's warnings) in the node's
    output. Until the server is up it holds errors back (the last one is kept), so that a server
    that cannot start says why in the one line its caller logs."""

    def __init__(self, log: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self._log = log
        self._held: list[str] | None = []  # None once the server is up

    @property
    def last_error(self) -> str | None:
        return self._held[-1] if self._held else None

    def started(self) -> None:
        """The server is up: errors held back so far were not fatal after all, so they are shown."""
        held, self._held = self._held or [], None
        for message in held:
            self._log(f"verifier: {message}")

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.levelno >= logging.ERROR and self._held is not None:
            self._held.append(message)
            return
        self._log(f"verifier: {message}")


ROUTED = ("neuroshard.verifier", "uvicorn.error")
"""The loggers whose lines go to the node's output while an embedded verifier runs."""


def _unroute() -> None:
    """Give the routed loggers back: a process that stopped its verifier (a node's run in a test,
    say) must not keep printing other verifiers' lines as its own."""
    for name in ROUTED:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _ToNodeLog)]:
            logger.removeHandler(old)
        logger.propagate = True


def _route_to(logger_name: str, handler: _ToNodeLog, level: int) -> None:
    logger = logging.getLogger(logger_name)
    for old in [h for h in logger.handlers if isinstance(h, _ToNodeLog)]:
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


@dataclass
class EmbeddedVerifier:
    url: str
    """http://127.0.0.1:PORT"""
    operator_key_hex: str
    """The key that signs GET /api/network: the node pins it (it made it)."""
    _server: object
    _thread: threading.Thread

    def stop(self) -> None:
        self._server.should_exit = True  # type: ignore[attr-defined]
        self._thread.join(timeout=10.0)
        _unroute()


def start_embedded_verifier(
    *,
    home: Path,
    network: NetworkDefinition,
    port: int,
    log: Callable[[str], None],
    fresh: bool = False,
    host: str = "127.0.0.1",
    log_level: str = "warning",
) -> EmbeddedVerifier:
    """Serve the verifier on host:port from a daemon thread; returns once it accepts requests.
    Raises OSError when it cannot start (the port is taken, most often)."""
    import uvicorn

    home.mkdir(parents=True, exist_ok=True)
    to_node = _ToNodeLog(log)
    _route_to("neuroshard.verifier", to_node, logging.INFO)
    # uvicorn's own lines go the same way (log_config=None below: it installs no stderr
    # handler), so a taken port is one line from the node, not a second one from uvicorn.
    _route_to("uvicorn.error", to_node, getattr(logging, log_level.upper()))
    operator = load_operator_key(home / "operator.key", create=True)
    # One database per run definition: another model size or H is another run, whose rounds
    # and measurements must not mix with this one's.
    database = home / f"verifier-{hashlib.sha256(network.canonical_bytes()).hexdigest()[:12]}.sqlite3"
    if fresh and database.exists():  # the node starts over at round 0: so does its verifier
        kept = database.with_name(f"{database.stem}.{int(time.time())}.sqlite3")
        database.rename(kept)
        log(f"verifier: --fresh: the previous run's database is kept as {kept}")
    config = VerifierConfig(
        database_url=f"sqlite:///{database.expanduser()}",
        network=network,
        operator=operator,
        live_evaluation=EvaluatorConfig(cache_dir=home / "cache", models_dir=models_dir_for(home, network)),
    )
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config), host=host, port=port, log_level=log_level, log_config=None, access_log=False
        )
    )
    failed: list[BaseException] = []

    def serve() -> None:
        # uvicorn installs signal handlers only on the main thread; the node keeps its own.
        try:
            asyncio.run(server.serve())
        except BaseException as exc:  # SystemExit(1) when the port is taken
            failed.append(exc)

    thread = threading.Thread(target=serve, name="embedded-verifier", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            _unroute()
            reason = to_node.last_error or (type(failed[0]).__name__ if failed else "no answer")
            raise OSError(f"the embedded verifier could not listen on {host}:{port}: {reason}")
        time.sleep(0.05)
    to_node.started()
    return EmbeddedVerifier(f"http://{host}:{port}", operator.public_key_hex, server, thread)
