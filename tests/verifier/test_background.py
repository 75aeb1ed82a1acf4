"""The verifier's signed GET against nodes that answer badly: a body dripped a byte at a time is
cut off once it falls behind the rate floor, and a status line and headers dripped so are cut
off after the timeout, instead of holding the caller's thread for ever; an error reply's body
is read once, never waited for to a length."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from neuroshard.node.wallet import Wallet
from neuroshard.verifier.background import ERROR_TEXT_BYTES, BodyTooLarge, error_text, signed_get

OPERATOR = Wallet.from_token("background-operator")


@contextmanager
def _server(
    length: int, *, byte_every_s: float | None, status: str = "200 OK", drip_head: bool = False
) -> Iterator[str]:
    """A loopback HTTP server answering one request with `status` and `length` bytes: all at once,
    or one byte every `byte_every_s` (each within any socket timeout, so only a total limit stops
    it), from the status line on with `drip_head`."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            head = f"HTTP/1.1 {status}\r\nX-Pad: {'p' * 200}\r\nContent-Length: {length}\r\n\r\n".encode()
            if byte_every_s is None:
                conn.sendall(head + b"x" * length)
                return
            dripped = head + b"x" * length if drip_head else b"x" * length
            if not drip_head:
                conn.sendall(head)
            for i in range(len(dripped)):
                if stop.wait(byte_every_s):
                    return
                try:
                    conn.sendall(dripped[i : i + 1])
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


def test_a_dripped_status_line_and_headers_are_cut_off_after_the_timeout() -> None:
    with _server(10, byte_every_s=0.05, drip_head=True) as address:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no status line and headers within"):
            signed_get(OPERATOR, address, "/p2p/segment/0/0", max_bytes=10, timeout_s=0.5, now=time.time())
        assert time.monotonic() - started < 2.0  # the ~250-byte head alone would take 12 s


def test_an_error_reply_body_is_read_once_not_waited_for() -> None:
    with _server(1000, byte_every_s=0.05, status="404 Not Found") as address:
        with pytest.raises(urllib.error.HTTPError) as caught:
            signed_get(OPERATOR, address, "/p2p/segment/0/0", max_bytes=1000, timeout_s=2.0, now=time.time())
        assert caught.value.code == 404
        started = time.monotonic()
        text = error_text(caught.value)
        assert time.monotonic() - started < 1.0  # reading 300 bytes of it would take 15 s
        assert 0 < len(text) <= ERROR_TEXT_BYTES and set(text) == {"x"}
