"""What the verifier's background jobs share (verifier.evaluator, verifier.datacheck,
verifier.replaycheck, verifier.vocab).

Each job is built from one `JobContext` (the database, the run's network definition, the
operator wallet, the log, the clock, the reputation config; built once by the verifier's
composition root, api.app.create_app, from its VerifierConfig) and its own config. It polls on a
thread of its own (`PollingThread`), opens the run's data set from the network definition
(`open_run_dataset`), and fetches material from nodes' peer plane with GETs signed by the
operator wallet (`signed_get`).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path
from typing import Any

from neuroshard.data import Dataset, open_dataset
from neuroshard.data.dataset import open_remote_dataset
from neuroshard.data.fetch import FetchConfig
from neuroshard.node.p2p.auth import sign_request
from neuroshard.node.wallet import Wallet

from .db import Database
from .network import NetworkDefinition
from .reputation import ReputationConfig

Log = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class JobContext:
    """What every background job of the verifier works with, whatever its own config says.
    Built once per verifier process (api.app.create_app) and handed to each job."""

    db: Database
    """The verifier's database: receipts read, verdicts and measurements written."""
    network: NetworkDefinition
    """The run's definition: model, stages, DiLoCo, data set and its publisher key."""
    operator: Wallet
    """The operator wallet: signs the jobs' peer-plane GETs and seeds their sampling."""
    log: Log
    """Where the jobs' lines go (the neuroshard.verifier logger, a list in tests)."""
    reputation: ReputationConfig = field(default_factory=ReputationConfig)
    """What a failed check costs and where a wallet is refused (ledger.record_receipt_check)."""
    clock: Callable[[], float] = time.time
    """Unix seconds; injected so tests can move time."""


@dataclass
class PollingThread:
    """Calls `step` every `period_s` on a daemon thread until stopped. An exception in one call
    is logged with `prefix` and polling goes on: one bad fetch, receipt or database hiccup must
    not end the job."""

    name: str
    step: Callable[[], None]
    period_s: float
    log: Log
    prefix: str
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Ask the loop to end and wait up to `timeout_s` for the call in progress."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.step()
            except Exception as exc:
                self.log(f"{self.prefix}: {type(exc).__name__}: {exc}")


def open_run_dataset(
    network: NetworkDefinition, cache_dir: Path | None, log: Log, *, needed_by: str
) -> Dataset:
    """The run's data set, verified against the network's publisher key. One served over HTTP is
    cached in `cache_dir`, without which it cannot be opened (`needed_by` says who asked)."""
    key = bytes.fromhex(network.publisher_key)
    url = network.manifest_url
    if url.startswith(("http://", "https://")):
        if cache_dir is None:
            raise ValueError(f"the data set is served over HTTP: {needed_by} a cache directory")
        return open_remote_dataset(url, key, cache_dir, config=FetchConfig(), log=log)
    return open_dataset(Path(url), key)


class BodyTooLarge(ValueError):
    """A node answered with more bytes than the material asked for can take."""


MIN_BYTES_PER_S = 256 << 10
"""The slowest a node may send a body, on average, once `timeout_s` has passed (2 Mbit/s): a
reply that drips a byte per socket timeout would otherwise hold the caller's thread for ever."""
READ_CHUNK = 1 << 20
ERROR_TEXT_BYTES = 300
"""What an error reply's body may add to a log line or verdict."""


class _HeadDeadline:
    """Makes a connection's `getresponse` give up after `head_s`: the status line and headers are
    read by http.client line by line, each read bounded only by the socket timeout, so a node
    dripping them a byte at a time would hold the caller for ever. At the deadline the socket
    is shut down (the blocked read returns) and TimeoutError is raised; a reply in time is
    returned untouched (the lock keeps a late timer from cutting a body being read)."""

    sock: socket.socket | None
    _head_s: float

    def getresponse(self) -> http.client.HTTPResponse:
        lock, state = threading.Lock(), {"cut": False, "done": False}

        def cut() -> None:
            with lock:
                if state["done"]:
                    return
                state["cut"] = True
                if self.sock is not None:
                    with contextlib.suppress(OSError):
                        self.sock.shutdown(socket.SHUT_RDWR)

        timer = threading.Timer(self._head_s, cut)
        timer.daemon = True
        timer.start()
        try:
            reply: http.client.HTTPResponse = super().getresponse()  # type: ignore[misc]
        except (OSError, http.client.HTTPException) as exc:
            with lock:
                state["done"] = True
            if state["cut"]:
                raise TimeoutError(f"no status line and headers within {self._head_s:.0f} s") from exc
            raise
        finally:
            timer.cancel()
        with lock:
            state["done"] = True
            late = state["cut"]
        if late:  # cut after the headers were in, before this returned: the body is gone
            reply.close()
            raise TimeoutError(f"no status line and headers within {self._head_s:.0f} s")
        return reply


class _HTTPConnection(_HeadDeadline, http.client.HTTPConnection):
    def __init__(self, *args: Any, head_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_s = head_s


class _HTTPSConnection(_HeadDeadline, http.client.HTTPSConnection):
    def __init__(self, *args: Any, head_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_s = head_s


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, head_s: float) -> None:
        super().__init__()
        self.head_s = head_s

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_HTTPConnection, req, head_s=self.head_s)  # type: ignore[arg-type]


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, head_s: float) -> None:
        super().__init__()
        self.head_s = head_s

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_HTTPSConnection, req, head_s=self.head_s)  # type: ignore[arg-type]


def error_text(exc: urllib.error.HTTPError) -> str:
    """At most ERROR_TEXT_BYTES of an error reply's body, in one socket read at most (a node could
    drip a body read to a length), for a log line or verdict; the reply is closed."""
    reply = exc.fp
    try:
        data = reply.read1(ERROR_TEXT_BYTES) if reply is not None and hasattr(reply, "read1") else b""
    except (OSError, ValueError, http.client.HTTPException):
        data = b""
    finally:
        exc.close()
    return bytes(data).decode(errors="replace")


def signed_get(
    operator: Wallet,
    address: str,
    path: str,
    *,
    max_bytes: int,
    timeout_s: float,
    now: float,
    min_bytes_per_s: float = MIN_BYTES_PER_S,
) -> tuple[bytes, Message]:
    """GET `path` from the node at `address`, signed by the operator like any peer request
    (node.p2p.auth): the body and the reply's headers (case-insensitive lookups). Raises
    urllib.error.HTTPError on an error status, OSError or ValueError when there is no usable
    answer, BodyTooLarge past `max_bytes`.

    `timeout_s` bounds each socket operation, the status line and headers must be in within
    `timeout_s` of the request, and the body must arrive at `min_bytes_per_s` on average after
    the first `timeout_s`: TimeoutError (an OSError) otherwise. A reply without Content-Length
    is refused (chunked framing is read outside this loop). An error reply's body is the
    caller's to read, with `error_text`."""
    headers = sign_request(operator, "GET", path, b"", now)
    request = urllib.request.Request(address.rstrip("/") + path, headers=headers)
    opener = urllib.request.build_opener(_HTTPHandler(timeout_s), _HTTPSHandler(timeout_s))
    started = time.monotonic()
    with opener.open(request, timeout=timeout_s) as reply:
        if reply.headers.get("Content-Length") is None:  # a chunked body's framing reads unbounded
            raise ValueError("a reply without Content-Length (nodes always send one)")
        body = bytearray()
        while True:
            chunk = reply.read1(READ_CHUNK)  # at most one socket read: returns what has arrived
            if not chunk:
                break
            body += chunk
            if len(body) > max_bytes:
                raise BodyTooLarge(f"a body over {max_bytes} bytes")
            elapsed = time.monotonic() - started
            if elapsed > timeout_s + len(body) / min_bytes_per_s:
                raise TimeoutError(
                    f"{len(body)} bytes in {elapsed:.0f} s: slower than {min_bytes_per_s / 1024:.0f} KiB/s"
                )
        return bytes(body), reply.headers
