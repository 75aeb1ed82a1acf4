"""A node that ends its run keeps serving while replicas a little behind still read its last round."""

from __future__ import annotations

import threading
import time

from neuroshard.node.outer.port import object_name
from neuroshard.node.p2p.plane import PeerPlane, PeerPlaneConfig
from neuroshard.node.wallet import Wallet

NAME = object_name(0, 7, "commit")


def _plane(token: str, stop: threading.Event | None = None) -> PeerPlane:
    config = PeerPlaneConfig(port=0, request_timeout_s=5.0, connect_timeout_s=2.0, gossip_interval_s=60.0)
    return PeerPlane(config, Wallet.from_token(token), stage=0, log=lambda line: None, stop=stop)


def _introduce(a: PeerPlane, b: PeerPlane) -> None:
    now = time.time()
    a.node.peers.merge([b.node.own_record()], now)
    b.node.peers.merge([a.node.own_record()], now)


def _timed_linger(plane: PeerPlane, **kwargs: float) -> tuple[threading.Thread, list[float]]:
    took: list[float] = []

    def run() -> None:
        began = time.monotonic()
        plane.linger(**kwargs)
        took.append(time.monotonic() - began)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, took


def test_linger_serves_until_the_readers_are_quiet() -> None:
    ending, behind = _plane("linger-ending"), _plane("linger-behind")
    with ending, behind:
        _introduce(ending, behind)
        ending._call(ending._store.publish(NAME, b"the last round's commitment"), timeout=5.0)
        thread, took = _timed_linger(ending, max_s=20.0, idle_s=1.0)
        reads = []
        for _ in range(3):  # a replica behind reads the round, with pauses shorter than idle_s
            time.sleep(0.6)
            reads.append(
                behind._call(behind._store.fetch(ending.wallet.public_key_hex, NAME, max_bytes=1024), 5.0)
            )
        thread.join(timeout=25.0)
        assert reads == [b"the last round's commitment"] * 3
        assert took and 2.8 <= took[0] < 10.0  # 1.8 s of reads, then 1 s quiet (not the 20 s cap)


def test_linger_ends_after_idle_s_without_reads_and_at_once_without_peers() -> None:
    alone, other = _plane("linger-alone"), _plane("linger-other")
    with alone, other:
        began = time.monotonic()
        alone.linger(max_s=20.0, idle_s=1.0)
        assert time.monotonic() - began < 0.5  # no stage peer: nobody to wait for
        _introduce(alone, other)
        began = time.monotonic()
        alone.linger(max_s=20.0, idle_s=1.0)
        assert 0.9 <= time.monotonic() - began < 5.0


def test_linger_stops_at_max_s_while_reads_go_on() -> None:
    ending, behind = _plane("linger-capped"), _plane("linger-reader")
    with ending, behind:
        _introduce(ending, behind)
        ending._call(ending._store.publish(NAME, b"x"), timeout=5.0)
        thread, took = _timed_linger(ending, max_s=1.5, idle_s=1.0)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and thread.is_alive():
            behind._call(behind._store.fetch(ending.wallet.public_key_hex, NAME, max_bytes=16), 5.0)
            time.sleep(0.2)
        thread.join(timeout=5.0)
        assert took and 1.4 <= took[0] < 2.5


def test_while_lingering_what_will_never_be_published_is_answered_at_once() -> None:
    """A peer training on long-polls this node's next round: it must not wait for a node that left."""
    ending, other = _plane("linger-leaving"), _plane("linger-training-on")
    with ending, other:
        _introduce(ending, other)
        thread, took = _timed_linger(ending, max_s=10.0, idle_s=1.0)
        time.sleep(0.3)
        began = time.monotonic()
        got = other._call(
            other._store.fetch(
                ending.wallet.public_key_hex, object_name(0, 8, "commit"), max_bytes=64, wait_s=5.0
            ),
            10.0,
        )
        assert got is None and time.monotonic() - began < 2.0
        thread.join(timeout=15.0)
        assert took and took[0] < 5.0


def test_linger_returns_when_the_node_is_told_to_stop() -> None:
    stop = threading.Event()
    ending, reader = _plane("linger-stopped", stop), _plane("linger-busy-reader")
    with ending, reader:
        _introduce(ending, reader)
        ending._call(ending._store.publish(NAME, b"x"), timeout=5.0)
        thread, took = _timed_linger(ending, max_s=20.0, idle_s=5.0)
        time.sleep(0.5)
        stop.set()  # Ctrl-C while a reader still reads
        reader._call(reader._store.fetch(ending.wallet.public_key_hex, NAME, max_bytes=16), 5.0)
        thread.join(timeout=25.0)
        assert took and took[0] < 3.0
