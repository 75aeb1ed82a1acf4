"""The verifier's signed GET against nodes that answer badly: a body dripped a byte at a time is
cut off once it falls behind the rate floor, instead of holding the caller's thread for ever."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from neuroshard.node.wallet import Wallet
from neuroshard.verifier.background import BodyTooLarge, signed_get

OPERATOR = Wallet.from_token("background-operator")


@contextmanager
def _server(length: int, *, byte_every_s: float | None) -> Iterator[str]:
    """A loopback HTTP server answering one request with `length` bytes: all at once, or one byte
    every `byte_every_s` (each within any socket timeout, so only a total limit stops it)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {length}\r\n\r\n".encode())
            if byte_every_s is None:
                conn.sendall(b"x" * length)
                return
            for _ in range(length):
                if stop.wait(byte_every_s):
                    return
                try:
                    conn.sendall(b"x")
                except OSError:
                    return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
        thread.join(timeout=5)


@pytest.fixture
def dripping() -> Iterator[str]:
    with _server(1000, byte_every_s=0.05) as address:
        yield address


@pytest.fixture
def prompt() -> Iterator[str]:
    with _server(1000, byte_every_s=None) as address:
        yield address


def test_a_dripped_body_is_cut_off_at_the_rate_floor(dripping: str) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="slower than"):
        signed_get(
            OPERATOR, dripping, "/p2p/segment/0/0", max_bytes=1000, timeout_s=0.5, now=time.time(),
            min_bytes_per_s=100,
        )  # fmt: skip
    assert time.monotonic() - started < 2.0  # the whole body would take 50 s


def test_a_body_sent_at_once_arrives_whole(prompt: str) -> None:
    body, headers = signed_get(
        OPERATOR,
        prompt,
        "/p2p/segment/0/0",
        max_bytes=1000,
        timeout_s=0.5,
        now=time.time(),
        min_bytes_per_s=100,
    )
    assert body == b"x" * 1000 and headers["Content-Length"] == "1000"


def test_a_body_over_max_bytes_is_refused(prompt: str) -> None:
    with pytest.raises(BodyTooLarge):
        signed_get(OPERATOR, prompt, "/p2p/segment/0/0", max_bytes=999, timeout_s=0.5, now=time.time())
