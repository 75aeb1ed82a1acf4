"""The signed manifest: which shards exist, their hashes, and the tokenizer they were made with.

`manifest.json` is canonical JSON (sorted keys, no spaces); `manifest.json.sig` holds the
hex Ed25519 signature of exactly those bytes by the publisher. A reader checks the
signature against a pinned publisher key before it trusts a single field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nacl.signing import SigningKey

from .keys import signature_is_valid

MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.json.sig"
MANIFEST_FORMAT = 2


class ManifestError(ValueError):
    """A manifest that is missing, malformed, or not signed by the pinned publisher."""


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
            doc = json.loads(raw)
            return _parse(doc)
        except (ValueError, KeyError, TypeError) as exc:
            raise ManifestError(f"{source} is malformed: {exc}") from None


def _parse(doc: dict[str, Any]) -> Manifest:
    if doc.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"format {doc.get('format')!r}, this reader understands {MANIFEST_FORMAT}")
    tokenizers = tuple(
        TokenizerInfo(file=str(t["file"]), sha256=str(t["sha256"]), next_merge_id=int(t["next_merge_id"]))
        for t in doc["tokenizers"]
    )
    if not tokenizers:
        raise ValueError("no tokenizer")
    merge_ids = [t.next_merge_id for t in tokenizers]
    if merge_ids != sorted(set(merge_ids)):
        raise ValueError(f"tokenizer lineage must grow strictly, got next_merge_id {merge_ids}")
    shards = tuple(
        ShardInfo(
            id=int(s["id"]),
            file=str(s["file"]),
            sha256=str(s["sha256"]),
            tokens=int(s["tokens"]),
            tokenizer_sha256=str(s["tokenizer_sha256"]),
        )
        for s in doc["shards"]
    )
    ids = [s.id for s in shards]
    if ids != list(range(len(ids))):
        raise ValueError("shard ids must be 0..n-1 in order")
    for s in shards:
        if "/" in s.file or s.file.startswith("."):
            raise ValueError(f"shard {s.id} file name {s.file!r} is not a plain file name")
        if s.tokens <= 0:
            raise ValueError(f"shard {s.id} has {s.tokens} tokens")
    if int(doc["version"]) < 1:
        raise ValueError(f"version {doc['version']} must be >= 1")
    return Manifest(
        version=int(doc["version"]),
        created=str(doc["created"]),
        publisher=str(doc["publisher"]),
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
