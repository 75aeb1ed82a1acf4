"""Issue 19: hostile safetensors headers are Refused (a 400), whatever their size,
depth, dtype, shape or offsets; nothing else escapes `check_layout` or the decoders."""

import json
import struct
import sys

import pytest
import torch
from tests_support import refused

from neuroshard.node.codec import (
    MAX_HEADER_BYTES,
    check_layout,
    decode_delta,
    decode_state,
    delta_layout,
    encode_delta,
)

NUMEL = 4
LAYOUT = delta_layout("fp16", NUMEL)


def _body(header: bytes, payload: int = 2 * NUMEL) -> bytes:
    return struct.pack("<Q", len(header)) + header + b"\0" * payload


def _entry(**fields: object) -> bytes:
    entry = {"dtype": "F16", "shape": [NUMEL], "data_offsets": [0, 2 * NUMEL], **fields}
    return json.dumps({"delta": entry}).encode()


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("field", ["dtype", "shape", "data_offsets"])
@pytest.mark.parametrize("depth", [2, 100, 900, 995, 1200])
def test_nested_values_in_any_field_are_malformed(field: str, depth: int) -> None:
    """~1,000 deep fits a 4 KB header; its repr in an error message used to overflow the stack."""
    header = _entry(**{field: 0}).replace(f'"{field}": 0'.encode(), f'"{field}": {_nested(depth)}'.encode())
    assert len(header) <= MAX_HEADER_BYTES
    with refused("malformed"):
        check_layout(_body(header), LAYOUT)


def test_nested_header_fails_alike_near_the_recursion_limit() -> None:
    """Whatever the caller's stack depth, a deep header is refused, never a RecursionError."""

    def at_depth(frames: int) -> None:
        if frames:
            at_depth(frames - 1)
            return
        for depth in (300, 600, 990):
            header = _entry(shape=0).replace(b'"shape": 0', f'"shape": {_nested(depth)}'.encode())
            with refused("malformed"):
                check_layout(_body(header), LAYOUT)

    for frames in (0, 200, sys.getrecursionlimit() - 400):
        at_depth(frames)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"dtype": "F64"}, "dtype 'F64'"),
        ({"dtype": 16}, "dtype int"),
        ({"dtype": None}, "dtype NoneType"),
        ({"dtype": {"a": 1}}, "dtype dict"),
        ({"dtype": "I8"}, "is I8"),
        ({"shape": [NUMEL, 1]}, "expected F16"),
        ({"shape": [-4]}, "shape is not a list"),
        ({"shape": [1.5]}, "shape is not a list"),
        ({"shape": [True]}, "shape is not a list"),
        ({"shape": [2**64]}, "shape is not a list"),
        ({"shape": [1] * 9}, "shape is not a list"),
        ({"shape": "4"}, "shape is not a list"),
        ({"data_offsets": [8, 0]}, "bad data_offsets"),
        ({"data_offsets": [-8, 0]}, "bad data_offsets"),
        ({"data_offsets": [0, 8, 16]}, "bad data_offsets"),
        ({"data_offsets": [0, 10**300]}, "bad data_offsets"),
        ({"data_offsets": [0.0, 8.0]}, "bad data_offsets"),
        ({"data_offsets": [0, 6]}, "do not match its shape"),
    ],
)
def test_wrong_dtype_shape_and_offsets_are_named(fields: dict[str, object], message: str) -> None:
    with refused("malformed", match=message):
        check_layout(_body(_entry(**fields)), LAYOUT)


@pytest.mark.parametrize(
    "header",
    [
        b'{"delta": {"dtype": "F16", "dtype": "F16", "shape": [4], "data_offsets": [0, 8]}}',
        b'{"delta": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}, "delta": {}}',
        b'{"delta": {"dtype": "F16", "shape": [4], "data_offsets": [0, 1e999]}}',
        b'{"delta": {"dtype": "F16", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 8]}}',
        b'{"delta": {"dtype": NaN, "shape": [4], "data_offsets": [0, 8]}}',
        b"\xff" * 64,
        b"[]",
        b"7",
        b'"delta"',
    ],
    ids=[
        "dup key in entry",
        "dup tensor",
        "float overflow",
        "long int",
        "NaN",
        "not utf-8",
        "list",
        "number",
        "string",
    ],
)
def test_hostile_json_in_the_header_is_malformed(header: bytes) -> None:
    with refused("malformed"):
        check_layout(_body(header), LAYOUT)


@pytest.mark.parametrize("declared", [MAX_HEADER_BYTES + 1, 2**63, 2**64 - 1])
def test_oversized_header_length_is_malformed(declared: int) -> None:
    data = struct.pack("<Q", declared) + b"{}" + b"\0" * (MAX_HEADER_BYTES + 64)
    with refused("malformed", match="header length"):
        check_layout(data, LAYOUT)


def test_decoders_raise_only_wire_errors_on_a_nested_header() -> None:
    header = _entry(shape=0).replace(b'"shape": 0', f'"shape": {_nested(900)}'.encode())
    with refused("malformed"):
        decode_delta(_body(header), "fp16", NUMEL)
    with refused("malformed"):
        decode_state(_body(header), NUMEL, with_momentum=False)


def test_an_honest_body_still_decodes() -> None:
    x = torch.tensor([0.5, -1.0, 2.0, 0.0])
    assert torch.equal(decode_delta(encode_delta(x, "fp16"), "fp16", NUMEL), x)
