"""The peer network's message machinery and its own messages (peer records, statuses, errors).

The outer round's messages (``neuroshard.node.outer.messages``) and the pipeline's
(``pipeline_wire``) are built from the same pieces here, defined once for sender and receiver.

JSON metadata has a fixed schema: parsing rejects unknown and missing fields, wrong
types (a bool is not an int, 1.0 is not an int), duplicate keys, NaN/Infinity and
out-of-range numbers. Malformed input raises `MalformedMessage` (HTTP 400); input that
parses but cannot be right (a stage out of range, a bad address) raises `InvalidMessage`
(HTTP 422).

Signed messages carry the signer's wallet (Ed25519 public key, hex) and a signature over
``domain + "\\n" + canonical JSON of every other field``. The domain string differs per
message type, so a signature made for a peer record can never pass as a round commitment.
Tensors never travel as JSON: they are safetensors bodies (see `codec`), bound to a signed
message by their sha256 (a state by `StateInfo.theta_hash`, a Δ by its commitment's Merkle root).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Self

from ..wallet import Wallet, verify

# Route paths (server and client build them from here; the outer round's object route is
# objects.OBJECT, the pipeline's is in pipeline_wire).
PEERS = "/p2p/peers"
ANNOUNCE = "/p2p/announce"
STATUS = "/p2p/status"
STATE = "/p2p/state"
REPLAY = "/p2p/replay/{round}"
"""θ_round, Δ and inner optimizer state of one of the node's recent rounds (node.p2p.replay)."""

# HTTP header that carries signed JSON next to a safetensors body.
STATE_HEADER = "X-NeuroShard-State"

ENCODINGS = ("fp16", "int8")
MAX_STAGE = 1023
MAX_COUNT = 2**53 - 1
"""Largest round or token count: the largest integer a JSON parser in any language keeps exact."""
MAX_NUMEL = 2**40
MAX_PEER_RECORDS = 512
MAX_ADDRESS_CHARS = 261
"""A 253-character DNS name, a colon and a 5-digit port, plus brackets for IPv6."""
MAX_DETAIL_CHARS = 2000

_HEX_CHARS = re.compile(r"[0-9a-f]*")
_HOST = re.compile(r"[A-Za-z0-9.\-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")


class WireError(ValueError):
    """A message that cannot be accepted; `status` is the HTTP status the server answers with."""

    status: ClassVar[int] = 400
    code: ClassVar[str] = "malformed"


class MalformedMessage(WireError):
    """Not the schema: bad JSON, unknown or missing fields, wrong types, bad hex."""


class InvalidMessage(WireError):
    """Well-formed, but a value is out of range or inconsistent."""

    status = 422
    code = "invalid"


class Rejected(Exception):
    """A request or message this node refuses: HTTP status, a short code, a sentence naming the problem."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail


Validator = Callable[[Any, str], Any]


def canonical_json(obj: Any) -> bytes:
    """The one byte encoding that signatures cover: sorted keys, no spaces, ASCII, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise MalformedMessage(f"duplicate JSON key {key!r}")
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise MalformedMessage(f"JSON constant {name} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise MalformedMessage(f"JSON number {text[:40]} overflows a float")
    return value


def parse_json(data: bytes | str, what: str) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity (written or by overflow, 1e999).
    Every way a hostile body can fail to parse is a MalformedMessage (so a 4xx): nesting deeper
    than the parser's recursion limit, and integers longer than Python converts (4,300 digits)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constants,
            parse_float=_finite_float,
        )
    except UnicodeDecodeError:
        raise MalformedMessage(f"{what} is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise MalformedMessage(f"{what} is not JSON: {exc.msg} at position {exc.pos}") from None
    except RecursionError:
        raise MalformedMessage(f"{what} nests too deep") from None
    except MalformedMessage:
        raise  # from the hooks: a duplicate key, a NaN, an overflowing float
    except ValueError as exc:  # int() of a number longer than sys.get_int_max_str_digits()
        raise MalformedMessage(f"{what} is not acceptable JSON: {str(exc)[:120]}") from None


# Field validators: each takes the JSON value and where it sits, returns the Python value.


def integer(lo: int, hi: int) -> Validator:
    def check(value: Any, where: str) -> int:
        if type(value) is not int:
            raise MalformedMessage(f"{where} must be an integer, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise InvalidMessage(f"{where} = {value} is outside [{lo}, {hi}]")
        return value

    return check


def number(lo: float, hi: float) -> Validator:
    def check(value: Any, where: str) -> float:
        if type(value) not in (int, float):
            raise MalformedMessage(f"{where} must be a number, got {type(value).__name__}")
        if not (math.isfinite(value) and lo <= value <= hi):
            raise InvalidMessage(f"{where} = {value} is outside [{lo}, {hi}]")
        return float(value)

    return check


def hex_bytes(nbytes: int, *, empty_ok: bool = False) -> Validator:
    """Lowercase hex of exactly `nbytes` bytes (or "" when `empty_ok`)."""

    def check(value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise MalformedMessage(f"{where} must be a hex string, got {type(value).__name__}")
        if empty_ok and value == "":
            return value
        if len(value) != 2 * nbytes or not _HEX_CHARS.fullmatch(value):
            raise MalformedMessage(f"{where} must be {2 * nbytes} lowercase hex characters")
        return value

    return check


def choice(options: tuple[str, ...]) -> Validator:
    def check(value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise MalformedMessage(f"{where} must be a string, got {type(value).__name__}")
        if value not in options:
            raise InvalidMessage(f"{where} = {value[:40]!r} is not one of {', '.join(options)}")
        return value

    return check


def text(max_chars: int) -> Validator:
    def check(value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise MalformedMessage(f"{where} must be a string, got {type(value).__name__}")
        if len(value) > max_chars:
            raise InvalidMessage(f"{where} has {len(value)} characters, at most {max_chars} allowed")
        return value

    return check


def parse_address(value: str) -> tuple[str, int]:
    """``host:port`` (IPv6 in brackets) -> (host, port); InvalidMessage names what is wrong."""
    host, sep, port = value.rpartition(":")
    if not sep or not _HOST.fullmatch(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidMessage(f"address {value[:80]!r} is not host:port (port 1-65535)")
    return host.strip("[]"), int(port)


def host_port(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise MalformedMessage(f"{where} must be a string, got {type(value).__name__}")
    if len(value) > MAX_ADDRESS_CHARS:
        raise InvalidMessage(f"{where} is longer than {MAX_ADDRESS_CHARS} characters")
    parse_address(value)
    return value


def list_of(item: Validator, max_items: int) -> Validator:
    def check(value: Any, where: str) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise MalformedMessage(f"{where} must be a list, got {type(value).__name__}")
        if len(value) > max_items:
            raise InvalidMessage(f"{where} has {len(value)} items, at most {max_items} allowed")
        return tuple(item(v, f"{where}[{i}]") for i, v in enumerate(value))

    return check


def message(cls: type[Message]) -> Validator:
    return lambda value, where: cls.from_obj(value, where)


def schema(*base: Mapping[str, Validator], **fields: Validator) -> Mapping[str, Validator]:
    """A message's fixed field set (read-only)."""
    merged: dict[str, Validator] = {}
    for part in base:
        merged.update(part)
    merged.update(fields)
    return MappingProxyType(merged)


def check_fields(obj: Any, spec: Mapping[str, Validator], where: str) -> dict[str, Any]:
    """Exactly the fields of `spec`, each passed through its validator."""
    if not isinstance(obj, dict):
        raise MalformedMessage(f"{where} must be a JSON object, got {type(obj).__name__}")
    missing = sorted(spec.keys() - obj.keys())
    unknown = sorted(obj.keys() - spec.keys())
    if missing:
        raise MalformedMessage(f"{where} is missing field(s) {', '.join(missing)}")
    if unknown:
        raise MalformedMessage(f"{where} has unknown field(s) {', '.join(k[:40] for k in unknown)}")
    return {name: check(obj[name], f"{where}.{name}") for name, check in spec.items()}


def _to_obj(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_obj()
    if isinstance(value, tuple):
        return [_to_obj(v) for v in value]
    return value


@dataclass(frozen=True, kw_only=True)
class Message:
    """A JSON message with a fixed schema (`FIELDS`), parsed strictly."""

    FIELDS: ClassVar[Mapping[str, Validator]]
    NAME: ClassVar[str]

    def to_obj(self) -> dict[str, Any]:
        return {f.name: _to_obj(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_json(self) -> bytes:
        return canonical_json(self.to_obj())

    def check(self) -> None:
        """Cross-field rules beyond the per-field validators; raise InvalidMessage."""

    @classmethod
    def from_obj(cls, obj: Any, where: str | None = None) -> Self:
        made = cls(**check_fields(obj, cls.FIELDS, where or cls.NAME))
        made.check()
        return made

    @classmethod
    def from_json(cls, data: bytes | str) -> Self:
        return cls.from_obj(parse_json(data, cls.NAME))


SIGNATURE_PLACEHOLDER = "0" * 128
_SIGNER = schema(wallet=hex_bytes(32), signature=hex_bytes(64))


@dataclass(frozen=True, kw_only=True)
class Signed(Message):
    """A message signed by `wallet`; `signature_valid()` checks it."""

    DOMAIN: ClassVar[bytes]
    wallet: str
    """The signer's Ed25519 public key, 64 hex characters."""
    signature: str
    """Ed25519 signature over DOMAIN + b"\\n" + the canonical JSON of all other fields, 128 hex."""

    def signing_bytes(self) -> bytes:
        obj = self.to_obj()
        del obj["signature"]
        return self.DOMAIN + b"\n" + canonical_json(obj)

    def signature_valid(self) -> bool:
        return verify(bytes.fromhex(self.wallet), self.signing_bytes(), bytes.fromhex(self.signature))

    @classmethod
    def create(cls, signer: Wallet, **values: Any) -> Self:
        """Build, validate against the schema (as a receiver would) and sign."""
        unsigned = cls(wallet=signer.public_key_hex, signature=SIGNATURE_PLACEHOLDER, **values)
        signed = dataclasses.replace(unsigned, signature=signer.sign(unsigned.signing_bytes()).hex())
        return cls.from_obj(parse_json(signed.to_json(), cls.NAME))


@dataclass(frozen=True, kw_only=True)
class PeerRecord(Signed):
    """Where a replica can be reached, signed by the replica itself so no one can forge it."""

    NAME = "peer record"
    DOMAIN = b"neuroshard/peer/v1"
    address: str
    """host:port the replica's peer server answers on (its --announce address)."""
    stage: int
    last_seen: float
    """Unix time (seconds) the replica signed this record; the fresher record of a wallet wins."""

    FIELDS = schema(
        _SIGNER,
        address=host_port,
        stage=integer(0, MAX_STAGE),
        last_seen=number(0.0, 2.0**40),
    )


@dataclass(frozen=True, kw_only=True)
class PeerList(Message):
    """GET /p2p/peers: the records a node knows (each signed by its own peer)."""

    NAME = "peer list"
    peers: tuple[PeerRecord, ...]

    FIELDS = schema(peers=list_of(message(PeerRecord), MAX_PEER_RECORDS))


@dataclass(frozen=True, kw_only=True)
class StateInfo(Signed):
    """A replica's round and state hashes: the body of GET /p2p/status, the header of GET /p2p/state."""

    NAME = "state info"
    DOMAIN = b"neuroshard/state/v1"
    stage: int
    round: int
    """The round whose start θ_round is (the replica is training this round or collecting it)."""
    theta_hash: str
    """sha256 of θ_round (little-endian float32): what replicas vote on after a round."""
    momentum_hash: str
    """sha256 of the outer momentum buffer, "" before the first outer step."""
    numel: int

    FIELDS = schema(
        _SIGNER,
        stage=integer(0, MAX_STAGE),
        round=integer(0, MAX_COUNT),
        theta_hash=hex_bytes(32),
        momentum_hash=hex_bytes(32, empty_ok=True),
        numel=integer(1, MAX_NUMEL),
    )


@dataclass(frozen=True, kw_only=True)
class ErrorReply(Message):
    """Every 4xx/5xx body: a short machine-readable code and a sentence naming the problem."""

    NAME = "error reply"
    error: str
    detail: str

    FIELDS = schema(error=text(64), detail=text(MAX_DETAIL_CHARS))


# Signed requests. Every request carries these four headers; the signature covers
# `request_signing_bytes(...)`, so a relay can neither change the body nor replay it.
WALLET_HEADER = "X-NeuroShard-Wallet"
TIMESTAMP_HEADER = "X-NeuroShard-Timestamp"
NONCE_HEADER = "X-NeuroShard-Nonce"
SIGNATURE_HEADER = "X-NeuroShard-Signature"
REQUEST_DOMAIN = b"neuroshard/request/v1"
NONCE_BYTES = 16


def request_signing_bytes(method: str, path: str, body_sha256: str, timestamp_ms: str, nonce: str) -> bytes:
    """``method\\npath\\nsha256(body)\\ntimestamp\\nnonce`` under the request domain.

    `path` is the raw path with its query string as sent; `timestamp_ms` is Unix time in
    integer milliseconds, in decimal; `nonce` is 32 lowercase hex characters.
    """
    lines = (method.upper(), path, body_sha256, timestamp_ms, nonce)
    return REQUEST_DOMAIN + b"\n" + "\n".join(lines).encode("utf-8")
