"""The run's pipeline codec in the signed network definition: the default for a new run, old
served definitions without it, a round trip through the served document, and a refusal of unknown
codecs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from neuroshard.node.actcodec import DEFAULT_CODEC
from neuroshard.node.aggregation import DEFAULT_CLIPPING, LEGACY_CLIPPING, Clipping
from neuroshard.node.network_definition import (
    DEFAULT_ANCHOR_FLOOR,
    NetworkDefinition,
    NetworkError,
    parse_network,
    sign_network,
    verify_network,
)
from neuroshard.node.wallet import Wallet

OPERATOR = Wallet.from_token("network-definition-test-operator")


def _doc(**stages: Any) -> dict[str, Any]:
    return {
        "name": "codec-test",
        "model": {"size": "micro", "vocab_size": 512},
        "stages": {"count": 2, **stages},
        "training": {"batch_size": 4, "seq_len": 32},
        "data": {"manifest_url": "https://cdn.example.org/ns/", "publisher_key": "ab" * 32},
    }


def test_a_network_toml_without_a_codec_takes_the_default_fitted43() -> None:
    assert DEFAULT_CODEC == "fitted43"
    net = parse_network(_doc())
    assert net.pipeline_codec == "fitted43"
    assert json.loads(net.canonical_bytes())["stages"] == {
        "count": 2,
        "codec": "fitted43",
    }  # signed explicitly


def test_a_served_definition_without_a_codec_still_means_int8() -> None:
    """Signed bytes keep their meaning: a served document with no codec predates codecs."""
    assert parse_network({**_doc(), "format": 1}, served=True).pipeline_codec == "int8"
    assert parse_network(_doc(), served=True).pipeline_codec == "int8"


def test_a_single_stage_definition_keeps_its_codec_bytes() -> None:
    """The codec is unused at one stage: int8 keeps the [stages] bytes what they were before
    fitted43 became the default (the embedded verifier's definition, whose digest names its
    database and round files, is built in code: the next test)."""
    doc = {**_doc(), "stages": {"count": 1}}
    net = parse_network(doc)
    assert net.pipeline_codec == "int8"
    assert json.loads(net.canonical_bytes())["stages"] == {"count": 1, "codec": "int8"}
    assert parse_network({k: v for k, v in doc.items() if k != "stages"}).pipeline_codec == "int8"


def test_the_embedded_definition_keeps_int8(published) -> None:  # type: ignore[no-untyped-def]
    from neuroshard.node.diloco import DiLoCoConfig
    from neuroshard.node.model import ModelConfig
    from neuroshard.node.reporting import embedded_definition

    model = ModelConfig.named("micro", vocab_size=published.dataset.tokenizer.vocab_size)
    net = embedded_definition(published.dataset, model, DiLoCoConfig(), batch_size=2, seq_len=32)
    assert net.num_stages == 1 and net.pipeline_codec == "int8"
    # Nor does the network.toml's outer warm-up reach it: its bytes, and the digest that names its
    # database, stay what they were.
    assert net.diloco.outer_warmup_rounds == 0
    assert "outer_warmup_rounds" not in json.loads(net.canonical_bytes())["diloco"]


def test_an_old_served_definition_without_the_codec_still_verifies() -> None:
    """A definition signed before codecs existed: its bytes have no [stages] codec."""
    old = json.loads(parse_network(_doc()).canonical_bytes())
    del old["stages"]["codec"]
    body = json.dumps(old, sort_keys=True, separators=(",", ":")).encode()
    served = verify_network(body, OPERATOR.sign(body).hex(), OPERATOR.public_key)
    assert served.pipeline_codec == "int8" and served.num_stages == 2


@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8", "hadamard4", "hadamard43", "fitted43"])
def test_the_codec_is_signed_and_served(codec: str) -> None:
    net = parse_network(_doc(codec=codec))
    body, signature = sign_network(net, OPERATOR)
    assert json.loads(body)["stages"] == {"count": 2, "codec": codec}
    assert verify_network(body, signature, OPERATOR.public_key) == net


@pytest.mark.parametrize("bad", ["int3", "", 8, None, ["int8"]])
def test_unknown_codecs_are_refused_naming_the_value(bad: Any) -> None:
    with pytest.raises(NetworkError, match=r"\[stages\] codec"):
        parse_network(_doc(codec=bad))


def test_a_definition_built_in_code_is_checked_too() -> None:
    net = parse_network(_doc())
    fields = {f: getattr(net, f) for f in net.__dataclass_fields__}
    with pytest.raises(NetworkError, match="codec 'int3'"):
        NetworkDefinition(**{**fields, "pipeline_codec": "int3"})


def test_segment_steps_default_to_a_fortieth_of_a_round_and_travel_signed() -> None:
    """[training] segment_steps is k of the segment checks (issue 17). A network.toml without it
    gets H/40, written into the signed bytes so nodes commit with the verifier's k; a served
    definition without it (signed before the default) keeps H/10 and its bytes."""
    plain = parse_network({**_doc(), "diloco": {"inner_steps": 80}})
    assert plain.segment_steps == 2 and plain.segment_k == 2
    body, signature = sign_network(plain, OPERATOR)
    assert json.loads(body)["training"]["segment_steps"] == 2
    assert verify_network(body, signature, bytes.fromhex(OPERATOR.public_key_hex)) == plain
    assert parse_network({**_doc(), "diloco": {"inner_steps": 20}}).segment_k == 1  # at least one step
    older = json.loads(plain.canonical_bytes())
    del older["training"]["segment_steps"]
    legacy = parse_network(older, served=True)
    assert legacy.segment_steps is None and legacy.segment_k == 8
    assert "segment_steps" not in json.loads(legacy.canonical_bytes())["training"]
    doc = {
        **_doc(),
        "diloco": {"inner_steps": 40},
        "training": {"batch_size": 4, "seq_len": 32, "segment_steps": 5},
    }
    chosen = parse_network(doc)
    body, signature = sign_network(chosen, OPERATOR)
    served = verify_network(body, signature, bytes.fromhex(OPERATOR.public_key_hex))
    assert served.segment_steps == 5 and served.segment_k == 5 and served == chosen


@pytest.mark.parametrize("bad", [0, -3, 2.5, "5", 41])
def test_a_segment_length_outside_the_round_is_refused(bad: object) -> None:
    doc = {
        **_doc(),
        "diloco": {"inner_steps": 40},
        "training": {"batch_size": 4, "seq_len": 32, "segment_steps": bad},
    }
    with pytest.raises(NetworkError, match="segment_steps"):
        parse_network(doc)


def test_a_network_toml_without_an_anchor_floor_gets_the_default_signed() -> None:
    """The anchored round is part of the default defence (issue 13): a network.toml that names no
    [aggregation] anchor_floor gets 0.1, written into the signed bytes; a served definition without
    the key means none, so definitions signed before the default keep their meaning."""
    assert DEFAULT_ANCHOR_FLOOR == 0.1
    plain = parse_network(_doc())
    assert plain.anchor_floor == 0.1
    assert json.loads(plain.canonical_bytes())["aggregation"] == {
        "rule": "default",
        "f": 0,
        "anchor_floor": 0.1,
        "clip_scale": 1.25,
        "clip_iterations": 3,
    }
    body, signature = sign_network(plain, OPERATOR)
    assert verify_network(body, signature, bytes.fromhex(OPERATOR.public_key_hex)) == plain
    old = json.loads(body)
    del old["aggregation"]["anchor_floor"]
    assert parse_network(old, served=True).anchor_floor is None


def test_a_network_toml_without_clipping_knobs_gets_the_default_and_an_old_served_one_keeps_its_bytes() -> (
    None
):
    """Centered clipping's τ scale and iterations (issue 13): a network.toml that names neither
    gets DEFAULT_CLIPPING, signed; a served definition without the keys means the legacy (1, 1)
    and re-serialises to the bytes it was served as; a key named alone takes the other's default."""
    assert parse_network(_doc()).clip == DEFAULT_CLIPPING == Clipping(1.25, 3)
    old = json.loads(parse_network(_doc()).canonical_bytes())
    del old["aggregation"]["clip_scale"], old["aggregation"]["clip_iterations"]
    served = parse_network(old, served=True)
    assert served.clipping is None and served.clip == LEGACY_CLIPPING == Clipping(1.0, 1)
    assert json.loads(served.canonical_bytes()) == old
    assert parse_network({**_doc(), "aggregation": {"clip_iterations": 1}}).clip == Clipping(1.25, 1)
    assert parse_network(
        {**old, "aggregation": {**old["aggregation"], "clip_scale": 2}}, served=True
    ).clip == Clipping(2.0, 1)
    chosen = parse_network({**_doc(), "aggregation": {"clip_scale": 1, "clip_iterations": 2}})
    body, signature = sign_network(chosen, OPERATOR)
    assert verify_network(body, signature, bytes.fromhex(OPERATOR.public_key_hex)).clip == Clipping(1.0, 2)


@pytest.mark.parametrize(
    ("aggregation", "match"),
    [
        ({"clip_scale": 0}, "clip scale must be in"),
        ({"clip_scale": float("inf")}, "clip scale must be in"),
        ({"clip_scale": "wide"}, "clip_scale must be a number"),
        ({"clip_scale": True}, "clip_scale must be a number"),
        ({"clip_iterations": 0}, "clip iterations must be an integer in 1..10"),
        ({"clip_iterations": 11}, "clip iterations must be an integer in 1..10"),
        ({"clip_iterations": 2.0}, "clip iterations must be an integer"),
    ],
)
def test_clipping_knobs_that_cannot_work_are_refused(aggregation: Any, match: str) -> None:
    with pytest.raises(NetworkError, match=match):
        parse_network({**_doc(), "aggregation": aggregation})


def test_an_anchor_floor_named_false_is_off_and_leaves_no_key() -> None:
    off = parse_network({**_doc(), "aggregation": {"anchor_floor": False}})
    assert off.anchor_floor is None
    assert "anchor_floor" not in json.loads(off.canonical_bytes())["aggregation"]
    chosen = parse_network({**_doc(), "aggregation": {"anchor_floor": -0.2}})
    body, signature = sign_network(chosen, OPERATOR)
    assert verify_network(body, signature, bytes.fromhex(OPERATOR.public_key_hex)).anchor_floor == -0.2


def test_plain_outer_sgd_gets_no_anchor_by_default() -> None:
    """The anchor is the outer momentum buffer: without momentum there is none to default to."""
    plain_sgd = {"outer_momentum": 0.0, "outer_nesterov": False}
    assert parse_network({**_doc(), "diloco": plain_sgd}).anchor_floor is None


@pytest.mark.parametrize(
    ("aggregation", "diloco", "match"),
    [
        ({"anchor_floor": 1.5}, {}, "in \\[-1, 1\\]"),
        ({"anchor_floor": "high"}, {}, "must be a number"),
        ({"anchor_floor": 0.1}, {"outer_momentum": 0.0, "outer_nesterov": False}, "outer momentum"),
    ],
)
def test_an_anchor_floor_that_cannot_work_is_refused(aggregation: Any, diloco: Any, match: str) -> None:
    with pytest.raises(NetworkError, match=match):
        parse_network({**_doc(), "aggregation": aggregation, "diloco": diloco})
