"""The run's definition as the verifier serves it signed at GET /api/network, and its checks.

Lives in the node package because both sides need it: the verifier parses `network.toml`
into it and signs its canonical JSON (neuroshard.verifier.network); a node started with
`--join` fetches that JSON, checks the operator's signature and builds its stage from it
(neuroshard.node.verifier_client). The file format is documented in neuroshard.verifier.network.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from neuroshard.protocol.identity import verify

from .actcodec import CODECS, DEFAULT_CODEC, LEGACY_CODEC
from .aggregation import DEFAULT_CLIPPING, LEGACY_CLIPPING, RULES, Clipping
from .diloco import DiLoCoConfig
from .model import MODEL_SIZES, ModelConfig
from .outer.reduce import ANCHOR_FLOOR
from .wallet import Wallet

NETWORK_FORMAT = 1
OPERATOR_HEADER = "X-NeuroShard-Operator"
"""Response header of GET /api/network: the operator's public key (hex)."""
NETWORK_SIGNATURE_HEADER = "X-NeuroShard-Signature"
"""Response header of GET /api/network: hex Ed25519 signature of the exact body bytes."""

_TABLES = {"model", "stages", "diloco", "training", "aggregation", "data", "evaluation"}

DEFAULT_OUTER_WARMUP_ROUNDS = 3
"""``[diloco] outer_warmup_rounds`` of a network.toml that names none: the outer lr ramps over a
run's first 3 rounds (lr/3, 2·lr/3, then lr). Part of the default defence (issue 13). In
bench/robustness.py (non-IID 8 + 2, 20 rounds) an attack present from round 0 could do most of
its damage in the first rounds: on one seed the edge attack cost 1.22× from round 0 and 1.07×
from round 3. Over 4 seeds the ramp took the default round's worst case over the attacks
measured from 1.130× to 1.083× of the clean loss. In absolute loss that is one seed's tail
(seed 0: 22% → 10% over clean), at a cost of 1.4% on the defended clean loss of those short
runs: a bet on the tail for a fixed slow start (bench/RESULTS.md). A served definition without
the key, and a DiLoCoConfig built in code (a lone node, the embedded verifier), mean 0: the
bytes signed before this default keep their meaning."""


DEFAULT_ANCHOR_FLOOR = ANCHOR_FLOOR
"""``[aggregation] anchor_floor`` of a network.toml that names none, when its outer momentum is > 0:
the anchored round is part of the default defence (issue 13; README, "The anchored round").
Simulated over 20 rounds with 2 colluders among 10 (2 seeds): on non-IID replicas a sign flip
1.092× → 1.026× the clean loss, the worst adaptive attack 1.093× → 1.075×, honest refusals in
clean runs 33 → 1 of 320; on IID replicas unchanged (two-seed means ≤ 1.002×). ``anchor_floor = false`` turns it
off. A served definition without the key, and a definition built in code (a lone node, the
embedded verifier), mean no anchor: the bytes signed before this default keep their meaning."""


DEFAULT_SEGMENTS_PER_ROUND = 40
"""``[training] segment_steps`` of a network.toml that names none: k = H/40 (at least 1), so the
verifier's four segment checks of a round cost about a tenth of that round's work (4 · k/H = 0.1,
plus the check's overhead; verifier.budget) while a replica that fakes 10% of its segments is
caught within 11 rounds with ≥ 99% probability (issue 17, bench/bench_replay.py). The price is the
replica's: H/40 + 1 checkpoints a round instead of H/10 + 1 (12 bytes per parameter each, hashed
and written off the training thread; node.segments). A served definition without the key, and a
definition built in code, mean H/10 (`LEGACY_SEGMENTS_PER_ROUND`): the bytes signed before this
default keep their meaning, and nodes that commit with that k keep passing the count check."""
LEGACY_SEGMENTS_PER_ROUND = 10


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
    held_out_shard: int = 0
    """The shard the verifier measures on; no node trains on it (data.assign_shards excludes it).
    Shard 0 by default: it exists in every manifest and a newer manifest version never renumbers it."""
    pipeline_codec: str = LEGACY_CODEC
    """``[stages] codec``: how activations and their gradients cross stage boundaries
    (node.actcodec.CODECS); every replica of the run must use it. A multi-stage network.toml
    without it gets the default, fitted43 (int8 before 2026-11-27: a run that named none and
    must keep int8 names it now); a served document or a single-stage run without it means int8
    (actcodec.LEGACY_CODEC), as does this field's default (code that builds a multi-stage
    definition names its codec). Unused when num_stages is 1."""
    anchor_floor: float | None = None
    """``[aggregation] anchor_floor``: from the round after the first, refuse a contributor whose
    whole Δ's cosine to the outer momentum buffer is below this, and screen each part with the
    wider ``validation.ANCHORED_VALIDATION`` (``node.outer.reduce.AnchorCheck``). None: no anchor
    check, the node's per-part limits in every round (a served definition without the key, a
    network.toml that names it false; a network.toml that names none gets `DEFAULT_ANCHOR_FLOOR`).
    Needs outer momentum > 0."""
    clipping: Clipping | None = None
    """``[aggregation] clip_scale`` and ``clip_iterations``: centered clipping's τ as a multiple of
    the median distance, and its iterations, wherever the rule is or falls back to centered
    clipping (the default rule for n ≥ 5; ``aggregation.network_rule``). A network.toml that names
    neither gets `aggregation.DEFAULT_CLIPPING` (1.25, 3 iterations); None (a served definition
    without the keys, one built in code) means `aggregation.LEGACY_CLIPPING` (1, 1)."""
    segment_steps: int | None = None
    """``[training] segment_steps``: k, inner steps per committed segment (node.segments); a spot
    check replays one segment, so it costs about k/H of the round it checks. A network.toml that
    names none gets H/40 (`DEFAULT_SEGMENTS_PER_ROUND`); None (a served definition without the key,
    one built in code): H/10."""

    def __post_init__(self) -> None:
        if self.pipeline_codec not in CODECS:
            raise NetworkError(f"[stages] codec {self.pipeline_codec!r} is not one of {', '.join(CODECS)}")
        if self.anchor_floor is not None and not -1.0 <= self.anchor_floor <= 1.0:
            raise NetworkError(
                f"[aggregation] anchor_floor {self.anchor_floor} is a cosine: it must be in [-1, 1]"
            )
        if self.anchor_floor is not None and self.diloco.outer_momentum <= 0:
            raise NetworkError(
                "[aggregation] anchor_floor needs an outer momentum > 0: the anchor is its buffer"
            )
        if self.segment_steps is not None and not 1 <= self.segment_steps <= self.diloco.inner_steps:
            raise NetworkError(
                f"[training] segment_steps {self.segment_steps} must be in 1..inner_steps ({self.diloco.inner_steps})"
            )

    @property
    def clip(self) -> Clipping:
        """The run's clipping knobs: `clipping`, or the legacy (1, 1) when it names none."""
        return self.clipping or LEGACY_CLIPPING

    @property
    def segment_k(self) -> int:
        """The run's segment length: `segment_steps`, or H/10 (at least 1) when it has none."""
        return self.segment_steps or max(1, self.diloco.inner_steps // LEGACY_SEGMENTS_PER_ROUND)

    def to_document(self) -> dict[str, Any]:
        diloco = dataclasses.asdict(self.diloco)
        diloco["betas"] = list(self.diloco.betas)
        # Only when non-zero: definitions signed before the field existed keep their bytes.
        if not diloco["outer_warmup_rounds"]:
            del diloco["outer_warmup_rounds"]
        return {
            "format": NETWORK_FORMAT,
            "name": self.name,
            "model": self.model.to_dict(),
            "stages": {"count": self.num_stages, "codec": self.pipeline_codec},
            "diloco": diloco,
            # segment_steps only when set: definitions signed before it existed keep their bytes
            "training": {"batch_size": self.batch_size, "seq_len": self.seq_len}
            | ({} if self.segment_steps is None else {"segment_steps": self.segment_steps}),
            # anchor_floor and the clipping only when set: definitions signed before them keep their bytes
            "aggregation": {"rule": self.aggregation_rule, "f": self.aggregation_f}
            | ({} if self.anchor_floor is None else {"anchor_floor": self.anchor_floor})
            | (
                {}
                if self.clipping is None
                else {"clip_scale": float(self.clipping.scale), "clip_iterations": self.clipping.iterations}
            ),
            "data": {"manifest_url": self.manifest_url, "publisher_key": self.publisher_key},
            "evaluation": {"every_rounds": self.evaluate_every_rounds, "held_out_shard": self.held_out_shard},
        }

    def canonical_bytes(self) -> bytes:
        return json.dumps(self.to_document(), sort_keys=True, separators=(",", ":")).encode("utf-8")

    def digest(self) -> str:
        """sha256 hex of `canonical_bytes`: names this run (segment commitments carry it)."""
        return hashlib.sha256(self.canonical_bytes()).hexdigest()


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


def parse_network(
    doc: dict[str, Any], source: str = "network.toml", *, served: bool = False
) -> NetworkDefinition:
    """A validated NetworkDefinition from the parsed TOML document, or (`served`) from a served,
    signed JSON one: the two differ only in what a key left out implies — the codec of a
    multi-stage definition (`pipeline_codec`), the outer warm-up (`DEFAULT_OUTER_WARMUP_ROUNDS`
    for a network.toml, 0 for a served definition), the anchor floor (`DEFAULT_ANCHOR_FLOOR`
    for a network.toml with outer momentum, none for a served definition), the clipping knobs
    (`aggregation.DEFAULT_CLIPPING` for a network.toml; none, meaning the legacy (1, 1), for a
    served one) and the segment length (H/40 for a network.toml, `DEFAULT_SEGMENTS_PER_ROUND`;
    none, meaning H/10, for a served one)."""
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
    implied = DEFAULT_CODEC if num_stages > 1 and not served else LEGACY_CODEC
    pipeline_codec = stages.pop("codec", implied)
    _no_leftovers(stages, f"{source}: [stages]")
    if not isinstance(pipeline_codec, str) or pipeline_codec not in CODECS:
        raise NetworkError(f"{source}: [stages] codec {pipeline_codec!r} is not one of {', '.join(CODECS)}")
    if not 1 <= num_stages <= model.n_layers:
        raise NetworkError(f"{source}: [stages] count {num_stages} must be in 1..n_layers ({model.n_layers})")
    diloco_table = _table(doc, "diloco", source)
    if not served:
        diloco_table.setdefault("outer_warmup_rounds", DEFAULT_OUTER_WARMUP_ROUNDS)
    diloco = _diloco(diloco_table, source)
    training = _table(doc, "training", source)
    batch_size = _int(training, "batch_size", f"{source}: [training]", 8)
    seq_len = _int(training, "seq_len", f"{source}: [training]", 128)
    implied_k = None if served else max(1, diloco.inner_steps // DEFAULT_SEGMENTS_PER_ROUND)
    segment_steps = training.pop("segment_steps", implied_k)
    if segment_steps is not None and (type(segment_steps) is not int or segment_steps < 1):
        raise NetworkError(
            f"{source}: [training] segment_steps must be a positive integer, got {segment_steps!r}"
        )
    _no_leftovers(training, f"{source}: [training]")
    if batch_size < 1 or not 1 <= seq_len <= model.max_seq_len:
        raise NetworkError(
            f"{source}: [training] batch_size {batch_size} must be ≥ 1 and seq_len {seq_len} "
            f"in 1..max_seq_len ({model.max_seq_len})"
        )
    aggregation = _table(doc, "aggregation", source)
    rule = _check_rule(aggregation.pop("rule", "default"), source)
    f = _int(aggregation, "f", f"{source}: [aggregation]", 0)
    implied_floor = DEFAULT_ANCHOR_FLOOR if not served and diloco.outer_momentum > 0 else None
    anchor_floor = aggregation.pop("anchor_floor", implied_floor)
    if anchor_floor is False:  # named off
        anchor_floor = None
    if anchor_floor is not None and (
        type(anchor_floor) not in (int, float) or isinstance(anchor_floor, bool)
    ):
        raise NetworkError(
            f"{source}: [aggregation] anchor_floor must be a number (a cosine) or false, got {anchor_floor!r}"
        )
    clipping = _clipping(aggregation, source, served=served)
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
    held_out = _int(evaluation, "held_out_shard", f"{source}: [evaluation]", 0)
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
        held_out_shard=held_out,
        pipeline_codec=pipeline_codec,
        segment_steps=segment_steps,
        anchor_floor=None if anchor_floor is None else float(anchor_floor),
        clipping=clipping,
    )


def _clipping(aggregation: dict[str, Any], source: str, *, served: bool) -> Clipping | None:
    """``[aggregation] clip_scale`` and ``clip_iterations``; a key left out takes the default's
    value in a network.toml and the legacy one in a served definition, which names neither when
    it predates them (None: its bytes and meaning stay)."""
    if served and "clip_scale" not in aggregation and "clip_iterations" not in aggregation:
        return None
    implied = LEGACY_CLIPPING if served else DEFAULT_CLIPPING
    scale = aggregation.pop("clip_scale", implied.scale)
    iterations = aggregation.pop("clip_iterations", implied.iterations)
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise NetworkError(f"{source}: [aggregation] clip_scale must be a number, got {scale!r}")
    try:
        return Clipping(float(scale), iterations)
    except ValueError as exc:
        raise NetworkError(f"{source}: [aggregation] {exc}") from None


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
    return parse_network(doc, "served network definition", served=True)
