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

from .diloco import DiLoCo
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
    def forward(ctx: Any, hidden: Tensor, labels: Tensor, remote: RemoteLoss) -> Tensor:
        # The wire takes CPU float32 whatever this stage runs on (a no-op on a CPU fp32 stage).
        sent = remote.resend if remote.resend is not None else hidden.detach().float().cpu()
        grad, loss = remote.downstream(sent, labels.cpu())
        if grad.shape != hidden.shape:
            raise ValueError(
                f"downstream returned a gradient of shape {tuple(grad.shape)}, expected {tuple(hidden.shape)}"
            )
        remote.sent, remote.gradient = sent, grad
        ctx.save_for_backward(grad.to(device=hidden.device, dtype=hidden.dtype))
        return torch.tensor(loss, dtype=hidden.dtype, device=hidden.device)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None]:
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None


Blame = Callable[[str], bool]
"""Called with the reason when the gradient the next stage sent back for the micro-batch in
progress overflowed this stage's backward (`NonFiniteStep.gradient_at_fault`): the transport bans
the replica that sent it, so that a retry of the micro-batch goes elsewhere (p2p.pipeline).
Returns whether it banned one (False: it knows no answer to that id, and a retry could reach
the same replica)."""


class RemoteLoss:
    """A DiLoCo `loss_fn` for stage 0 of S > 1: the local forward's output goes to the rest of the
    pipeline, whose gradient comes back for the local backward. Step with `driver_inner_step`,
    which refuses a gradient that overflows the backward and, with `blame`, retries elsewhere."""

    def __init__(self, downstream: Downstream, blame: Blame | None = None) -> None:
        self.downstream = downstream
        self.blame = blame
        self.sent: Tensor | None = None
        """What the last call sent on (CPU float32)."""
        self.gradient: Tensor | None = None
        """The gradient the last call got back (CPU float32), for `driver_inner_step`'s check."""
        self.resend: Tensor | None = None
        """Set by `driver_inner_step` for a retry: sent instead of the forward's output, so every
        attempt of one step carries the same bytes whether or not the forward is bit-reproducible."""

    def __call__(self, hidden: Tensor, labels: Tensor) -> Tensor:
        self.sent = self.gradient = None
        return _RemoteLoss.apply(hidden, labels, self)


def remote_loss(downstream: Downstream, blame: Blame | None = None) -> RemoteLoss:
    """A DiLoCo `loss_fn` for stage 0 of S > 1: local forward -> the rest of the pipeline -> local
    backward with the returned gradient (`RemoteLoss`)."""
    return RemoteLoss(downstream, blame)


MAX_WIRE_VALUE = 2.0**120
"""Largest |∂loss/∂hidden| a stage > 0 replica steps on: 64 times it is still a finite float32,
so every codec encodes it (node.actcodec: the Hadamard rotation sums 64 values)."""

MAX_BLAMED = 8
"""Gradients one step may refuse as overflowing its backward (each from a replica it then bans)
before it gives up on the micro-batch: bounds a step's retries when many next-stage replicas lie."""

DRIVER_MAX_BLAMED = 4 * MAX_BLAMED
"""A driver's `max_blamed`: it has no sender to hand a micro-batch back to, so it tries longer
before it stops (each blamed replica is banned, for longer at each blame)."""

MAX_SOUND_GAIN = 2.0**20
"""The largest |∂loss/∂input| a sound forward of a stage > 0 gives from a gradient whose largest
value is 1 (`_gradient_overflowed`). A trained or freshly initialised stage gives at most a few
thousand (every output position an input reaches, times the weights); degenerate inputs, such as
all-zero activations through RMSNorm, give 1e10 and more to an 8-layer stage of the 350m preset
at initialisation, but only 1.2e5–4e5 to a 4-layer one, under the bound; such inputs are refused
where they enter (`DEGENERATE_MEAN_SQUARE`), so they no longer pass through shallow stages."""


DEGENERATE_MEAN_SQUARE = 0.25
"""A position of hidden state whose mean square over the width is below this many times the
model's RMSNorm eps (`ModelConfig.norm_eps`) is degenerate: a stage > 0 takes no micro-batch
that has one (`degenerate_problem`), and sends on no output with a position under
`SEND_MARGIN` times the bound, since the codec may shrink a position on the way (by up to 11%
at width 32 in the default codec, a review measured) and what the next stage checks is what it
decodes. A driver does not check its own output: an honest one is never near the bound.

Below about eps, RMSNorm no longer brings a position back to unit scale, so nothing a stage's
layers add restores it either: with no biases, all-zero activations come out of a stage as
exactly zero, and each stage they pass multiplies the gradient by its gain at zero (3.7e5 on a
4-layer stage of the 350m preset, `bench/bench_degenerate.py`) until an honest replica further
down the pipeline overflows and blames the wrong neighbour. At a quarter of eps the first norm
still restores the position (to rms 0.45): a stage's gain there is 369 (the next stage's 1.9,
its input back at the scale of honest activations), so a sender that sits just above the bound
passes nothing degenerate on there; a 1-layer stage of the tiny preset at initialisation, whose
layers add little yet, passes ¼ eps on as 0.33 eps, which the send margin refuses (the sender
that chose such inputs is struck). Honest activations sit far above the bound: stage 0's output
at initialisation is 16× eps (micro) to 707× (350m) at its smallest position, and grows as a
model trains."""


SEND_MARGIN = 2.0
"""A stage > 0 sends on no output with a position under this many times the degenerate bound
(`DEGENERATE_MEAN_SQUARE`): the codec's rounding must not carry an output it passed under the
bound the next stage checks after decoding, or the honest sender would be struck for it."""


def degenerate_problem(hidden: Tensor, eps: float, margin: float = 1.0) -> str | None:
    """Why `hidden` (…, C) is degenerate (`DEGENERATE_MEAN_SQUARE`, times `margin`), or None. One
    float32 norm per position, without a temporary the size of `hidden`."""
    if hidden.numel() == 0:
        return None
    mean_square = (
        torch.linalg.vector_norm(hidden.detach(), dim=-1, dtype=torch.float32) ** 2 / hidden.shape[-1]
    )
    bound = margin * DEGENERATE_MEAN_SQUARE
    count = int((mean_square < bound * eps).sum())
    if count == 0:
        return None
    return (
        f"{count} of {mean_square.numel()} positions have a mean square of {float(mean_square.min()):.3g}, "
        f"below {bound:g} × the norm eps ({eps:g}): degenerate activations"
    )


AUDIT_MIN_COSINE = 0.05
"""Two next-stage replicas' answers to one micro-batch agree (`answers_disagree`) when their
gradients, each over the whole micro-batch, have at least this cosine. Honest replicas drift
apart within a round (each takes its own inner steps, as many as the router sends it) and each
answer went through the lossy codec, so the bound is loose: early in training, with one replica
sent 16 micro-batches for the other's one, honest whole-micro-batch cosines fell to 0.22 on the
micro model (and single sequences below 0, which is why sequences are not compared one by one),
and to 0.55 on tiny's stage 1 with one replica sent 8 for the other's one
(`bench/bench_pipeline_poison.py`, section 3; bench/RESULTS.md). A negated answer
is near −1; noise is near 0 and caught about half the time."""
AUDIT_MAX_NORM_RATIO = 100.0
"""... and norms within this factor of each other (honest: up to 18×, early in training under
the same skew). Catches zeros and answers scaled out of all proportion."""


def answers_disagree(first: Tensor, second: Tensor) -> str | None:
    """Why two next-stage replicas' gradients for the same micro-batch (∂loss/∂hidden (B, T, C))
    cannot both be honest, or None. A tolerance set from measurements of honest replicas (the
    bounds above), not an equality: it tells a negated, zeroed or wildly scaled answer from an
    honest one, not an answer bent a little, and not one lie among many sequences. Losses are not
    compared (honest ones differ by a quarter early in training, and a lie about the loss moves no
    weight). Pure; in float64 on the CPU (two full-size copies: this runs off the event loop)."""
    if first.shape != second.shape:
        return f"gradients of different shapes {tuple(first.shape)} and {tuple(second.shape)}"
    a, b = first.detach().reshape(-1), second.detach().reshape(-1)
    norm_a = float(torch.linalg.vector_norm(a, dtype=torch.float64))
    norm_b = float(torch.linalg.vector_norm(b, dtype=torch.float64))
    if not (math.isfinite(norm_a) and math.isfinite(norm_b)):
        return "a gradient is not finite"
    if norm_a == norm_b == 0.0:
        return None
    if max(norm_a, norm_b) > AUDIT_MAX_NORM_RATIO * min(norm_a, norm_b):
        return f"the gradients' norms {norm_a:.3g} and {norm_b:.3g} differ more than {AUDIT_MAX_NORM_RATIO:g}-fold"
    cosine = float(torch.dot(a.double(), b.double())) / (norm_a * norm_b)
    if cosine < AUDIT_MIN_COSINE:
        return f"the gradients have a cosine of {cosine:.3f} (at least {AUDIT_MIN_COSINE:g})"
    return None


class NonFiniteStep(ValueError):
    """A micro-batch whose loss or gradients are not finite: refused, nothing stepped.

    `gradient_at_fault`: the gradient the next stage sent back overflowed the backward, not this
    stage's forward — the same backward from that gradient scaled down to a largest value of 1 is
    sound (`_gradient_overflowed`). The sender of that gradient is blamed, not the micro-batch."""

    def __init__(self, message: str, *, gradient_at_fault: bool = False) -> None:
        super().__init__(message)
        self.gradient_at_fault = gradient_at_fault


def stage_inner_step(
    diloco: DiLoCo,
    hidden: Tensor,
    labels: Tensor,
    downstream: Downstream | None,
    blame: Blame | None = None,
) -> tuple[Tensor, float]:
    """One inner step of a stage > 0 on a received micro-batch.

    `hidden` (B, T, C) is the previous stage's output; `downstream` is None on the last stage
    (which holds the head and computes the loss). Returns (∂loss/∂hidden (B, T, C) float32 on the
    CPU, loss) after the inner optimizer stepped. The layers run on the replica's placement
    (device and autocast); what crosses to the neighbours is CPU float32 either way. On an
    exception nothing was stepped and no gradient is left behind.

    A gradient from downstream that overflows the backward raises `NonFiniteStep` with
    `gradient_at_fault`; with `blame`, the step blames its sender instead and sends its output
    again (the same tensor, so the same bytes) for another gradient, until it has refused
    `MAX_BLAMED` of them.
    A segment check replays with the recorded gradient and no `blame`.
    """
    place = diloco.placement
    x = place.to_device(hidden.detach().float()).requires_grad_(True)
    # The output as first sent downstream: a retry offers the same bytes (the forward is redone
    # for its graph, and need not be bit-identical on every device).
    sent: Tensor | None = None
    blamed = 0
    while True:
        try:
            x.grad = None
            # enable_grad: a caller may sit inside an autograd Function's forward (chained in-process).
            # Autocast as stage 0's DiLoCo.backward does: a stage's precision is its placement's.
            with torch.enable_grad():
                with place.autocast():
                    out = diloco.model(x)
                    loss = cross_entropy_loss(out, place.to_device(labels)) if downstream is None else None
                grad_out = None
                if downstream is None:
                    assert loss is not None
                    loss.backward()
                    value = loss.item()
                else:
                    if sent is None:
                        sent = out.detach().float().cpu()
                    grad_out, value = downstream(sent, labels)
                    out.backward(place.to_device(grad_out).to(out.dtype))
            assert x.grad is not None
            problem = _step_problem(value, x.grad, diloco)
            if problem is None:
                diloco.inner_update()
                return x.grad.cpu(), value
            diloco.inner_optimizer.zero_grad(set_to_none=True)  # before the diagnosis: its memory
            at_fault = grad_out is not None and _gradient_overflowed(
                diloco, lambda x2: diloco.model(x2), x, grad_out
            )
        except BaseException:
            diloco.inner_optimizer.zero_grad(set_to_none=True)
            raise
        blamed = _blamed(problem, at_fault, blame, blamed)


def driver_inner_step(
    diloco: DiLoCo, input_ids: Tensor, labels: Tensor, *, max_blamed: int = MAX_BLAMED
) -> Tensor:
    """Stage 0's inner step of a pipeline (`diloco.loss_fn` a `RemoteLoss`), as
    `DiLoCo.queue_inner_step`, but refusing a gradient from the next stage that overflows the
    backward: with the loss's `blame`, its sender is blamed and the same activations (same step,
    so the same id and bytes, not a recomputation) are sent again, until `max_blamed` gradients
    were refused; then, or with nobody to blame, `NonFiniteStep` with nothing stepped. Without
    the check one such gradient turns every weight to NaN (`clip_grad_norm_` of an infinite norm
    multiplies by 0). Under fp16 loss scaling a step whose scaled gradients overflow is left to
    the scaler (which skips it and lowers the scale) unless the gradient is at fault, which a
    gradient no larger than 1 never is (README: such answers can still lower the scale). Reads
    the loss and one norm per gradient before the update (a device sync; a driver's forward
    already waited for the wire)."""
    remote = diloco.loss_fn
    if not isinstance(remote, RemoteLoss):
        raise TypeError("driver_inner_step needs a DiLoCo whose loss_fn is a RemoteLoss")
    ids = diloco.placement.to_device(input_ids)
    blamed = 0
    try:
        while True:
            loss = diloco.backward(input_ids, labels)
            value = float(loss)
            grads = [p.grad for p in diloco.params if p.grad is not None]
            sound = math.isfinite(value) and _all_finite(grads)
            if not sound and diloco.scaler is None:
                diloco.inner_optimizer.zero_grad(set_to_none=True)  # before the diagnosis: its memory
            grad = remote.gradient
            at_fault = (
                not sound
                and grad is not None
                and _gradient_overflowed(diloco, lambda _: diloco.model(ids), None, grad)
            )
            if sound or (diloco.scaler is not None and not at_fault):
                diloco.inner_update(scaled=diloco.scaler is not None)
                return loss
            diloco.inner_optimizer.zero_grad(set_to_none=True)
            remote.resend = remote.sent  # every attempt of the step sends the same bytes
            problem = f"micro-batch gives a non-finite loss or gradient (loss {value}); not stepped"
            blamed = _blamed(problem, at_fault, remote.blame, blamed, max_blamed)
    except BaseException:
        diloco.inner_optimizer.zero_grad(set_to_none=True)
        raise
    finally:
        remote.resend = None


def _blamed(problem: str, at_fault: bool, blame: Blame | None, blamed: int, most: int = MAX_BLAMED) -> int:
    """After a refused step: blames the gradient's sender when it is at fault and returns the
    count of blames so far, for a retry; raises `NonFiniteStep` when there is nobody to blame (or
    the transport banned no one) and after the `most`-th blame."""
    if not (at_fault and blame is not None and blame(problem)):
        raise NonFiniteStep(problem, gradient_at_fault=at_fault)
    if blamed + 1 >= most:
        raise NonFiniteStep(
            f"{problem}; {most} answers from the next stage in a row overflowed it", gradient_at_fault=True
        )
    return blamed + 1


def _step_problem(value: float, input_grad: Tensor, diloco: DiLoCo) -> str | None:
    """Why a stage > 0 step on these gradients must not be taken, or None."""
    if not (
        math.isfinite(value)
        and _all_finite([input_grad, *(p.grad for p in diloco.params if p.grad is not None)])
    ):
        # Finite but extreme activations (a faulty or hostile sender) can overflow inside the
        # layers; one such step would turn the replica's weights to NaN.
        return f"micro-batch gives a non-finite loss or gradient (loss {value}); not stepped"
    largest = float(input_grad.abs().max()) if input_grad.numel() else 0.0
    if largest > MAX_WIRE_VALUE:
        # The gradient sent back must be encodable (a rotating codec's sum of 64 values must not
        # overflow float32): refused before the step, so a replica never trains on a micro-batch
        # it cannot answer, whose step its log would record without the reply.
        return (
            f"micro-batch gives an input gradient up to {largest:.3g}, beyond what the wire carries "
            f"({MAX_WIRE_VALUE:.3g}); not stepped"
        )
    return None


def _gradient_overflowed(
    diloco: DiLoCo, forward: Callable[[Tensor | None], Tensor], x: Tensor | None, grad: Tensor
) -> bool:
    """Whether a backward that came out non-finite (or too large to send) did so because of the
    size of `grad`, the gradient the next stage sent back, rather than because of the forward.

    A backward is linear in the gradient it starts from, so the same backward from `grad` scaled
    down to a largest value of 1 tells them apart. The gradient is at fault when that backward is
    sound: every gradient it gives finite by the step's own test (one float32 norm per tensor)
    and, for a stage > 0, its input gradient at most MAX_SOUND_GAIN — a forward on degenerate
    inputs (all-zero activations, say) amplifies even an honest gradient past the step's limits,
    and that is the sender's doing, not the next stage's. A gradient no larger than 1 is never at
    fault. Runs the forward again (`forward(x2)`, x2 a fresh leaf copy of `x`), so it costs a
    step's compute, only on a step that failed. Leaves no `.grad` behind."""
    largest = float(grad.abs().max()) if grad.numel() else 0.0
    if not largest > 1.0:
        return False
    place = diloco.placement
    x2 = None if x is None else x.detach().requires_grad_(True)
    params = [p for p in diloco.params if p.requires_grad]
    wrt = params if x2 is None else [x2, *params]
    with torch.enable_grad():
        with place.autocast():
            out = forward(x2)
        unit = place.to_device(grad / largest).to(out.dtype)
        grads = torch.autograd.grad(out, wrt, unit, allow_unused=True)
    present = [g for g in grads if g is not None]
    if not _all_finite(present):
        return False
    return x2 is None or grads[0] is None or float(grads[0].abs().max()) <= MAX_SOUND_GAIN


def _all_finite(tensors: list[Tensor]) -> bool:
    if not tensors:
        return True
    norms = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])  # one norm per tensor
    return bool(torch.isfinite(norms).all())
