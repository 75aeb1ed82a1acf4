"""Where the inner loop runs and in what precision: `--device` and `--precision`.

The inner loop (forward, backward, inner AdamW) runs on the device. Master weights stay float32
there (autocast computes matmuls in bf16/fp16 from fp32 weights); θ_round, the outer momentum,
encoding, aggregation and the weight hash stay on the CPU in fp32. The outer step's arithmetic
runs on CUDA where the model is, in float32 operations that each round once
(`node.diloco.outer_sgd_step`: no fused multiply-add), which give the CPU's bits; elsewhere it
runs on the CPU. So a stage whose replicas train on different devices or precisions still ends
every round bit-identical.

Pure torch: the CLI parses the flags and calls `resolve`.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class Placement:
    """A resolved device and precision: what the inner loop of one replica runs on."""

    device: torch.device
    """Where the model, the inner optimizer's state and the batches live."""
    precision: str = "fp32"
    """fp32, or bf16/fp16 autocast over fp32 master weights (fp16 adds loss scaling)."""

    def __post_init__(self) -> None:
        if self.precision not in AUTOCAST_DTYPES and self.precision != "fp32":
            raise ValueError(
                f"precision must be one of fp32, bf16, fp16 after resolving, got {self.precision!r}"
            )

    @classmethod
    def cpu(cls) -> Placement:
        return cls(device=torch.device("cpu"), precision="fp32")

    @property
    def kind(self) -> str:
        """cpu, cuda or mps: what a receipt states (the index of a local GPU says nothing to others)."""
        return self.device.type

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return AUTOCAST_DTYPES.get(self.precision)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Autocast to the placement's low precision around forward and loss; a no-op in fp32."""
        dtype = self.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def to_device(self, tensor: Tensor) -> Tensor:
        """A batch tensor on the device; pinned and copied without blocking when on CUDA."""
        if tensor.device == self.device:
            return tensor
        if self.is_cuda and tensor.device.type == "cpu":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    def fused_adamw(self) -> bool:
        """Whether AdamW's single-kernel (fused) update exists here: CPU and CUDA since torch 2.4,
        MPS since 2.5; elsewhere the per-tensor loop."""
        if self.device.type in ("cpu", "cuda"):
            return True
        return self.device.type == "mps" and _torch_at_least(2, 5)

    def describe(self) -> str:
        """'cuda:0 (NVIDIA H100 80GB HBM3), bf16 autocast' — for the node's start-up line."""
        where = str(self.device)
        if self.is_cuda:
            where += f" ({torch.cuda.get_device_name(self.device)})"
        how = "fp32" if self.precision == "fp32" else f"{self.precision} autocast, fp32 master weights"
        return f"{where}, {how}"


def _torch_at_least(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


def resolve_device(name: str) -> torch.device:
    """auto → CUDA if available, else MPS, else CPU; explicit names are checked to exist."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; expected one of {', '.join(DEVICES)}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: this torch build sees no CUDA device")
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return torch.device("cuda", index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device mps: MPS is not available on this machine")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {name!r}: supported are {', '.join(DEVICES)}")
    return device


def resolve_precision(precision: str, device: torch.device) -> str:
    """auto → bf16 autocast on a CUDA device that supports bf16, fp32 elsewhere (CPU bf16 autocast
    is slower than fp32 on most CPUs; MPS bf16 support varies by OS version)."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def resolve(device: str = "auto", precision: str = "auto") -> Placement:
    """The placement the flags ask for; on CUDA also allows TF32 matmuls (fp32 master weights
    keep their precision; only matmul inputs round to TF32's 10-bit mantissa)."""
    resolved = resolve_device(device)
    placement = Placement(device=resolved, precision=resolve_precision(precision, resolved))
    if placement.is_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return placement


def snapshot_to_cpu(value: Any) -> Any:
    """A deep copy of nested dicts, lists and tuples with every tensor copied to the CPU.

    CUDA tensors are copied into pinned host memory without blocking and waited for once at the
    end: one synchronisation for the whole snapshot instead of one pageable copy per tensor (a
    125M model's weights and AdamW moments are 1.1 GB). Pinned blocks come from PyTorch's caching
    host allocator, so a checkpoint every few minutes reuses them; it rounds blocks up to powers
    of two and keeps them page-locked, so up to twice one snapshot's size stays pinned (the
    trainer holds one snapshot at a time)."""
    pending: list[torch.device] = []

    def take(v: Any) -> Any:
        if isinstance(v, Tensor):
            if v.is_cuda:
                out = torch.empty(v.shape, dtype=v.dtype, device="cpu", pin_memory=True)
                out.copy_(v.detach(), non_blocking=True)
                if v.device not in pending:
                    pending.append(v.device)
                return out
            return v.detach().to("cpu", copy=True)
        if isinstance(v, dict):
            return {k: take(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return type(v)(take(x) for x in v)
        return copy.deepcopy(v)

    result = take(value)
    for device in pending:
        torch.cuda.synchronize(device)
    return result


class CopyStream:
    """Copies host batches to the device on a side stream, so the copy of batch i+1 overlaps the
    compute of batch i (CUDA); elsewhere a plain, synchronous copy."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self._stream = torch.cuda.Stream(device=placement.device) if placement.is_cuda else None

    def start(self, tensor: Tensor) -> Tensor:
        """Begin moving a host tensor to the device; `ready` before using the result."""
        if self._stream is None:
            return self.placement.to_device(tensor)
        with torch.cuda.stream(self._stream):
            return self.placement.to_device(tensor)

    def ready(self, tensor: Tensor) -> Tensor:
        """Make the compute stream wait for the copy, and keep the memory alive for it."""
        if self._stream is not None:
            current = torch.cuda.current_stream(self.placement.device)
            current.wait_stream(self._stream)
            tensor.record_stream(current)
        return tensor
