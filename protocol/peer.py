"""The peer plane's own messages and routes: peer records, peer lists, state info, error replies.

Tensors never travel as JSON: they are safetensors bodies (``neuroshard.node.codec``),
bound to a signed message by their sha256 (a state by `StateInfo.theta_hash`, a Δ by its
round commitment's Merkle root, ``protocol.round``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from .refusal import MAX_DETAIL_CHARS, invalid, malformed
from .schema import (
    MAX_COUNT,
    MAX_NUMEL,
    MAX_STAGE,
    Check,
    Message,
    Signed,
    hex_bytes,
    integer,
    list_of,
    message,
    number,
    text,
)

# Route paths (server and client build them from here; the outer round's object route is
# node.p2p.objects.OBJECT, the pipeline's is protocol.pipeline.FORWARD).
PEERS = "/p2p/peers"
ANNOUNCE = "/p2p/announce"
STATUS = "/p2p/status"
STATE = "/p2p/state"
REPLAY = "/p2p/replay/{round}"
"""θ_round, Δ and inner optimizer state of one of the node's recent rounds (node.p2p.replay)."""

STATE_HEADER = "X-NeuroShard-State"
"""HTTP header that carries signed JSON next to a safetensors body."""

MAX_PEER_RECORDS = 512
MAX_ADDRESS_CHARS = 261
"""A 253-character DNS name, a colon and a 5-digit port, plus brackets for IPv6."""

_HOST = re.compile(r"[A-Za-z0-9.\-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")


def parse_address(value: str) -> tuple[str, int]:
    """``host:port`` (IPv6 in brackets) -> (host, port); Refused("invalid") names what is wrong."""
    host, sep, port = value.rpartition(":")
    if not sep or not _HOST.fullmatch(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise invalid(f"address {value[:80]!r} is not host:port (port 1-65535)")
    return host.strip("[]"), int(port)


def _host_port(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise malformed(f"{where} must be a string, got {type(value).__name__}")
    if len(value) > MAX_ADDRESS_CHARS:
        raise invalid(f"{where} is longer than {MAX_ADDRESS_CHARS} characters")
    parse_address(value)
    return value


host_port = Check(_host_port, {"type": "string", "maxLength": MAX_ADDRESS_CHARS})


@dataclass(frozen=True, kw_only=True)
class PeerRecord(Signed):
    """Where a replica can be reached, signed by the replica itself so no one can forge it."""

    NAME = "peer record"
    DOMAIN = b"neuroshard/peer/v1"
    address: Annotated[str, host_port]
    """host:port the replica's peer server answers on (its --announce address)."""
    stage: Annotated[int, integer(0, MAX_STAGE)]
    last_seen: Annotated[float, number(0.0, 2.0**40)]
    """Unix time (seconds) the replica signed this record; the fresher record of a wallet wins."""


@dataclass(frozen=True, kw_only=True)
class PeerList(Message):
    """GET /p2p/peers: the records a node knows (each signed by its own peer)."""

    NAME = "peer list"
    peers: Annotated[tuple[PeerRecord, ...], list_of(message(PeerRecord), MAX_PEER_RECORDS)]


@dataclass(frozen=True, kw_only=True)
class StateInfo(Signed):
    """A replica's round and state hashes: the body of GET /p2p/status, the header of GET /p2p/state."""

    NAME = "state info"
    DOMAIN = b"neuroshard/state/v1"
    stage: Annotated[int, integer(0, MAX_STAGE)]
    round: Annotated[int, integer(0, MAX_COUNT)]
    """The round whose start θ_round is (the replica is training this round or collecting it)."""
    theta_hash: Annotated[str, hex_bytes(32)]
    """sha256 of θ_round (little-endian float32): what replicas vote on after a round."""
    momentum_hash: Annotated[str, hex_bytes(32, empty_ok=True)]
    """sha256 of the outer momentum buffer, "" before the first outer step."""
    numel: Annotated[int, integer(1, MAX_NUMEL)]


@dataclass(frozen=True, kw_only=True)
class ErrorReply(Message):
    """A refusal's body: its code and its detail. Every 4xx/5xx of the peer plane; the verifier's
    refusals have the same two fields (api.refusals)."""

    NAME = "error reply"
    error: Annotated[str, text(64)]
    detail: Annotated[str, text(MAX_DETAIL_CHARS)]
