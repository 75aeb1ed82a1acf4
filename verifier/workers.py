"""`neuroshard-verifier --workers N`: N worker processes accepting on one listening socket.

The parent binds the socket once and starts each worker as `python -m neuroshard.cli.verifier
… --worker-fd FD` with the socket's descriptor inherited (`pass_fds`); the kernel hands each
new connection to whichever worker accepts first. Workers are plain subprocesses that rebuild
their configuration from the same flags: nothing is pickled between processes (uvicorn's own
multi-worker mode pickles its configuration to spawned children).

A worker that dies (SIGKILL, out of memory) is started again; its requests in flight are
lost to their clients, which retry, and nothing it acknowledged is lost, since every 2xx
follows a database commit. Background work moves to another worker through the lease
(verifier.leader). The parent stops on SIGTERM or SIGINT, passing the signal on.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

Log = Callable[[str], None]


@dataclass(kw_only=True)
class SupervisorConfig:
    workers: int
    """Worker processes to keep running."""
    check_s: float = 0.2
    """How often the parent looks for a dead worker."""
    max_restarts: int = 20
    """Restarts allowed within `restart_window_s`; beyond that the parent stops everything and
    fails (a worker that dies at start, e.g. a bad --db, would otherwise be restarted forever)."""
    restart_window_s: float = 60.0
    stop_timeout_s: float = 15.0
    """How long workers get to finish after SIGTERM before SIGKILL."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"SupervisorConfig: workers must be ≥ 1, got {self.workers}")


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The one listening socket all workers accept on (IPv4 or IPv6 by the host's form)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


class Supervisor:
    """Keeps `config.workers` processes of `worker_argv(fd)` running until told to stop."""

    def __init__(self, config: SupervisorConfig, worker_argv: Callable[[int], list[str]], log: Log) -> None:
        self.config = config
        self._argv = worker_argv
        self._log = log
        self._stopping = False
        self.workers: list[subprocess.Popen[bytes]] = []

    def _spawn(self, sock: socket.socket) -> subprocess.Popen[bytes]:
        fd = sock.fileno()
        process = subprocess.Popen(self._argv(fd), pass_fds=(fd,))
        self._log(f"worker {process.pid} started")
        return process

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._stopping = True

    def run(self, sock: socket.socket) -> int:
        """Serve until SIGTERM/SIGINT (0) or too many restarts (1)."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        restarts: deque[float] = deque()
        code = 0
        try:
            self.workers = [self._spawn(sock) for _ in range(self.config.workers)]
            while not self._stopping:
                time.sleep(self.config.check_s)
                for i, process in enumerate(self.workers):
                    if self._stopping or process.poll() is None:
                        continue
                    now = time.monotonic()
                    while restarts and now - restarts[0] > self.config.restart_window_s:
                        restarts.popleft()
                    if len(restarts) >= self.config.max_restarts:
                        self._log(
                            f"worker {process.pid} exited with {process.returncode}; "
                            f"{len(restarts)} restarts in {self.config.restart_window_s:.0f} s: giving up"
                        )
                        self._stopping, code = True, 1
                        break
                    restarts.append(now)
                    self._log(f"worker {process.pid} exited with {process.returncode}; starting another")
                    self.workers[i] = self._spawn(sock)
        finally:
            self._stop_all()
            for s, handler in previous.items():
                signal.signal(s, handler)
        return code

    def _stop_all(self) -> None:
        for process in self.workers:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_timeout_s
        for process in self.workers:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"worker {process.pid} did not stop in time: killed", file=sys.stderr, flush=True)
                process.kill()
                process.wait()
