"""Loopback ports for processes a test or benchmark starts: picked here, bound later by the child.

A port picked with ``bind(("127.0.0.1", 0))`` comes from the kernel's ephemeral range, the same
range every outgoing connection takes its local port from. Between the check and the child's
bind, one of the many HTTP connections a swarm makes (to its peers, to the verifier) can take it,
and the child fails with "Address already in use" (seen in CI, in tests and benchmarks alike). So
ports are picked below that range, where no outgoing connection lands on a host with the default
ranges (a host whose ephemeral range starts below 32000 brings the race back).
"""

from __future__ import annotations

import random
import socket

UNASSIGNED_PORTS = (20_000, 32_000)
"""Where ports are picked: below Linux's ephemeral range (32768-60999 by default) and macOS's
(49152-65535)."""


def free_port_block(count: int) -> int:
    """A base port with ``count`` consecutive ports free on 127.0.0.1 (a swarm's nodes take base + i)."""
    low, high = UNASSIGNED_PORTS
    pick = random.SystemRandom()  # not the seeded `random` a test may have set: two tests, two blocks
    for _ in range(200):
        base = pick.randrange(low, high - count)
        socks: list[socket.socket] = []
        try:
            for i in range(count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports in {low}-{high}")


def free_port() -> int:
    """One free port on 127.0.0.1 for a server another process will start."""
    return free_port_block(1)
