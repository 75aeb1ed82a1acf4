"""Δ and state codecs: round trips, determinism, and refusal of anything that is not our layout."""

import io
import pickle
import struct

import pytest
import torch
from safetensors.torch import save as st_save
from tests_support import refused

from neuroshard.node.codec import (
    INT8_BLOCK,
    all_finite,
    decode_delta,
    decode_state,
    delta_size_bound,
    encode_delta,
    encode_state,
    int8_relative_error,
)

INT8_ERROR_BOUND = 0.01
"""Measured: 0.0070 relative L2 error on Gaussian Δ (d=100k, block 256); the bound leaves headroom."""


def _delta(n: int = 10_000, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e-3


def test_fp16_round_trip_is_exact_to_fp16() -> None:
    x = _delta()
    y = decode_delta(encode_delta(x, "fp16"), "fp16", x.numel())
    assert torch.equal(y, x.half().float())
    assert float((y - x).norm() / x.norm()) < 1e-3


@pytest.mark.parametrize("n", [1, 255, 256, 257, 10_000])
def test_int8_round_trip_within_measured_error(n: int) -> None:
    x = _delta(n)
    y = decode_delta(encode_delta(x, "int8"), "int8", n)
    assert y.shape == (n,) and y.dtype == torch.float32
    err = float((y - x).norm() / x.norm())
    assert err == pytest.approx(int8_relative_error(x))
    assert err < INT8_ERROR_BOUND
    # The largest value of each block is represented exactly (scale = max|x| / 127, code ±127).
    assert float(y.abs().max()) == pytest.approx(float(x.abs().max()), rel=1e-6)


def test_int8_zero_blocks_and_sizes() -> None:
    x = torch.zeros(3 * INT8_BLOCK)
    x[-1] = 2.0
    y = decode_delta(encode_delta(x, "int8"), "int8", x.numel())
    assert torch.equal(y, x)
    assert len(encode_delta(_delta(100_000), "int8")) < 0.52 * len(encode_delta(_delta(100_000), "fp16"))
    for encoding in ("fp16", "int8"):
        for n in (1, 300, 100_000):
            assert len(encode_delta(_delta(n), encoding)) <= delta_size_bound(n)


@pytest.mark.parametrize("encoding", ["fp16", "int8"])
def test_encoding_is_deterministic(encoding: str) -> None:
    assert encode_delta(_delta(), encoding) == encode_delta(_delta().clone(), encoding)


def test_encoder_refuses_what_the_receiver_would() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        encode_delta(torch.tensor([1.0, float("nan")]), "int8")
    with pytest.raises(ValueError, match="beyond fp16"):
        encode_delta(torch.tensor([1e6]), "fp16")
    with pytest.raises(ValueError, match="1-D float32"):
        encode_delta(torch.zeros(2, 2), "fp16")


def test_truncated_payload_is_malformed() -> None:
    data = encode_delta(_delta(), "int8")
    for cut in (3, 20, len(data) // 2, len(data) - 1):
        with refused("malformed"):
            decode_delta(data[:cut], "int8", 10_000)
    with refused("malformed", match="trailing"):
        decode_delta(data + b"\0", "int8", 10_000)


def test_pickle_and_torch_save_are_not_safetensors() -> None:
    buffer = io.BytesIO()
    torch.save({"delta": _delta()}, buffer)
    for data in (buffer.getvalue(), pickle.dumps(_delta())):
        with refused("malformed", match="not a safetensors file"):
            decode_delta(data, "fp16", 10_000)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"delta": torch.zeros(10_000)}, "expected F16"),  # fp32 where fp16 is promised
        ({"delta": torch.zeros(9_999, dtype=torch.float16)}, "expected F16 \\[10000\\]"),
        (
            {"delta": torch.zeros(10_000, dtype=torch.float16), "x": torch.zeros(1)},
            "differ from the expected",
        ),
        ({"other": torch.zeros(10_000, dtype=torch.float16)}, "differ from the expected"),
    ],
)
def test_wrong_layout_is_malformed(tensors, message) -> None:
    with refused("malformed", match=message):
        decode_delta(st_save(tensors), "fp16", 10_000)


def test_metadata_header_is_refused() -> None:
    data = st_save({"delta": torch.zeros(10, dtype=torch.float16)}, metadata={"a": "b"})
    with refused("malformed", match="differ from the expected"):
        decode_delta(data, "fp16", 10)


def test_a_deeply_nested_or_overlong_header_is_malformed() -> None:
    """A safetensors header is JSON from the network: hostile nesting and numbers are refused, not a crash."""
    for header in (
        b"[" * 3000 + b"]" * 3000,
        b'{"delta": {"dtype": "F16", "shape": [' + b"1" * 5000 + b"]}}",
    ):
        with refused("malformed"):
            decode_delta(struct.pack("<Q", len(header)) + header, "fp16", 10)


def test_header_length_larger_than_body_is_malformed() -> None:
    with refused("malformed", match="not a safetensors file"):
        decode_delta(struct.pack("<Q", 10**12) + b"{}", "fp16", 10)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_invalid(bad: float) -> None:
    x = torch.zeros(300, dtype=torch.float16)
    x[7] = bad
    with refused("invalid", match="1 non-finite values"):
        decode_delta(st_save({"delta": x}), "fp16", 300)
    q = torch.zeros(2, INT8_BLOCK, dtype=torch.int8)
    scale = torch.tensor([1.0, bad])
    with refused("invalid", match="int8 scales must be finite, non-negative"):
        decode_delta(st_save({"q": q, "scale": scale}), "int8", 300)


def test_int8_code_range_and_padding_are_checked() -> None:
    q = torch.zeros(2, INT8_BLOCK, dtype=torch.int8)
    scale = torch.ones(2)
    q[0, 0] = -128
    with refused("invalid", match="-128"):
        decode_delta(st_save({"q": q, "scale": scale}), "int8", 300)
    q[0, 0] = 0
    q[1, -1] = 5  # value 511 > numel 300: padding
    with refused("invalid", match="padding"):
        decode_delta(st_save({"q": q, "scale": scale}), "int8", 300)
    with refused("invalid", match="int8 scales must be finite, non-negative"):
        decode_delta(st_save({"q": q * 0, "scale": -scale}), "int8", 300)


def test_int8_scale_that_would_overflow_is_invalid() -> None:
    q = torch.full((1, INT8_BLOCK), 127, dtype=torch.int8)
    scale = torch.tensor([torch.finfo(torch.float32).max / 100])
    with refused("invalid", match="at most FLT_MAX/127"):
        decode_delta(st_save({"q": q, "scale": scale}), "int8", INT8_BLOCK)


def test_all_finite_is_exact_where_the_fast_path_overflows() -> None:
    big = torch.full((1000,), 1e30)  # finite, but x·x overflows float32
    assert all_finite(big) and all_finite(torch.zeros(0)) and all_finite(_delta())
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = _delta()
        x[123] = bad
        assert not all_finite(x)
        big[5] = bad
        assert not all_finite(big)
        big[5] = 1e30


def test_state_round_trip_with_and_without_momentum() -> None:
    theta, momentum = _delta(seed=1), _delta(seed=2)
    t, m = decode_state(encode_state(theta, momentum), theta.numel(), with_momentum=True)
    assert torch.equal(t, theta) and m is not None and torch.equal(m, momentum)
    t, m = decode_state(encode_state(theta, None), theta.numel(), with_momentum=False)
    assert torch.equal(t, theta) and m is None
    with refused("malformed"):
        decode_state(encode_state(theta, None), theta.numel(), with_momentum=True)
    bad = theta.clone()
    bad[0] = float("nan")
    with refused("invalid", match="non-finite"):
        decode_state(st_save({"theta_round": bad}), theta.numel(), with_momentum=False)


def test_theta_hash_is_the_engines_hash() -> None:
    from neuroshard.node.diloco import tensor_digest

    x = _delta(1001)
    assert tensor_digest(x) == tensor_digest(x)
    assert tensor_digest(x[::2]) == tensor_digest(x[::2])  # non-contiguous views too
