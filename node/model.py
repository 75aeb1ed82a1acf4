"""The decoder-only transformer, cut into stages of contiguous layers.

Pre-norm RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467), rotary position
embeddings (Su et al. 2021, arXiv:2104.09864), SwiGLU MLP (Shazeer 2020,
arXiv:2002.05202), causal attention through ``F.scaled_dot_product_attention``,
untied embedding and head, no biases, no dropout.

A *stage* (``Transformer``) holds a contiguous range of layers, optionally the
embedding and the head. Parameter names use global layer indices and every
parameter draws its initial values from its own generator seeded by its global
name, so a stage's weights equal the full model's weights for the same layers,
whatever the staging.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# Presets without vocab_size (the tokenizer decides it). Parameter counts at vocab 4096,
# measured with ModelConfig.num_params(): tiny 1.85M, small 29.5M. The GPU presets take
# Llama-style shapes (ffn_dim = 8/3·dim rounded up to a multiple of 256, head_dim 64; Touvron
# et al. 2023) without grouped-query attention. Memory to train one replica (estimate_memory;
# parameters counted on the meta device, vocab 32768, batch 8 x 2048 tokens, bf16 autocast):
#
#   preset  params   device: weights+grads+AdamW  activations  (checkpointed)  CPU: θ_round+momentum+Δ
#   125m    135.3M    2.0 GiB                       8.8 GiB      5.0 GiB         1.5 GiB
#   350m    375.4M    5.6 GiB                      16.8 GiB      6.0 GiB         4.2 GiB
#   1b      956.4M   14.3 GiB                      21.0 GiB      7.1 GiB        10.7 GiB
#
# Activations scale with batch x seq (halve the batch, halve them); 4.0 GiB of each is the fp32
# logits and their gradient at this vocab. So the 1b preset needs a 24 GiB GPU with activation
# checkpointing at batch 8 x 2048, or a 48 GiB one without. Measured on an H100 (allocator peak,
# bench/bench_memory.py): 125m 13.8 (7.3 checkpointed), 350m 28.8 (10.9), 1b 42.6 (18.6) GiB on
# the device — the estimate runs 20-28% low without checkpointing (logit transients, fragmentation).
MODEL_SIZES: MappingProxyType[str, MappingProxyType[str, int]] = MappingProxyType(
    {
        # micro: ~50k parameters at vocab 512 — process-level tests and protocol demos, not learning.
        "micro": MappingProxyType({"dim": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64, "max_seq_len": 64}),
        "tiny": MappingProxyType(
            {"dim": 128, "n_layers": 4, "n_heads": 4, "ffn_dim": 352, "max_seq_len": 256}
        ),
        "small": MappingProxyType(
            {"dim": 512, "n_layers": 8, "n_heads": 8, "ffn_dim": 1376, "max_seq_len": 512}
        ),
        # GPT-3 Small / OPT-125M width and depth.
        "125m": MappingProxyType(
            {"dim": 768, "n_layers": 12, "n_heads": 12, "ffn_dim": 2048, "max_seq_len": 2048}
        ),
        # GPT-3 Medium / OPT-350M width and depth.
        "350m": MappingProxyType(
            {"dim": 1024, "n_layers": 24, "n_heads": 16, "ffn_dim": 2816, "max_seq_len": 2048}
        ),
        # Llama-3.2-1B's width and depth (dim 2048, 16 layers, 32 heads) with TinyLlama's ffn_dim.
        "1b": MappingProxyType(
            {"dim": 2048, "n_layers": 16, "n_heads": 32, "ffn_dim": 5632, "max_seq_len": 2048}
        ),
    }
)

TRAIN_STATE_BYTES_PER_PARAM = 16
"""On the device: fp32 master weights (4) + fp32 gradients (4) + AdamW's two fp32 moments (8).
Autocast keeps no bf16 weight copy beyond the per-op casts (freed after each op)."""
ROUND_STATE_BYTES_PER_PARAM = 12
"""On the CPU: θ_round (4) + the outer Nesterov momentum (4) + Δ while the round runs (4); the
round's encoded parts and received contributions add about 2·d values (ARCHITECTURE.md). Next
to a CUDA model θ_round and the momentum are page-locked, and torch's pinned allocator rounds
each up to a power of two bytes (up to twice these 8)."""

# Standard deviation of the normal initialisation of embeddings and linears (GPT-2, Radford et al. 2019).
INIT_STD = 0.02


@dataclass(kw_only=True)
class ModelConfig:
    """The architecture of the whole model; every stage and every node builds from the same one."""

    vocab_size: int
    """Number of token ids (embedding rows and head outputs); set by the tokenizer."""
    dim: int
    """Width of the residual stream, C in the shape comments."""
    n_layers: int
    """Number of transformer blocks in the whole model (all stages together)."""
    n_heads: int
    """Attention heads per block; dim must be divisible by it."""
    ffn_dim: int
    """Hidden width of the SwiGLU MLP; ≈ 8/3·dim keeps its cost equal to a 4·dim GELU MLP (Shazeer 2020)."""
    max_seq_len: int
    """Longest sequence in tokens; sizes the rotary tables."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (Su et al. 2021)."""
    norm_eps: float = 1e-5
    """Added to the mean square in RMSNorm so an all-zero vector does not divide by zero."""
    init_seed: int = 0
    """Seed every node derives θ₀ from; equal seeds give bit-equal initial weights."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.init_seed, int) or isinstance(self.init_seed, bool):
            raise ValueError(f"ModelConfig.init_seed must be an int, got {self.init_seed!r}")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"ModelConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim = dim / n_heads = {self.dim} / {self.n_heads} = {self.head_dim} must be even "
                "for rotary embeddings (they rotate pairs of channels)"
            )
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"ModelConfig.norm_eps must be > 0, got {self.norm_eps!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def named(cls, size: str, *, vocab_size: int, **overrides: Any) -> ModelConfig:
        """A preset from MODEL_SIZES with the tokenizer's vocab_size and optional field overrides."""
        if size not in MODEL_SIZES:
            raise ValueError(f"unknown model size {size!r}; known sizes: {sorted(MODEL_SIZES)}")
        return cls(**{**MODEL_SIZES[size], "vocab_size": vocab_size, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}; expected a subset of {sorted(names)}")
        return cls(**data)

    def fingerprint(self) -> str:
        """sha256 hex of the canonical JSON of the fields; checkpoints refuse a config with another one."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def architecture_fingerprint(self) -> str:
        """Like fingerprint() but without vocab_size: a checkpoint stays loadable when the
        tokenizer grows (the embedding and head then grow with it, see vocab.py)."""
        fields = {k: v for k, v in self.to_dict().items() if k != "vocab_size"}
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def num_params(self, *, layers: range | None = None, embedding: bool = True, head: bool = True) -> int:
        """Parameter count of a stage (default: the whole model), computed without building it."""
        n_blocks = self.n_layers if layers is None else len(layers)
        per_block = 4 * self.dim * self.dim + 3 * self.dim * self.ffn_dim + 2 * self.dim
        total = n_blocks * per_block
        if embedding:
            total += self.vocab_size * self.dim
        if head:
            total += self.vocab_size * self.dim + self.dim  # head + final norm
        return total


class RMSNorm(nn.Module):
    """x / rms(x) · g (Zhang & Sennrich 2019): no mean subtraction, no bias."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(config: ModelConfig) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, each (max_seq_len, head_dim/2), float32."""
    half = config.head_dim // 2
    inv_freq = config.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)  # (half,)
    angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float64), inv_freq)  # (T, half)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + head_dim/2) of x (B, H, T, hd) by position-dependent angles (T, hd/2)."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, H, T, hd/2) each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions; q, k, v from one fused projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.proj = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, H, T, hd) each
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x)) (Shazeer 2020)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.up = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.down = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def param_seed(init_seed: int, name: str) -> int:
    """A 63-bit generator seed from the run's init_seed and a parameter's global name (never hash())."""
    digest = hashlib.sha256(f"{init_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Transformer(nn.Module):
    """One stage: layers ``layers`` (global indices), plus the embedding and/or head if asked."""

    # Residual output projections start smaller so the residual stream's variance does not
    # grow with depth: std 0.02 / sqrt(2·n_layers), two residual branches per layer (GPT-2).
    RESIDUAL_OUTPUTS: ClassVar[tuple[str, ...]] = (".attn.proj.weight", ".mlp.down.weight")
    rope_cos: Tensor  # (max_seq_len, head_dim/2) buffer
    rope_sin: Tensor  # (max_seq_len, head_dim/2) buffer

    def __init__(
        self,
        config: ModelConfig,
        *,
        layers: range | None = None,
        embedding: bool = True,
        head: bool = True,
    ) -> None:
        super().__init__()
        layers = range(config.n_layers) if layers is None else layers
        if layers.step != 1 or (len(layers) > 0 and (layers.start < 0 or layers.stop > config.n_layers)):
            raise ValueError(
                f"layers {layers} must be a contiguous range (step 1) inside range(0, {config.n_layers})"
            )
        self.config = config
        self.layer_range = layers
        self.activation_checkpointing = False
        """Recompute each block's activations in backward (torch.utils.checkpoint): keeps only the
        blocks' inputs, (B, T, C) each, for about one more forward of compute."""
        self.embedding = nn.Embedding(config.vocab_size, config.dim) if embedding else None
        self.layers = nn.ModuleDict({str(k): Block(config) for k in layers})
        self.norm = RMSNorm(config.dim, config.norm_eps) if head else None
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False) if head else None
        cos, sin = rope_tables(config)
        # Not persistent: derived from the config, so state_dict keys stay parameters only.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every parameter from its own generator so the values do not depend on the staging."""
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if param.is_meta:  # shapes only (counting a large preset): no values to draw
                continue
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = residual_std if name.endswith(self.RESIDUAL_OUTPUTS) else INIT_STD
            gen = torch.Generator().manual_seed(param_seed(self.config.init_seed, name))
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            param.copy_(values)

    def forward(self, x: Tensor) -> Tensor:
        """Token ids (B, T) if this stage has the embedding, else hidden (B, T, C); returns logits
        (B, T, V) if it has the head, else hidden (B, T, C)."""
        seq_len = x.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.config.max_seq_len}")
        if self.embedding is not None:
            x = self.embedding(x)  # (B, T, C)
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]  # (T, hd/2)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.layers.values():
            x = checkpoint(block, x, cos, sin, use_reentrant=False) if recompute else block(x, cos, sin)
        if self.head is not None and self.norm is not None:
            x = self.head(self.norm(x))  # (B, T, V)
        return x


def stage_layers(n_layers: int, stage: int, num_stages: int) -> range:
    """Global layer indices of ``stage``: contiguous, sizes differ by at most one, larger ones first."""
    if not 1 <= num_stages <= n_layers:
        raise ValueError(f"num_stages ({num_stages}) must be between 1 and n_layers ({n_layers})")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage ({stage}) must be in range(0, {num_stages})")
    base, extra = divmod(n_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def build_stage(config: ModelConfig, stage: int, num_stages: int) -> Transformer:
    """Stage ``stage`` of ``num_stages``: stage 0 holds the embedding, the last stage the head."""
    return Transformer(
        config,
        layers=stage_layers(config.n_layers, stage, num_stages),
        embedding=stage == 0,
        head=stage == num_stages - 1,
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a replica of a whole (single-stage) model needs to train, by where they live."""

    params: int
    train_state: int
    """Weights, gradients and AdamW moments on the device (TRAIN_STATE_BYTES_PER_PARAM each)."""
    activations: int
    """Activations kept for backward for one batch (an estimate, see `estimate_memory`)."""
    round_state: int
    """θ_round, outer momentum and Δ on the CPU (ROUND_STATE_BYTES_PER_PARAM each)."""

    @property
    def device_total(self) -> int:
        return self.train_state + self.activations


def estimate_memory(
    config: ModelConfig,
    *,
    batch: int,
    seq: int,
    autocast: bool = True,
    activation_checkpointing: bool = False,
) -> MemoryEstimate:
    """Training memory of one replica. Activations follow Korthikanti et al. 2022 (arXiv:2205.05198,
    eq. 1 without the attention-score term, which SDPA's flash/memory-efficient kernels do not
    keep): ~34·T·B·C bytes per layer in 16-bit, doubled in fp32, plus the fp32 logits and their
    gradient (2 · 4·B·T·V). With activation checkpointing each block keeps only its fp32 input
    (4·B·T·C) and one block's full activations are alive at a time."""
    n = config.num_params()
    per_layer = 34 * batch * seq * config.dim * (1 if autocast else 2)
    logits = 2 * 4 * batch * seq * config.vocab_size
    if activation_checkpointing:
        acts = config.n_layers * 4 * batch * seq * config.dim + per_layer + logits
    else:
        acts = config.n_layers * per_layer + logits
    return MemoryEstimate(
        params=n,
        train_state=TRAIN_STATE_BYTES_PER_PARAM * n,
        activations=acts,
        round_state=ROUND_STATE_BYTES_PER_PARAM * n,
    )


def cross_entropy_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross-entropy of logits (B, T, V) against labels (B, T); -100 labels are skipped."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
