"""Activations and activation gradients for the pipeline wire, compressed: the maths only.

A stage boundary carries one (…, C) float tensor per micro-batch in each direction: the hidden
state forward, ∂loss/∂hidden back. A *format* says how one such tensor is packed; a *codec*
pairs a forward format with a backward one and is chosen per run (the network definition's
``[stages] codec``; ``p2p.pipeline_wire`` puts the packed tensors in its safetensors bodies).

Formats of x (…, C), cut along C into groups of ``GROUP`` = 64 values (the last zero-padded):

- ``bf16``, ``fp16``: x cast, 2 bytes per value (the wire before compression).
- ``int8``: absmax per group: scale s = max|x| / 127 (stored in bf16, rounded up) and codes
  round(x / s) in [-127, 127]; 64 + 2 bytes per 64 values = 8.25 bits. One range per group,
  not per tensor: activations have outlier channels (LLM.int8(), Dettmers et al. 2022) that a
  per-tensor range would let flatten every other channel to zero.
- ``h8``, ``h6``, ``h4``, ``h3``: the same with 8, 6, 4 or 3 bits after a fixed rotation of each group,
  y = H·D·x / 8 (H the 64×64 Sylvester–Hadamard matrix, D fixed ±1 signs): the rotation
  spreads one outlier over the whole group, so the group's range fits its typical values
  (QuaRot, Ashkboos et al. 2024; TAH-Quant, 2025, rotates pipeline activations the same way).
- ``m4``, ``m3``, ``m2``, ``m1``: the same rotation, then a *midrise* code fitted to the group
  instead of its range: all 2^bits codes are levels, at the odd multiples ±1, ±3, …,
  ±(2^bits − 1) of a half-step s; values beyond the outer level are clipped to it. The encoder
  picks s per group by least squared error among steps spanning the one that is optimal for a
  Gaussian of the group's root mean square σ (Max, "Quantizing for minimum distortion", 1960:
  1.596σ, 0.9957σ, 0.5860σ, 0.3352σ for 1–4 bits) and the range's, reaching half of the smaller
  below both. After the rotation a group is close to Gaussian, and at few bits the range is the
  wrong yardstick: a symmetric 2-bit absmax code has three levels (−s, 0, s) with s ≈ 2.6σ for
  64 Gaussian values, so most of the group decodes to 0 (relative error 0.72 on Gaussian data),
  where the fitted 4-level code has 0.34. At 1 bit it is the group's signs times one magnitude. Measured on the tiny model
  (bench/RESULTS.md, issue 17), they are the better code for activations at 2 bits (2-bit
  activations +2.9% held-out loss instead of +15%) and the worse one for 3-bit gradients (+0.070
  nats against +0.004): clipping and the missing zero make their error correlated with the
  gradient. At 2 bits gradients cost a quarter to a third of the loss in either code. The wire
  codec ``fitted43`` sends m4 forward.
- ``d4``, ``d3``, ``d2``, ``d1``: the midrise levels with *subtractive dither* (Roberts 1962; Schuchman
  1964): the half-step is set by the range, s = max|y| / (2^bits − 1), the encoder codes y/s + d
  and the decoder returns s·(q − d), d a pseudo-random value in (−1, 1) per value that both ends
  derive from the scales (``_dither``). Nothing is clipped, so each value's error lies in
  (−s, s] and, over the dither, is uniform with a mean within s/256 of 0 whatever the value (256
  dither levels): the decoded tensor is unbiased to that grain, where rounding's error is a fixed
  function of the value that adds up the same way in every token. (A group whose largest value
  is below qmax·2^−150 gets scale 0 and decodes to zeros, as in every format.) Measured on the
  tiny model (bench/RESULTS.md, issue 17): beside 4-bit activations, 2-bit dithered gradients
  cost +0.5% held-out loss (range-coded or fitted 2-bit ones: +26–33%) and 1-bit ones +2%;
  forward they do worse than the range code. The wire codec ``fitted43`` sends d3 back.

Scales are bf16, not fp16: ∂loss/∂hidden of a mean loss over B·T tokens is small. Measured on
the tiny model at 8×128 at initialisation: 7e-4 per value on average, int8 group scales 9e-6 to
2e-5, already below fp16's smallest normal (6.1e-5), so fp16 scales would be subnormal with a few
significant bits, and flush to zero for longer micro-batches; bf16 has fp32's exponent range at
the same 2 bytes. Rounding the scale up keeps every code within range; its 8-bit mantissa costs
at most 0.4% of a step.

Decoding depends only on the bytes and runs in a fixed order with one rounding per value:
codes unpacked with integer operations, the inverse rotation H·q computed on the integer codes
(exact in int32: |H·q| ≤ 64·127), then one float32 product with the group's scale, then ×1/8 and
×±1 (exact); dithered, H·(256·q − k) for d = k/256 (|·| < 2^18), ×1/2048 (exact), then the one
product with the scale and ×±1. So a decoded tensor is the same bits whatever the thread count
(tested) or the machine (every step is an IEEE-exact integer operation or one correctly rounded
float32 product), and the receiving stage's step is a pure function of what it was sent.
Encoding need not be: its output is hashed and signed as sent.

Codes are stored offset to unsigned, u = q + 2^(bits−1) in [1, 2^bits − 1] (midrise: u = (q +
2^bits − 1)/2 in [0, 2^bits − 1]), packed little-endian bit by bit (value i's bit j at bit
i·bits + j of its group's 8·bits bytes); u = 0 of a symmetric code (the asymmetric code
−2^(bits−1)) is refused, as are non-finite or negative scales and, without rotation, padding
that does not decode to zero. Midrise formats always rotate (their levels have no zero, so
padding cannot decode to zero without the rotation's mixing).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import Tensor

GROUP = 64
"""Values per quantisation group along the hidden dimension. Part of the protocol."""
_SCALE = 0.125
"""1/sqrt(GROUP): H/8 is orthonormal, and ×1/8 is exact in binary floating point."""


class PayloadError(ValueError):
    """Packed values that no honest encoder produces: bad codes, scales, padding or a non-finite result."""


def _fixed_signs() -> Tensor:
    """D: GROUP fixed ±1 signs, the bits of sha256("neuroshard/actcodec/signs/v1")."""
    digest = hashlib.sha256(b"neuroshard/actcodec/signs/v1").digest()
    bits = [(digest[i // 8] >> (i % 8)) & 1 for i in range(GROUP)]
    return torch.tensor([1 - 2 * b for b in bits], dtype=torch.int32)


_SIGNS = _fixed_signs()


@dataclass(frozen=True)
class Format:
    """How one (…, C) tensor travels."""

    name: str
    bits: int
    """Bits per value: 16 for the float casts, 1 to 8 for codes."""
    rotate: bool = False
    """Rotate each group by H·D/8 before quantising (quantised formats only)."""
    midrise: bool = False
    """Levels at the odd multiples of a half-step fitted to the group's spread (all 2^bits codes
    used, no zero level) instead of the symmetric absmax code (2^bits − 1 levels, 0 among them)."""
    dither: bool = False
    """Subtractive dither on a midrise code whose half-step is set by the range: every value's
    error averages to within 1/256 of a half-step of 0, whatever the value (module docstring)."""

    def __post_init__(self) -> None:
        if self.midrise and not self.rotate:
            raise ValueError(
                f"format {self.name}: a midrise code needs the rotation (see the module docstring)"
            )
        if self.dither and not self.midrise:
            raise ValueError(f"format {self.name}: dither is defined on midrise codes only")

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    @property
    def qmax(self) -> int:
        """The largest |q|: 2^(bits−1) − 1 for the symmetric code, 2^bits − 1 (odd q only) for midrise."""
        return 2**self.bits - 1 if self.midrise else 2 ** (self.bits - 1) - 1

    def bytes_per_row(self, dim: int) -> int:
        """Bytes of one (C,) row, e.g. one token's hidden state."""
        if not self.quantized:
            return 2 * dim
        return groups(dim) * (8 * self.bits + 2)


BF16 = Format("bf16", 16)
FP16 = Format("fp16", 16)
INT8 = Format("int8", 8)
FORMATS = MappingProxyType(
    {
        f.name: f
        for f in (
            BF16,
            FP16,
            INT8,
            Format("int4", 4),
            Format("h8", 8, True),
            Format("h6", 6, True),
            Format("h4", 4, True),
            Format("h3", 3, True),
            Format("m4", 4, True, True),
            Format("m3", 3, True, True),
            Format("m2", 2, True, True),
            Format("m1", 1, True, True),
            Format("d4", 4, True, True, True),
            Format("d3", 3, True, True, True),
            Format("d2", 2, True, True, True),
            Format("d1", 1, True, True, True),
        )
    }
)
_MIDRISE_STEP = MappingProxyType({1: 1.596, 2: 0.9957, 3: 0.5860, 4: 0.3352})
"""The squared-error-optimal step of a uniform quantiser with 2^bits levels on a unit Gaussian
(Max 1960, table II); a midrise group's half-step is s = σ·step/2."""
_CANDIDATES = 8
"""Half-steps an encoder tries per midrise group, log-spaced from `_BELOW` × the smaller of the
Gaussian fit and the range up to the larger."""
_BELOW = 0.5
"""How far below both the search reaches: a group dominated by one rotated outlier is two
clusters at ±a, which the outer levels of a finer code fit best (2 bits: s = a/3, under both)."""
_CASTS = {"bf16": (torch.bfloat16, "BF16"), "fp16": (torch.float16, "F16")}


@dataclass(frozen=True)
class Codec:
    """A pipeline codec: the format of activations forward and of their gradients back."""

    name: str
    forward: Format
    backward: Format


CODECS = MappingProxyType(
    {
        "bf16": Codec("bf16", BF16, BF16),
        "fp16": Codec("fp16", FP16, FP16),
        "int8": Codec("int8", INT8, INT8),
        # 4 bits forward, 6 back: gradients lose more to coarse codes than activations do
        # (TAH-Quant, 2025: ≈4.3 bits forward, ≈6.5 back at unchanged convergence on GPT-2 XL).
        "hadamard4": Codec("hadamard4", FORMATS["h4"], FORMATS["h6"]),
        # 4 bits forward, 3 back: under a quarter of bf16's bytes. Measured on the tiny model the
        # other way round from TAH-Quant: 3-bit gradients cost +0.004 nats (two seeds), 3-bit
        # activations +0.08; the codec over 17 seeds +0.033 ± 0.014 nats (bench/RESULTS.md, issue 17).
        "hadamard43": Codec("hadamard43", FORMATS["h4"], FORMATS["h3"]),
        # The same bytes in better codes: 4-bit codes fitted to each group forward, 3-bit dithered
        # (unbiased) codes back. Over the same 17 seeds +0.007 ± 0.006 nats (median +0.008),
        # within 0.01 on the mean though not shown to be; the default since 2026-11-27. Its
        # encoder costs ~43 ns per value on 2 threads, int8's ~10 (bench/RESULTS.md, issue 17).
        "fitted43": Codec("fitted43", FORMATS["m4"], FORMATS["d3"]),
    }
)
DEFAULT_CODEC = "fitted43"
"""A new pipeline run's codec when it names none (a multi-stage network.toml without ``[stages]
codec``; no ``--activation-codec`` outside a network): ≈0.24× bf16's bytes per token per
boundary, and over 17 seeds +0.007 ± 0.006 nats of held-out loss against float32
(bench/RESULTS.md, issue 17). Until 2026-11-27 it was int8 (≈0.52×)."""
LEGACY_CODEC = "int8"
"""What a definition that names no codec means where DEFAULT_CODEC does not apply: a served,
signed document (every verifier since codecs exist writes the codec into what it signs, so such
bytes come from before, when they meant int8, and a signature's meaning never changes), and a
single-stage run (no activation crosses a boundary; int8 keeps its definition's bytes, and so
the digest that names its database and round files, as they were)."""


def codec(name: str) -> Codec:
    if name not in CODECS:
        raise ValueError(f"pipeline codec {name!r} is not one of {', '.join(CODECS)}")
    return CODECS[name]


def groups(dim: int) -> int:
    return math.ceil(dim / GROUP)


# --- layout: the tensors a packed (…, C) tensor becomes ----------------------------------------

Layout = dict[str, tuple[str, tuple[int, ...]]]
"""Tensor name -> (safetensors dtype, shape), as `node.codec.check_layout` takes it."""


def codes_name(name: str) -> str:
    return f"{name}.codes"


def scales_name(name: str) -> str:
    return f"{name}.scales"


def layout(fmt: Format, name: str, shape: tuple[int, ...]) -> Layout:
    """The safetensors tensors of a (…, C) tensor `name` of `shape` packed in `fmt`."""
    if not fmt.quantized:
        return {name: (_CASTS[fmt.name][1], tuple(shape))}
    *lead, dim = shape
    g = groups(dim)
    return {
        codes_name(name): ("I8", (*lead, g, 8 * fmt.bits)),  # (…, G, 8·bits) packed codes
        scales_name(name): ("BF16", (*lead, g)),  # (…, G)
    }


# --- encoding (sender) ------------------------------------------------------------------------


def encode(x: Tensor, fmt: Format, name: str) -> dict[str, Tensor]:
    """x (…, C) finite floats -> the tensors of `layout(fmt, name, x.shape)`. ValueError if x has
    non-finite values, or values whose rotation overflows float32."""
    x = x.detach().float().contiguous()
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} has non-finite values (NaN or inf); refusing to encode it")
    if not fmt.quantized:
        return {name: x.to(_CASTS[fmt.name][0])}
    *lead, dim = x.shape
    g = groups(dim)
    padded = torch.zeros(*lead, g * GROUP, dtype=torch.float32)
    padded[..., :dim] = x
    y = padded.view(*lead, g, GROUP)  # (…, G, 64)
    if fmt.rotate:
        y = _hadamard(y * _SIGNS.float()) * _SCALE
        if not bool(torch.isfinite(y).all()):
            raise ValueError(f"{name}: values up to {float(x.abs().max()):.3g} overflow the rotation")
    if fmt.dither:
        return _encode_dithered(y, fmt, name)
    if fmt.midrise:
        return _encode_midrise(y, fmt, name)
    scale = _bf16_ceil(y.abs().amax(dim=-1) / fmt.qmax)  # (…, G) bf16
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group: codes 0, not NaN
    q = (y / safe[..., None]).round_().clamp_(-fmt.qmax, fmt.qmax).to(torch.int32)
    u = (q + (fmt.qmax + 1)).to(torch.uint8)
    return {codes_name(name): _pack(u, fmt.bits).view(torch.int8), scales_name(name): scale}


def _encode_midrise(y: Tensor, fmt: Format, name: str) -> dict[str, Tensor]:
    """y (…, G, 64) rotated groups -> codes u = (q + qmax)/2 of the odd q nearest y/s, for the
    half-step s (bf16) that gives each group the least squared error among `_CANDIDATES` steps
    around the Gaussian fit (σ·step/2) and the range (outer level at the group's absmax). A
    Gaussian group takes about the fitted step; one that an outlier channel dominates after the
    rotation takes another; the decoder does not care which. The per-group statistics are
    float64; the search runs in float32 on each group divided by its largest magnitude, so its
    squared errors are O(1) whatever the group's size: they neither overflow for huge groups nor
    underflow to ties for tiny ones, at half the cost of a float64 search. Groups are coded
    _ENCODE_CHUNK at a time, so the search's temporaries stay in cache (each group's code is its
    own: the same bits as a search over the whole tensor at once)."""
    rows = y.reshape(-1, GROUP)
    u = torch.empty(rows.shape, dtype=torch.uint8)
    scale = torch.empty(rows.shape[0], dtype=torch.bfloat16)
    for start in range(0, rows.shape[0], _ENCODE_CHUNK):
        part = slice(start, start + _ENCODE_CHUNK)
        u[part], scale[part] = _midrise_codes(rows[part], fmt)
    lead = y.shape[:-1]
    return {
        codes_name(name): _pack(u.reshape(*lead, GROUP), fmt.bits).view(torch.int8),
        scales_name(name): scale.reshape(lead),
    }


_ENCODE_CHUNK = 1024
"""Groups per step of the fitted code's search: 64K values, 512 KB in float64."""


def _midrise_codes(y: Tensor, fmt: Format) -> tuple[Tensor, Tensor]:
    """y (n, 64) rotated groups -> (codes u (n, 64) uint8, half-steps (n,) bf16): `_encode_midrise`'s search."""
    y64 = y.double()
    top = y64.abs().amax(dim=-1)  # (n,)
    fitted = y64.square().mean(dim=-1).sqrt() * (_MIDRISE_STEP[fmt.bits] / 2)
    ranged = top / fmt.qmax
    low, high = torch.minimum(fitted, ranged) * _BELOW, torch.maximum(fitted, ranged)
    ratio = torch.where(low > 0, high / low.clamp_min(1e-300), torch.ones_like(low))
    unit = torch.where(top > 0, top, torch.ones_like(top))  # an all-zero group: codes ±1 at scale 0
    yn = (y64 / unit[..., None]).float()  # (n, 64), within [−1, 1]
    best_err = torch.full(fitted.shape, float("inf"))
    best_scale = torch.zeros(fitted.shape, dtype=torch.bfloat16)
    for k in range(_CANDIDATES):
        scale = (low * ratio ** (k / (_CANDIDATES - 1))).float().to(torch.bfloat16)
        err = (_midrise_levels(yn, scale, unit, fmt) - yn).square_().sum(dim=-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
    q = _midrise_levels(yn, best_scale, unit, fmt, codes=True)
    u = ((q.to(torch.int32) + fmt.qmax) // 2).to(torch.uint8)
    return u, best_scale


def _midrise_levels(yn: Tensor, scale: Tensor, unit: Tensor, fmt: Format, codes: bool = False) -> Tensor:
    """The midrise level nearest each of the normalised groups `yn` (…, G, 64) at half-step
    `scale` (…, G): its value q·s/unit, or (codes) its odd q. A zero scale gives q = ±1 at 0."""
    sn = (scale.double() / unit).float()
    safe = torch.where(sn > 0, sn, torch.ones_like(sn))[..., None]
    q = (2 * torch.floor(yn / (2 * safe)) + 1).clamp_(-fmt.qmax, fmt.qmax)
    return q if codes else q.mul_(sn[..., None])


def _encode_dithered(y: Tensor, fmt: Format, name: str) -> dict[str, Tensor]:
    """y (…, G, 64) rotated groups -> midrise codes of y/s + d, s = absmax/qmax (bf16, rounded
    up) and d the dither that `_dither` draws from the scales: y/s + d stays in [−qmax − 1,
    qmax + 1), so nothing is clipped and s·(q − d) − y is uniform on (−s, s]."""
    scale = _bf16_ceil(y.abs().amax(dim=-1) / fmt.qmax)  # (…, G)
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))[..., None]  # an all-zero group decodes to 0
    v = y / safe + _dither(scale).float() / _DITHER_DEN
    q = (2 * torch.floor(v / 2) + 1).clamp_(-fmt.qmax, fmt.qmax)
    u = ((q.to(torch.int32) + fmt.qmax) // 2).to(torch.uint8)
    return {codes_name(name): _pack(u, fmt.bits).view(torch.int8), scales_name(name): scale}


_DITHER_DEN = 256
"""A dither value is k/256 for an odd k in (−256, 256): exact in float32, and 256·(q − d) an
integer, so the decoder's rotation stays on integers."""
_MASK32 = 0xFFFFFFFF


def _dither(scales: Tensor) -> Tensor:
    """scales (…, G) bf16 -> (…, G, 64) int32 odd numerators k, d = k/256 roughly uniform on
    (−1, 1): a 32-bit integer hash (two multiply–xorshift rounds) of each value's index, keyed
    by sha256 of the scales' bytes, so it differs between tensors and both ends compute it from
    what travels (little-endian, so every machine keys it alike). The products stay below 2^63
    for tensors of up to 2^31 values (index·0x9E3779B1, and 32-bit values times 0x45D9F3B).

    Computed in place, _DITHER_CHUNK indices at a time: two int64 buffers that stay in cache
    instead of a dozen tensor-sized temporaries, 4.3 against 47–50 ns per value on 2 threads
    (the same bits: tests/node/test_actcodec.py holds the whole-tensor reference)."""
    key = hashlib.sha256(
        b"neuroshard/actcodec/dither/v1"
        + scales.contiguous().view(torch.int16).numpy().astype("<i2").tobytes()
    )
    seed = int.from_bytes(key.digest()[:4], "little")
    n = scales.numel() * GROUP
    out = torch.empty(n, dtype=torch.int32)
    x = torch.empty(min(n, _DITHER_CHUNK), dtype=torch.int64)
    shifted = torch.empty_like(x)
    for start in range(0, n, _DITHER_CHUNK):
        m = min(_DITHER_CHUNK, n - start)
        xs, ts = x[:m], shifted[:m]
        torch.arange(start, start + m, out=xs)
        xs.mul_(0x9E3779B1).add_(seed).bitwise_and_(_MASK32)
        for _ in range(2):
            torch.bitwise_right_shift(xs, 16, out=ts)
            xs.bitwise_xor_(ts).mul_(0x45D9F3B).bitwise_and_(_MASK32)
        torch.bitwise_right_shift(xs, 16, out=ts)
        # The top 8 of the 32 bits -> odd k in [−255, 255].
        xs.bitwise_xor_(ts).bitwise_right_shift_(24).mul_(2).add_(1 - _DITHER_DEN)
        out[start : start + m] = xs
    return out.reshape(*scales.shape, GROUP)


_DITHER_CHUNK = 1 << 16
"""Indices per step of `_dither`: two 512 KB int64 buffers, within a core's L2 cache."""


def _bf16_ceil(s: Tensor) -> Tensor:
    """Non-negative finite float32 s -> the smallest bf16 ≥ s (so no code exceeds qmax)."""
    b = s.to(torch.bfloat16)
    low = b.float() < s
    bumped = (b.view(torch.int16) + 1).view(torch.bfloat16)  # next bf16 up, for positive b
    return torch.where(low, bumped, b)


def _pack(u: Tensor, bits: int) -> Tensor:
    """u (…, 64) uint8 < 2^bits -> (…, 8·bits) uint8, value i's bit j at bit i·bits + j."""
    if bits == 8:
        return u.contiguous()
    shifts = torch.arange(bits, dtype=torch.uint8)
    bitv = ((u.unsqueeze(-1) >> shifts) & 1).reshape(*u.shape[:-1], 8 * bits, 8)  # (…, 8b, 8)
    out = torch.zeros(bitv.shape[:-1], dtype=torch.uint8)
    for k in range(8):
        out |= bitv[..., k] << k
    return out


def _unpack(packed: Tensor, bits: int) -> Tensor:
    """The inverse of `_pack`: (…, 8·bits) uint8 -> (…, 64) uint8."""
    if bits == 8:
        return packed
    bitv = torch.stack([(packed >> k) & 1 for k in range(8)], dim=-1)  # (…, 8b, 8)
    bitv = bitv.reshape(*packed.shape[:-1], GROUP, bits)
    out = torch.zeros(bitv.shape[:-1], dtype=torch.uint8)
    for j in range(bits):
        out |= bitv[..., j] << j
    return out


def _hadamard(y: Tensor) -> Tensor:
    """H·y over the last dimension (GROUP, a power of two), unnormalised: log2(GROUP) butterfly
    stages of sums and differences in a fixed order. Exact on integer tensors."""
    n = y.shape[-1]
    lead = y.shape[:-1]
    h = 1
    while h < n:
        pairs = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    return y


# --- decoding (receiver) ----------------------------------------------------------------------


def decode(tensors: dict[str, Tensor], fmt: Format, name: str, shape: tuple[int, ...]) -> Tensor:
    """The tensors of `layout(fmt, name, shape)` (their layout already checked) -> float32 of
    `shape`, or PayloadError. A pure function of the bytes (see the module docstring)."""
    if not fmt.quantized:
        x = tensors[name].float()
        if not bool(torch.isfinite(x).all()):
            raise PayloadError(f"{name} has non-finite values (NaN or inf)")
        return x
    *lead, dim = shape
    scale = tensors[scales_name(name)].float()  # (…, G)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise PayloadError(f"{name}: scales must be finite and non-negative")
    u = _unpack(tensors[codes_name(name)].view(torch.uint8), fmt.bits)  # (…, G, 64)
    if fmt.midrise:  # every code is a level: q = 2u − qmax, odd, within ±qmax
        q = 2 * u.to(torch.int32) - fmt.qmax
    elif bool((u == 0).any()):
        raise PayloadError(f"{name}: code -{fmt.qmax + 1} is outside the symmetric range ±{fmt.qmax}")
    else:
        q = u.to(torch.int32) - (fmt.qmax + 1)
    if fmt.dither:  # 256·(q − d), an integer: |·| < 256·(qmax + 1), so |H·(·)| < 2^24 is exact
        scales = tensors[scales_name(name)]
        # ×1/2048 first (exact on these integers), so the one rounding is the last product's and
        # no intermediate is 2048× the value (which would overflow float32 above ~1.7e35).
        y = _hadamard(_DITHER_DEN * q - _dither(scales)).float() * (_SCALE / _DITHER_DEN)
        x = y * scale[..., None] * _SIGNS.float()
    elif fmt.rotate:
        # D·(H·q)·s/8: the integer transform is exact, then one rounding (×s), then exact ×1/8, ×±1.
        y = _hadamard(q).float() * scale[..., None]
        x = y * _SCALE * _SIGNS.float()
    else:
        pad = groups(dim) * GROUP - dim
        if pad and bool(q[..., -1, GROUP - pad :].any()):
            raise PayloadError(f"{name}: padding after the last of {dim} values must be zero")
        x = q.float() * scale[..., None]
    x = x.reshape(*lead, groups(dim) * GROUP)[..., :dim].contiguous()
    if not bool(torch.isfinite(x).all()):
        raise PayloadError(f"{name}: scales too large, decoded values are not finite")
    return x


def round_trip(x: Tensor, fmt: Format) -> Tensor:
    """decode(encode(x)): what the receiver gets for x, float32 (simulations, benchmarks, tests)."""
    return decode(encode(x, fmt, "x"), fmt, "x", tuple(x.shape))
