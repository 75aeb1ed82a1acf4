"""The message machinery: strict JSON, field checks, and `Message`/`Signed` whose schema is their fields.

A message is a frozen dataclass whose every field is annotated with its check,
``stage: Annotated[int, integer(0, MAX_STAGE)]``: that one declaration is the Python type,
the parser (`Message.from_obj` takes exactly those fields, each through its check), the
JSON Schema the verifier's OpenAPI document shows (`Message.json_schema`), and what
`Signed.create` re-checks before a sender signs. A field with a default may be absent
(and is left out of the JSON when it holds its default None).

JSON is parsed strictly (`parse_json`): no duplicate keys, no NaN/Infinity written or by
overflow, nesting and number length bounded; a bool is not an int, 1.0 is not an int.
Not the schema raises ``Refused("malformed")``; a value out of range or inconsistent
raises ``Refused("invalid")``.

Signed messages carry the signer's wallet (Ed25519 public key, hex) and a signature over
``DOMAIN + "\\n" + canonical JSON of every other field``. The domain differs per message
type, so a signature made for a peer record can never pass as a round commitment.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Self

from .identity import Signer, verify
from .refusal import Refused, invalid, malformed

MAX_COUNT = 2**53 - 1
"""Largest round or token count: the largest integer a JSON parser in any language keeps exact."""
MAX_STAGE = 1023
MAX_NUMEL = 2**40

_HEX_CHARS = re.compile(r"[0-9a-f]*")


@dataclass(frozen=True)
class Check:
    """One field's check: `check(value, where)` returns the Python value or raises Refused;
    `schema` is the same rule as JSON Schema (for the OpenAPI document)."""

    check: Callable[[Any, str], Any]
    schema: Mapping[str, Any]

    def __call__(self, value: Any, where: str) -> Any:
        return self.check(value, where)


def canonical_json(obj: Any) -> bytes:
    """The one byte encoding that signatures cover: sorted keys, no spaces, ASCII, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise malformed(f"duplicate JSON key {key!r}")
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise malformed(f"JSON constant {name} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise malformed(f"JSON number {text[:40]} overflows a float")
    return value


def parse_json(data: bytes | str, what: str) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity (written or by overflow, 1e999).
    Every way a hostile body can fail to parse is a Refused("malformed"): nesting deeper than
    the parser's recursion limit, and integers longer than Python converts (4,300 digits)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constants,
            parse_float=_finite_float,
        )
    except UnicodeDecodeError:
        raise malformed(f"{what} is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise malformed(f"{what} is not JSON: {exc.msg} at position {exc.pos}") from None
    except RecursionError:
        raise malformed(f"{what} nests too deep") from None
    except Refused:
        raise  # from the hooks: a duplicate key, a NaN, an overflowing float
    except ValueError as exc:  # int() of a number longer than sys.get_int_max_str_digits()
        raise malformed(f"{what} is not acceptable JSON: {str(exc)[:120]}") from None


def split_header(data: bytes, what: str, max_header: int) -> tuple[Any, int]:
    """(the JSON header, where the payload starts) of a body laid out as safetensors is: an 8-byte
    little-endian header length, the header, the payload. Refused("malformed") when the length
    does not fit the body or `max_header`, or the header is not strict JSON."""
    if len(data) < 8:
        raise malformed(f"{what} is truncated")
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(max_header, len(data) - 8):
        raise malformed(f"{what} header of {size} bytes does not fit")
    return parse_json(data[8 : 8 + size], f"{what} header"), 8 + size


# Field checks: each takes the JSON value and where it sits, returns the Python value.


def integer(lo: int, hi: int) -> Check:
    def check(value: Any, where: str) -> int:
        if type(value) is not int:
            raise malformed(f"{where} must be an integer, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise invalid(f"{where} = {value} is outside [{lo}, {hi}]")
        return value

    return Check(check, {"type": "integer", "minimum": lo, "maximum": hi})


def number(lo: float, hi: float) -> Check:
    def check(value: Any, where: str) -> float:
        if type(value) not in (int, float):
            raise malformed(f"{where} must be a number, got {type(value).__name__}")
        if not (math.isfinite(value) and lo <= value <= hi):
            raise invalid(f"{where} = {value} is outside [{lo}, {hi}]")
        return float(value)

    return Check(check, {"type": "number", "minimum": lo, "maximum": hi})


def hex_bytes(nbytes: int, *, empty_ok: bool = False) -> Check:
    """Lowercase hex of exactly `nbytes` bytes (or "" when `empty_ok`)."""

    def check(value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise malformed(f"{where} must be a hex string, got {type(value).__name__}")
        if empty_ok and value == "":
            return value
        if len(value) != 2 * nbytes or not _HEX_CHARS.fullmatch(value):
            raise malformed(f"{where} must be {2 * nbytes} lowercase hex characters")
        return value

    pattern = f"^[0-9a-f]{{{2 * nbytes}}}$" if not empty_ok else f"^([0-9a-f]{{{2 * nbytes}}})?$"
    return Check(check, {"type": "string", "pattern": pattern})


def choice(options: tuple[str, ...]) -> Check:
    def check(value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise malformed(f"{where} must be a string, got {type(value).__name__}")
        if value not in options:
            raise invalid(f"{where} = {value[:40]!r} is not one of {', '.join(options)}")
        return value

    return Check(check, {"type": "string", "enum": list(options)})


def text(max_chars: int, *, min_chars: int = 0) -> Check:
    def check(value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise malformed(f"{where} must be a string, got {type(value).__name__}")
        if not min_chars <= len(value) <= max_chars:
            raise invalid(f"{where} has {len(value)} characters, {min_chars} to {max_chars} allowed")
        return value

    return Check(check, {"type": "string", "minLength": min_chars, "maxLength": max_chars})


def matching(pattern: str, max_chars: int, what: str) -> Check:
    """A string of at most `max_chars` that `pattern` matches in full; `what` names the form."""
    compiled = re.compile(pattern)

    def check(value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise malformed(f"{where} must be a string, got {type(value).__name__}")
        if len(value) > max_chars or not compiled.fullmatch(value):
            raise invalid(f"{where} = {value[:80]!r} is not {what} (at most {max_chars} characters)")
        return value

    return Check(check, {"type": "string", "pattern": f"^(?:{pattern})$", "maxLength": max_chars})


def optional(inner: Check) -> Check:
    """`inner`, or JSON null (None)."""

    def check(value: Any, where: str) -> Any:
        return None if value is None else inner(value, where)

    return Check(check, {"anyOf": [dict(inner.schema), {"type": "null"}]})


def list_of(item: Check, max_items: int) -> Check:
    def check(value: Any, where: str) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise malformed(f"{where} must be a list, got {type(value).__name__}")
        if len(value) > max_items:
            raise invalid(f"{where} has {len(value)} items, at most {max_items} allowed")
        return tuple(item(v, f"{where}[{i}]") for i, v in enumerate(value))

    return Check(check, {"type": "array", "items": dict(item.schema), "maxItems": max_items})


def message(cls: type[Message]) -> Check:
    return Check(lambda value, where: cls.from_obj(value, where), cls.json_schema())


@dataclass(frozen=True)
class FieldSpec:
    check: Check
    required: bool
    omit_none: bool
    """Left out of the JSON when None (an optional field that defaults to None)."""


def _specs(cls: type) -> dict[str, FieldSpec]:
    hints = typing.get_type_hints(cls, include_extras=True)
    specs: dict[str, FieldSpec] = {}
    for f in dataclasses.fields(cls):
        checks = [m for m in getattr(hints[f.name], "__metadata__", ()) if isinstance(m, Check)]
        if len(checks) != 1:
            raise TypeError(f"{cls.__name__}.{f.name} must be Annotated with exactly one Check")
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        specs[f.name] = FieldSpec(checks[0], not has_default, has_default and f.default is None)
    return specs


def check_fields(obj: Any, spec: Mapping[str, FieldSpec], where: str) -> dict[str, Any]:
    """Exactly the fields of `spec` (those with defaults may be absent), each through its check."""
    if not isinstance(obj, dict):
        raise malformed(f"{where} must be a JSON object, got {type(obj).__name__}")
    missing = sorted(k for k, s in spec.items() if s.required and k not in obj)
    unknown = sorted(obj.keys() - spec.keys())
    if missing:
        raise malformed(f"{where} is missing field(s) {', '.join(missing)}")
    if unknown:
        raise malformed(f"{where} has unknown field(s) {', '.join(str(k)[:40] for k in unknown)}")
    return {name: s.check(obj[name], f"{where}.{name}") for name, s in spec.items() if name in obj}


def _to_obj(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_obj()
    if isinstance(value, tuple):
        return [_to_obj(v) for v in value]
    return value


@dataclass(frozen=True, kw_only=True)
class Message:
    """A JSON message with a fixed schema: its annotated fields, parsed strictly."""

    NAME: ClassVar[str]

    @classmethod
    def fields_spec(cls) -> dict[str, FieldSpec]:
        """Each field's check, derived once from the class's annotations."""
        cached: dict[str, FieldSpec] | None = cls.__dict__.get("_FIELD_SPECS")
        if cached is None:
            cached = _specs(cls)
            cls._FIELD_SPECS = cached  # type: ignore[attr-defined]
        return cached

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        spec = cls.fields_spec()
        return {
            "title": cls.__name__,
            "type": "object",
            "properties": {name: dict(s.check.schema) for name, s in spec.items()},
            "required": [name for name, s in spec.items() if s.required],
            "additionalProperties": False,
        }

    def to_obj(self) -> dict[str, Any]:
        spec = self.fields_spec()
        return {
            name: _to_obj(value)
            for name in spec
            if not ((value := getattr(self, name)) is None and spec[name].omit_none)
        }

    def to_json(self) -> bytes:
        return canonical_json(self.to_obj())

    def check(self) -> None:
        """Cross-field rules beyond the per-field checks; raise Refused("invalid")."""

    @classmethod
    def from_obj(cls, obj: Any, where: str | None = None) -> Self:
        made = cls(**check_fields(obj, cls.fields_spec(), where or cls.NAME))
        made.check()
        return made

    @classmethod
    def from_json(cls, data: bytes | str) -> Self:
        return cls.from_obj(parse_json(data, cls.NAME))

    @classmethod
    def checked(cls, **values: Any) -> Self:
        """Build from Python values and check as a receiver would (the sender's side of `from_obj`)."""
        return cls.from_obj(parse_json(cls(**values).to_json(), cls.NAME))


SIGNATURE_PLACEHOLDER = "0" * 128
PublicKeyHex = Annotated[str, hex_bytes(32)]
"""An Ed25519 public key, 64 lowercase hex characters."""


@dataclass(frozen=True, kw_only=True)
class Signed(Message):
    """A message signed by `wallet`; `signature_valid()` checks it."""

    DOMAIN: ClassVar[bytes]
    wallet: PublicKeyHex
    """The signer's Ed25519 public key, 64 hex characters."""
    signature: Annotated[str, hex_bytes(64)]
    """Ed25519 signature over DOMAIN + b"\\n" + the canonical JSON of all other fields, 128 hex."""

    def signing_bytes(self) -> bytes:
        obj = self.to_obj()
        del obj["signature"]
        return self.DOMAIN + b"\n" + canonical_json(obj)

    def signature_valid(self) -> bool:
        return verify(bytes.fromhex(self.wallet), self.signing_bytes(), bytes.fromhex(self.signature))

    @classmethod
    def create(cls, signer: Signer, **values: Any) -> Self:
        """Build, validate against the schema (as a receiver would) and sign what a receiver reads:
        the values in the schema's form (an int given for a number field is signed as the float
        the wire carries, or the signature would not verify)."""
        built = cls(wallet=signer.public_key_hex, signature=SIGNATURE_PLACEHOLDER, **values)
        unsigned = cls.from_obj(parse_json(built.to_json(), cls.NAME))
        signed = dataclasses.replace(unsigned, signature=signer.sign(unsigned.signing_bytes()).hex())
        return cls.from_obj(parse_json(signed.to_json(), cls.NAME))
