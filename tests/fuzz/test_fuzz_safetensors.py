"""Property: every binary decoder of the peer plane (Δ parts, replica state, pipeline gradients,
fraud proofs) answers any body with its tensors or a Refused (400/422), nothing else.

Bodies: random bytes; a random JSON header behind a correct length prefix; the exact expected
header with one entry's dtype, shape or offsets replaced by any JSON; and the exact header
with random payload bytes (NaN, inf, int8 -128, non-zero padding)."""

import json
import struct
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

from neuroshard.node.codec import Layout, decode_delta, decode_state, delta_layout
from neuroshard.node.p2p.auth import status_of
from neuroshard.node.p2p.pipeline_wire import decode_gradient, gradient_layout
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.round import FraudProof

EXAMPLES = 120
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
NUMEL = 300  # two int8 blocks, the second padded
SIZES = {"F16": 2, "BF16": 2, "F32": 4, "I8": 1, "I32": 4}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)

Decoder = Callable[[bytes], Any]
DECODERS: dict[str, tuple[Decoder, Layout]] = {
    "codec.decode_delta fp16": (lambda b: decode_delta(b, "fp16", NUMEL), delta_layout("fp16", NUMEL)),
    "codec.decode_delta int8": (lambda b: decode_delta(b, "int8", NUMEL), delta_layout("int8", NUMEL)),
    "codec.decode_state": (
        lambda b: decode_state(b, NUMEL, with_momentum=True),
        {"theta_round": ("F32", (NUMEL,)), "momentum": ("F32", (NUMEL,))},
    ),
    "pipeline_wire.decode_gradient": (
        lambda b: decode_gradient(b, (2, 3, 4), "bf16"),
        gradient_layout(2, 3, 4, "bf16"),
    ),
    # Codes and scales: bad scales (NaN, inf, negative, overflowing), the code -2^(bits-1), padding.
    "pipeline_wire.decode_gradient int8": (
        lambda b: decode_gradient(b, (2, 3, 70), "int8"),
        gradient_layout(2, 3, 70, "int8"),
    ),
    "pipeline_wire.decode_gradient hadamard4": (
        lambda b: decode_gradient(b, (2, 3, 70), "hadamard4"),
        gradient_layout(2, 3, 70, "hadamard4"),
    ),
    "pipeline_wire.decode_gradient hadamard43": (
        lambda b: decode_gradient(b, (2, 3, 70), "hadamard43"),
        gradient_layout(2, 3, 70, "hadamard43"),
    ),
    # Dithered midrise codes: every code is a level; the dither comes from the scales' bytes.
    "pipeline_wire.decode_gradient fitted43": (
        lambda b: decode_gradient(b, (2, 3, 70), "fitted43"),
        gradient_layout(2, 3, 70, "fitted43"),
    ),
}


def _header(layout: Layout) -> dict[str, Any]:
    header, at = {}, 0
    for name in sorted(layout):
        dtype, shape = layout[name]
        size = SIZES[dtype]
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + size]}
        at += size
    return header


def _payload_bytes(header: dict[str, Any]) -> int:
    return max(entry["data_offsets"][1] for entry in header.values())


def _body(header_json: bytes, payload: bytes) -> bytes:
    return struct.pack("<Q", len(header_json)) + header_json + payload


def _record(tally: Any, label: str, decode: Decoder, data: bytes) -> None:
    try:
        out = decode(data)
    except Refused as exc:
        tally.add(label, status_of(exc.code))
        return
    except Exception:
        tally.add(label, 500)
        raise
    tally.add(label, 200)
    tensors = out if isinstance(out, tuple) else (out,)
    assert all(t is None or isinstance(t, Tensor) for t in tensors)


@pytest.mark.parametrize("label", list(DECODERS))
def test_any_body(label: str, tally: Any) -> None:
    decode, layout = DECODERS[label]
    expected = _header(layout)
    size = _payload_bytes(expected)

    @FUZZ
    @given(
        body=st.one_of(
            st.binary(max_size=600),
            st.tuples(json_values, st.binary(max_size=64)).map(
                lambda hp: _body(json.dumps(hp[0]).encode(), hp[1])
            ),
            st.integers(min_value=300, max_value=1_400).map(lambda n: _body(b"[" * n + b"]" * n, b"")),
        )
    )
    def run(body: bytes) -> None:
        _record(tally, f"{label} (any body)", decode, body)

    run()
    assert size > 0


@pytest.mark.parametrize("label", list(DECODERS))
def test_expected_header_with_one_entry_broken(label: str, tally: Any) -> None:
    decode, layout = DECODERS[label]
    expected = _header(layout)

    @FUZZ
    @given(
        tensor=st.sampled_from(sorted(expected)),
        field=st.sampled_from(["dtype", "shape", "data_offsets"]),
        value=json_values | st.lists(st.integers(min_value=-(2**70), max_value=2**70), max_size=3),
    )
    def run(tensor: str, field: str, value: Any) -> None:
        header = json.loads(json.dumps(expected))
        header[tensor][field] = value
        _record(
            tally,
            f"{label} (header broken)",
            decode,
            _body(json.dumps(header).encode(), b"\0" * _payload_bytes(expected)),
        )

    run()


@pytest.mark.parametrize("label", list(DECODERS))
def test_expected_header_with_random_values(label: str, tally: Any) -> None:
    decode, layout = DECODERS[label]
    expected = _header(layout)
    header_json = json.dumps(expected).encode()
    size = _payload_bytes(expected)

    @FUZZ
    @given(payload=st.binary(min_size=size, max_size=size), cut=st.integers(min_value=-2, max_value=2))
    def run(payload: bytes, cut: int) -> None:
        body = _body(header_json, payload)
        body = body[: len(body) + cut] if cut < 0 else body + b"\0" * cut
        _record(tally, f"{label} (payload)", decode, body)

    run()


def test_fraud_proof_decode(tally: Any) -> None:
    @FUZZ
    @given(
        body=st.one_of(
            st.binary(max_size=400),
            st.tuples(json_values, st.binary(max_size=64)).map(
                lambda hp: _body(json.dumps(hp[0]).encode(), hp[1])
            ),
            st.tuples(json_values, json_values, json_values).map(
                lambda v: _body(json.dumps({"claim": v[0], "inputs": v[1], "sizes": v[2]}).encode(), b"")
            ),
        )
    )
    def run(body: bytes) -> None:
        _record(tally, "outer FraudProof.decode", FraudProof.decode, body)

    run()
