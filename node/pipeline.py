"""Pipeline stages, the maths side: one inner step of a stage whose neighbours live elsewhere.

SWARM-style pipelining (Ryabinin et al. 2023, arXiv:2301.11913) under DiLoCo
(DiLoCo-SWARM, Douillard et al.): stage 0 reads a batch and runs its layers; each later
stage runs its layers on the activations it receives; the last stage computes the loss;
gradients with respect to the activations flow back the same path; every replica steps
its own inner optimizer. Rounds stay per stage (see `diloco.DiLoCo`).

Pure torch. Where the next stage lives is hidden behind a `Downstream` callable — the
protocol layer (`p2p.pipeline`) supplies one that sends the activations over the network.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .diloco import DiLoCo, LossFn
from .model import ModelConfig, cross_entropy_loss

Downstream = Callable[[Tensor, Tensor], tuple[Tensor, float]]
"""(hidden (B, T, C) detached, labels (B, T)) -> (∂loss/∂hidden (B, T, C), loss): the rest of the
pipeline, from the next stage to the loss and back. Raises if no next stage could be reached."""


def stage_fingerprint(config: ModelConfig, num_stages: int) -> str:
    """What a stage's checkpoint must match: the architecture and, when S > 1, the staging (stage 0
    of 2 holds other layers than the whole model). S = 1 keeps the plain architecture fingerprint."""
    base = config.architecture_fingerprint()
    return base if num_stages == 1 else f"{base}/stages={num_stages}"


class _RemoteLoss(torch.autograd.Function):
    """The loss computed by the later stages: forward sends the hidden state on, backward
    returns the gradient they sent back (scaled by the incoming gradient, 1 for `.backward()`)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, labels: Tensor, downstream: Downstream) -> Tensor:
        # The wire takes CPU float32 whatever this stage runs on (a no-op on a CPU fp32 stage).
        grad, loss = downstream(hidden.detach().float().cpu(), labels.cpu())
        if grad.shape != hidden.shape:
            raise ValueError(
                f"downstream returned a gradient of shape {tuple(grad.shape)}, expected {tuple(hidden.shape)}"
            )
        ctx.save_for_backward(grad.to(device=hidden.device, dtype=hidden.dtype))
        return torch.tensor(loss, dtype=hidden.dtype, device=hidden.device)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None]:
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None


def remote_loss(downstream: Downstream) -> LossFn:
    """A DiLoCo `loss_fn` for stage 0 of S > 1: `DiLoCo.inner_step` then runs local forward ->
    the rest of the pipeline -> local backward with the returned gradient -> inner update."""

    def loss_fn(hidden: Tensor, labels: Tensor) -> Tensor:
        return _RemoteLoss.apply(hidden, labels, downstream)

    return loss_fn


MAX_WIRE_VALUE = 2.0**120
"""Largest |∂loss/∂hidden| a stage > 0 replica steps on: 64 times it is still a finite float32,
so every codec encodes it (node.actcodec: the Hadamard rotation sums 64 values)."""


def stage_inner_step(
    diloco: DiLoCo, hidden: Tensor, labels: Tensor, downstream: Downstream | None
) -> tuple[Tensor, float]:
    """One inner step of a stage > 0 on a received micro-batch.

    `hidden` (B, T, C) is the previous stage's output; `downstream` is None on the last stage
    (which holds the head and computes the loss). Returns (∂loss/∂hidden (B, T, C) float32 on the
    CPU, loss) after the inner optimizer stepped. The layers run on the replica's placement
    (device and autocast); what crosses to the neighbours is CPU float32 either way. On an
    exception nothing was stepped and no gradient is left behind.
    """
    place = diloco.placement
    x = place.to_device(hidden.detach().float()).requires_grad_(True)
    try:
        # enable_grad: a caller may sit inside an autograd Function's forward (chained in-process).
        # Autocast as stage 0's DiLoCo.queue_inner_step does: a stage's precision is its placement's.
        with torch.enable_grad():
            with place.autocast():
                out = diloco.model(x)
                loss = cross_entropy_loss(out, place.to_device(labels)) if downstream is None else None
            if downstream is None:
                assert loss is not None
                loss.backward()
                value = loss.item()
            else:
                grad_out, value = downstream(out.detach().float().cpu(), labels)
                out.backward(place.to_device(grad_out).to(out.dtype))
        assert x.grad is not None
        if not (
            math.isfinite(value)
            and _all_finite([x.grad, *(p.grad for p in diloco.params if p.grad is not None)])
        ):
            # Finite but extreme activations (a faulty or hostile sender) can overflow inside the
            # layers; one such step would turn the replica's weights to NaN.
            raise NonFiniteStep(
                f"micro-batch gives a non-finite loss or gradient (loss {value}); not stepped"
            )
        largest = float(x.grad.abs().max()) if x.grad.numel() else 0.0
        if largest > MAX_WIRE_VALUE:
            # The gradient sent back must be encodable (a rotating codec's sum of 64 values must not
            # overflow float32): refused before the step, so a replica never trains on a micro-batch
            # it cannot answer, whose step its log would record without the reply.
            raise NonFiniteStep(
                f"micro-batch gives an input gradient up to {largest:.3g}, beyond what the wire carries "
                f"({MAX_WIRE_VALUE:.3g}); not stepped"
            )
    except BaseException:
        diloco.inner_optimizer.zero_grad(set_to_none=True)
        raise
    diloco.inner_update()
    return x.grad.cpu(), value


class NonFiniteStep(ValueError):
    """A micro-batch whose loss or gradients are not finite: refused, nothing stepped."""


def _all_finite(tensors: list[Tensor]) -> bool:
    norms = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])  # one norm per tensor
    return bool(torch.isfinite(norms).all())
