"""The run's definition (`network.toml`), and the operator key that signs it.

The verifier owns the definition and serves it at GET /api/network as canonical JSON
(sorted keys, no spaces) with an Ed25519 signature of exactly those bytes by the operator
key, so a joining node can check it against the operator key it was given. A minimal file:

    name = "demo"

    [model]              # node.model.ModelConfig: a preset `size` and/or any of its fields
    size = "tiny"
    vocab_size = 4096

    [stages]
    count = 1            # pipeline stages; 1 = plain DiLoCo data parallelism

    [diloco]             # node.diloco.DiLoCoConfig fields (defaults where omitted)
    inner_steps = 100

    [training]
    batch_size = 8       # sequences per inner step (spot checks replay with these)
    seq_len = 128

    [aggregation]
    rule = "default"     # node.aggregation: a rule name, "default" or "nnm+<rule>"
    f = 0                # tolerated Byzantine replicas per stage

    [data]
    manifest_url = "https://cdn.example.org/neuroshard/"
    publisher_key = "<64 hex>"

    [evaluation]
    every_rounds = 5     # measure the held-out loss every this many rounds
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nacl.signing import SigningKey

from neuroshard.data.keys import load_or_create_signing_key
from neuroshard.node.aggregation import RULES
from neuroshard.node.diloco import DiLoCoConfig
from neuroshard.node.model import MODEL_SIZES, ModelConfig
from neuroshard.node.wallet import Wallet, verify

NETWORK_FORMAT = 1
OPERATOR_HEADER = "X-NeuroShard-Operator"
"""Response header of GET /api/network: the operator's public key (hex)."""
NETWORK_SIGNATURE_HEADER = "X-NeuroShard-Signature"
"""Response header of GET /api/network: hex Ed25519 signature of the exact body bytes."""

_TABLES = {"model", "stages", "diloco", "training", "aggregation", "data", "evaluation"}


class NetworkError(ValueError):
    """A network.toml (or served definition) that is missing, malformed or inconsistent."""


@dataclass(frozen=True, kw_only=True)
class NetworkDefinition:
    name: str
    """Human name of the run, shown on the dashboard."""
    model: ModelConfig
    num_stages: int
    """Pipeline stages the model is cut into (node.model.stage_layers)."""
    diloco: DiLoCoConfig
    batch_size: int
    """Sequences per inner step; the spot checker replays batches of this size."""
    seq_len: int
    """Tokens per sequence (≤ model.max_seq_len)."""
    aggregation_rule: str
    aggregation_f: int
    """Byzantine replicas per stage the rule must tolerate."""
    manifest_url: str
    publisher_key: str
    """Hex Ed25519 public key that signs the data manifest."""
    evaluate_every_rounds: int = 5
    """The verifier measures the held-out loss every this many rounds."""

    def to_document(self) -> dict[str, Any]:
        diloco = dataclasses.asdict(self.diloco)
        diloco["betas"] = list(self.diloco.betas)
        return {
            "format": NETWORK_FORMAT,
            "name": self.name,
            "model": self.model.to_dict(),
            "stages": {"count": self.num_stages},
            "diloco": diloco,
            "training": {"batch_size": self.batch_size, "seq_len": self.seq_len},
            "aggregation": {"rule": self.aggregation_rule, "f": self.aggregation_f},
            "data": {"manifest_url": self.manifest_url, "publisher_key": self.publisher_key},
            "evaluation": {"every_rounds": self.evaluate_every_rounds},
        }

    def canonical_bytes(self) -> bytes:
        return json.dumps(self.to_document(), sort_keys=True, separators=(",", ":")).encode("utf-8")


def _table(doc: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    value = doc.get(name, {})
    if not isinstance(value, dict):
        raise NetworkError(f"{source}: [{name}] must be a table, got {type(value).__name__}")
    return dict(value)


def _int(table: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = table.pop(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise NetworkError(f"{where}.{key} must be a non-negative integer, got {value!r}")
    return value


def _no_leftovers(table: dict[str, Any], where: str) -> None:
    if table:
        raise NetworkError(f"{where}: unknown keys {sorted(table)}")


def _model(table: dict[str, Any], source: str) -> ModelConfig:
    size = table.pop("size", None)
    try:
        if size is None:
            return ModelConfig.from_dict(table)
        if size not in MODEL_SIZES:
            raise NetworkError(f"{source}: [model] size {size!r} is not one of {sorted(MODEL_SIZES)}")
        return ModelConfig.named(size, **table)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, NetworkError):
            raise
        raise NetworkError(f"{source}: [model]: {exc}") from None


def _diloco(table: dict[str, Any], source: str) -> DiLoCoConfig:
    if "betas" in table and isinstance(table["betas"], list):
        table["betas"] = tuple(table["betas"])
    names = {f.name for f in dataclasses.fields(DiLoCoConfig)}
    unknown = sorted(set(table) - names)
    if unknown:
        raise NetworkError(f"{source}: [diloco]: unknown keys {unknown}; known: {sorted(names)}")
    try:
        return DiLoCoConfig(**table)
    except (TypeError, ValueError) as exc:
        raise NetworkError(f"{source}: [diloco]: {exc}") from None


def _check_rule(rule: Any, source: str) -> str:
    base = rule[len("nnm+") :] if isinstance(rule, str) and rule.startswith("nnm+") else rule
    if not isinstance(rule, str) or (rule != "default" and base not in RULES):
        raise NetworkError(
            f"{source}: [aggregation] rule {rule!r} is not one of {sorted(RULES)}, 'default' or 'nnm+<rule>'"
        )
    return rule


def parse_network(doc: dict[str, Any], source: str = "network.toml") -> NetworkDefinition:
    """A validated NetworkDefinition from the parsed TOML (or the served JSON) document."""
    doc = dict(doc)
    doc.pop("format", None)
    name = doc.pop("name", "neuroshard")
    if not isinstance(name, str) or not name:
        raise NetworkError(f"{source}: name must be a non-empty string, got {name!r}")
    unknown = sorted(set(doc) - _TABLES)
    if unknown:
        raise NetworkError(f"{source}: unknown top-level keys {unknown}; known: {sorted(_TABLES)}")
    model = _model(_table(doc, "model", source), source)
    stages = _table(doc, "stages", source)
    num_stages = _int(stages, "count", f"{source}: [stages]", 1)
    _no_leftovers(stages, f"{source}: [stages]")
    if not 1 <= num_stages <= model.n_layers:
        raise NetworkError(f"{source}: [stages] count {num_stages} must be in 1..n_layers ({model.n_layers})")
    diloco = _diloco(_table(doc, "diloco", source), source)
    training = _table(doc, "training", source)
    batch_size = _int(training, "batch_size", f"{source}: [training]", 8)
    seq_len = _int(training, "seq_len", f"{source}: [training]", 128)
    _no_leftovers(training, f"{source}: [training]")
    if batch_size < 1 or not 1 <= seq_len <= model.max_seq_len:
        raise NetworkError(
            f"{source}: [training] batch_size {batch_size} must be ≥ 1 and seq_len {seq_len} "
            f"in 1..max_seq_len ({model.max_seq_len})"
        )
    aggregation = _table(doc, "aggregation", source)
    rule = _check_rule(aggregation.pop("rule", "default"), source)
    f = _int(aggregation, "f", f"{source}: [aggregation]", 0)
    _no_leftovers(aggregation, f"{source}: [aggregation]")
    data = _table(doc, "data", source)
    manifest_url = data.pop("manifest_url", "")
    publisher_key = data.pop("publisher_key", "")
    _no_leftovers(data, f"{source}: [data]")
    if not isinstance(manifest_url, str) or not manifest_url:
        raise NetworkError(f"{source}: [data] manifest_url must be a non-empty string")
    if not isinstance(publisher_key, str) or not re.fullmatch(r"[0-9a-f]{64}", publisher_key):
        raise NetworkError(f"{source}: [data] publisher_key must be 64 lower-case hex characters")
    evaluation = _table(doc, "evaluation", source)
    every = _int(evaluation, "every_rounds", f"{source}: [evaluation]", 5)
    _no_leftovers(evaluation, f"{source}: [evaluation]")
    if every < 1:
        raise NetworkError(f"{source}: [evaluation] every_rounds must be ≥ 1, got {every}")
    return NetworkDefinition(
        name=name,
        model=model,
        num_stages=num_stages,
        diloco=diloco,
        batch_size=batch_size,
        seq_len=seq_len,
        aggregation_rule=rule,
        aggregation_f=f,
        manifest_url=manifest_url,
        publisher_key=publisher_key,
        evaluate_every_rounds=every,
    )


def load_network(path: Path) -> NetworkDefinition:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise NetworkError(f"cannot read network definition {path}: {exc.strerror}") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise NetworkError(f"{path} is not valid TOML: {exc}") from None
    return parse_network(doc, str(path))


def sign_network(network: NetworkDefinition, operator: Wallet) -> tuple[bytes, str]:
    """(body, hex signature): what GET /api/network serves."""
    body = network.canonical_bytes()
    return body, operator.sign(body).hex()


def verify_network(body: bytes, signature_hex: str, operator_public_key: bytes) -> NetworkDefinition:
    """What a joining node does with GET /api/network: check the signature, then parse."""
    try:
        signature = bytes.fromhex(signature_hex)
    except ValueError:
        raise NetworkError("network signature is not hex") from None
    if not verify(operator_public_key, body, signature):
        raise NetworkError(
            f"network definition is not signed by the operator key {operator_public_key.hex()[:16]}…"
        )
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise NetworkError(f"network definition is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != NETWORK_FORMAT:
        raise NetworkError(f"network definition format is not {NETWORK_FORMAT}")
    return parse_network(doc, "served network definition")


def load_operator_key(path: Path, *, create: bool = False) -> Wallet:
    """The operator's signing key: a hex Ed25519 seed in a file (mode 0600), as a signer.

    With create=True a missing file is created with a fresh random key; otherwise a
    missing file is an error (a typo must not silently mint a new operator identity).
    """
    if not path.exists():
        if not create:
            raise NetworkError(
                f"operator key file {path} does not exist (create one with --init-operator-key)"
            )
        key, _ = load_or_create_signing_key(path)
        return Wallet(SigningKey(bytes(key)))
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise NetworkError(f"cannot read operator key file {path}: {exc}") from None
    mode = os.stat(path).st_mode
    if mode & 0o077:
        raise NetworkError(
            f"operator key file {path} is readable by other users (mode {mode & 0o777:o}); chmod 600 it"
        )
    if not re.fullmatch(r"[0-9a-fA-F]{64}", text):
        raise NetworkError(f"operator key file {path} must hold a 32-byte seed as 64 hex characters")
    return Wallet(SigningKey(bytes.fromhex(text)))
