"""The signed manifest: which shards exist, their hashes, and the tokenizer they were made with.

`manifest.json` is canonical JSON (sorted keys, no spaces); `manifest.json.sig` holds the
hex Ed25519 signature of exactly those bytes by the publisher. A reader checks the
signature against a pinned publisher key before it trusts a single field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nacl.signing import SigningKey

from neuroshard.protocol.schema import parse_json

from .keys import signature_is_valid

MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.json.sig"
MANIFEST_FORMAT = 2


class ManifestError(ValueError):
    """A manifest that is missing, malformed, or not signed by the pinned publisher."""


_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
"""One path component a manifest may name: no separators, no leading dot (so never "." or
".."), nothing a filesystem or URL reads specially (backslash, colon, percent, NUL)."""
MAX_PATH_PARTS = 4
_SHA256 = re.compile(r"[0-9a-f]{64}")


def check_relative_path(value: object, what: str) -> str:
    """`value` if it is a safe relative path ("shard_3.pt", "tokenizers/<sha256>.json"): 1 to
    MAX_PATH_PARTS components joined by "/", each a `_NAME`. Everything a manifest names goes
    through this before it is joined to a directory or a base URL; issue 19: a signed manifest's
    tokenizer "../../../../etc/passwd" was opened before its hash check refused it."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    parts = value.split("/")
    if len(parts) > MAX_PATH_PARTS or not all(_NAME.fullmatch(part) for part in parts):
        raise ValueError(f"{what} {value[:80]!r} is not a relative path of plain names")
    return value


def resolve_inside(directory: Path, relative: str, what: str) -> Path:
    """`directory / relative` after `check_relative_path`, and still under `directory` once
    symlinks are resolved (a link inside the data set must not lead out of it)."""
    try:
        check_relative_path(relative, what)
    except ValueError as exc:
        raise ManifestError(str(exc)) from None
    path = directory / relative
    if not path.resolve().is_relative_to(directory.resolve()):
        raise ManifestError(f"{what} {relative!r} leads outside {directory}")
    return path


def _integer(value: object, what: str, lo: int, hi: int = 2**53 - 1) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{what} must be an integer in [{lo}, {hi}], got {str(value)[:40]}")
    return value


def _hex64(value: object, what: str) -> str:
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise ValueError(f"{what} must be 64 lowercase hex digits")
    return value


def _string(value: object, what: str, max_chars: int = 64) -> str:
    if not isinstance(value, str) or len(value) > max_chars:
        raise ValueError(f"{what} must be a string of at most {max_chars} characters")
    return value


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    id: int
    file: str
    sha256: str
    tokens: int
    tokenizer_sha256: str
    """The tokenizer this shard was made with; it must be in the manifest's tokenizer lineage."""


@dataclass(frozen=True, kw_only=True)
class TokenizerInfo:
    file: str
    """Content-addressed (tokenizers/<sha256>.json): an object under a name never changes, so CDNs may cache it."""
    sha256: str
    next_merge_id: int


@dataclass(frozen=True, kw_only=True)
class Manifest:
    version: int
    """Publication counter, +1 per publish; a node only ever moves to a higher version."""
    created: str
    """UTC time of publication, ISO 8601."""
    publisher: str
    """Hex public key of the publisher that signed this manifest."""
    tokenizers: tuple[TokenizerInfo, ...]
    """The tokenizer lineage, oldest first: each extends the one before (merges are append-only)."""
    shards: tuple[ShardInfo, ...]

    @property
    def tokenizer(self) -> TokenizerInfo:
        """The current tokenizer: the newest in the lineage. Nodes use exactly this one."""
        return self.tokenizers[-1]

    @property
    def total_shards(self) -> int:
        return len(self.shards)

    def made_with_lineage(self, info: ShardInfo) -> bool:
        """True when the shard's tokenizer is in this manifest's lineage, so its ids mean what ours mean."""
        return any(t.sha256 == info.tokenizer_sha256 for t in self.tokenizers)

    def shard(self, shard_id: int) -> ShardInfo:
        for info in self.shards:
            if info.id == shard_id:
                return info
        raise ManifestError(f"shard {shard_id} is not in the manifest ({self.total_shards} shards)")

    def to_bytes(self) -> bytes:
        """Canonical encoding: the bytes that are signed and hashed."""
        doc = {
            "format": MANIFEST_FORMAT,
            "version": self.version,
            "created": self.created,
            "publisher": self.publisher,
            "tokenizers": [vars(t) for t in self.tokenizers],
            "shards": [vars(s) for s in self.shards],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_bytes(cls, raw: bytes, source: str = "manifest") -> Manifest:
        try:
            # The rules of every wire message: no duplicate keys, no NaN or Infinity, bounded nesting.
            return _parse(parse_json(raw, source))
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ManifestError(f"{source} is malformed: {str(exc)[:200]}") from None


def _fields(obj: object, names: set[str], what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(obj).__name__}")
    missing = names - obj.keys()
    if missing:
        raise ValueError(f"{what} is missing {', '.join(sorted(missing))}")
    return obj


def _list(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list, got {type(value).__name__}")
    return value


def _tokenizer(obj: object, i: int) -> TokenizerInfo:
    what = f"tokenizers[{i}]"
    t = _fields(obj, {"file", "sha256", "next_merge_id"}, what)
    return TokenizerInfo(
        file=check_relative_path(t["file"], f"{what}.file"),
        sha256=_hex64(t["sha256"], f"{what}.sha256"),
        next_merge_id=_integer(t["next_merge_id"], f"{what}.next_merge_id", 0),
    )


def _shard(obj: object, i: int) -> ShardInfo:
    what = f"shards[{i}]"
    s = _fields(obj, {"id", "file", "sha256", "tokens", "tokenizer_sha256"}, what)
    file = check_relative_path(s["file"], f"{what}.file")
    if "/" in file:
        raise ValueError(f"shard {s['id']} file name {file!r} is not a plain file name")
    return ShardInfo(
        id=_integer(s["id"], f"{what}.id", 0),
        file=file,
        sha256=_hex64(s["sha256"], f"{what}.sha256"),
        tokens=_integer(s["tokens"], f"{what}.tokens", 1),
        tokenizer_sha256=_hex64(s["tokenizer_sha256"], f"{what}.tokenizer_sha256"),
    )


def _parse(obj: object) -> Manifest:
    doc = _fields(obj, {"format", "version", "created", "publisher", "tokenizers", "shards"}, "manifest")
    if doc["format"] != MANIFEST_FORMAT:
        raise ValueError(f"format {str(doc['format'])[:20]!r}, this reader understands {MANIFEST_FORMAT}")
    tokenizers = tuple(_tokenizer(t, i) for i, t in enumerate(_list(doc["tokenizers"], "tokenizers")))
    if not tokenizers:
        raise ValueError("no tokenizer")
    merge_ids = [t.next_merge_id for t in tokenizers]
    if merge_ids != sorted(set(merge_ids)):
        raise ValueError(f"tokenizer lineage must grow strictly, got next_merge_id {merge_ids}")
    shards = tuple(_shard(s, i) for i, s in enumerate(_list(doc["shards"], "shards")))
    ids = [s.id for s in shards]
    if ids != list(range(len(ids))):
        raise ValueError("shard ids must be 0..n-1 in order")
    return Manifest(
        version=_integer(doc["version"], "version", 1),
        created=_string(doc["created"], "created"),
        publisher=_hex64(doc["publisher"], "publisher"),
        tokenizers=tokenizers,
        shards=shards,
    )


def sign_manifest(manifest: Manifest, key: SigningKey) -> bytes:
    """Hex signature (ASCII bytes) of the manifest's canonical bytes."""
    return key.sign(manifest.to_bytes()).signature.hex().encode("ascii")


MAX_SIGNATURE_LINES = 4


def verify_manifest(raw: bytes, signature_hex: bytes, publisher_key: bytes, source: str) -> Manifest:
    """Parse `raw` only if a line of `signature_hex` is the pinned publisher's signature over it.

    The signature file holds one hex signature per line: the publisher writes the new
    manifest's signature and the one in force before it, then the new manifest. A reader
    between the two writes (or after a publish that died between them) still finds a line
    that verifies the manifest it sees.
    """
    try:
        lines = signature_hex.decode("ascii").split()
        signatures = [bytes.fromhex(line) for line in lines[:MAX_SIGNATURE_LINES]]
    except (ValueError, UnicodeDecodeError):
        raise ManifestError(f"{source}: signature file is not hex") from None
    if not any(signature_is_valid(publisher_key, raw, s) for s in signatures):
        raise ManifestError(
            f"{source}: signature does not verify against the pinned publisher key {publisher_key.hex()[:16]}…"
        )
    manifest = Manifest.from_bytes(raw, source)
    if manifest.publisher != publisher_key.hex():
        raise ManifestError(f"{source}: names publisher {manifest.publisher[:16]}…, not the pinned key")
    return manifest


def read_manifest(directory: Path, publisher_key: bytes) -> Manifest:
    """Load and verify `directory/manifest.json` against the pinned publisher key."""
    path = directory / MANIFEST_NAME
    try:
        raw = path.read_bytes()
        sig = (directory / SIGNATURE_NAME).read_bytes()
    except FileNotFoundError as exc:
        raise ManifestError(f"no data set at {directory}: {Path(exc.filename).name} is missing") from None
    return verify_manifest(raw, sig, publisher_key, str(path))
