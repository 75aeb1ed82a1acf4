"""DiLoCo for one replica of one stage (Douillard et al. 2023, arXiv:2311.08105).

Each replica runs H inner steps of AdamW on its own data, then sends the
pseudo-gradient Δ = θ_round − θ_local (global minus local). The aggregated Δ
drives an outer SGD with Nesterov momentum on θ_round; the result becomes the
next round's start for every replica. Pure torch: the protocol layer moves Δ
between replicas, this module only does the maths.
"""

from __future__ import annotations

import copy
import hashlib
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector

from .codec import all_finite
from .device import Placement, snapshot_to_cpu
from .model import cross_entropy_loss

InnerOptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass(kw_only=True)
class DiLoCoConfig:
    """Inner and outer optimisation of one stage. Inner defaults follow Douillard et al. 2023 except
    the lr, which suits our small models (their 4e-4 is for 150M+ parameters). The outer step's
    defaults were measured (issue 18; bench/bench_convergence.py, bench/RESULTS.md): the paper's
    Nesterov lr 0.7, momentum 0.9 were tuned for H = 500 from a pre-trained start; on our runs
    they ended 3–5% behind the values below at every H (2 seeds), and behind plain averaging at
    H = 10 and 100. Held-out loss ÷ synchronous data parallel's on the same tokens (M = 4
    replicas, 500 inner steps each, seed 0; dim 64, 2 layers):

    ========================  ======  ======  =======
    outer (lr, momentum)      H = 10  H = 50  H = 100
    ========================  ======  ======  =======
    SGD 1.0, 0 (averaging)    1.096   1.122   1.136
    SGD 1.4, 0                1.082   1.093
    Nesterov 0.7, 0.9 (paper) 1.145   1.115   1.148
    Nesterov 0.4, 0.9         1.108   1.164
    Nesterov 0.5, 0.8         1.071
    Nesterov 0.7, 0.5         1.065   1.092   1.112
    Nesterov 1.0, 0.3         1.071   1.088   1.106
    **Nesterov 1.0, 0.5**     1.088   1.082   1.098
    ========================  ======  ======  =======

    Nesterov 1.0, 0.5 had the lowest worst case over H and was the default at every H. Momentum 0.5
    with Nesterov still is. The lr depends on H, measured over
    M = 2, 4, 8 with two seeds each (held-out loss, mean of seeds 0 and 1; lower is better):

    ==============  ======  ======  ======  ======  ======  ======  ======
    outer lr        M=2     M=4     M=8     M=4     M=2     M=4     M=8
                    H=10    H=10    H=10    H=20    H=50    H=50    H=50
    ==============  ======  ======  ======  ======  ======  ======  ======
    0.7             2.969   2.890   2.836   2.926   3.012   2.958   2.942
    1.0             3.076   2.919   2.852   2.926   3.022   2.925   2.897
    ==============  ======  ======  ======  ======  ======  ======  ======

    With many short rounds (H = 10) the gentler step is ahead at every M on the mean (0.6–3.5%;
    seed by seed only at M = 2, so at M ≥ 4 within the seeds' spread); at H = 20 the two tie; from
    H = 50 1.0 is ahead at M = 4, 8 (1.1–1.6%, both seeds), as it is at H = 100 in the table above.
    So a config built without ``outer_lr`` carries `tuned_outer_lr(inner_steps)`: 0.7 below
    H = 20, 1.0 from there. No M enters (Charles et al. 2025, "Scaling Laws for DiLoCo", find the
    best outer lr depends on M at larger scales; here the winner did not change with M). No
    setting reached data parallel at this length; RESULTS.md has the rest of the table, a longer
    run and the model size of the issue."""

    inner_steps: int = 500
    """H: inner steps per round; the paper's default, trading communication for staleness."""
    inner_lr: float = 3e-3
    """Peak AdamW learning rate of the default inner optimizer (ignored by a custom factory)."""
    weight_decay: float = 0.1
    """Decoupled AdamW weight decay on matrices; norm gains are not decayed (they should stay near 1)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (β1, β2); β2 0.95 rather than 0.999 reacts faster to loss spikes in LM training."""
    warmup_steps: int = 1000
    """Inner steps of linear learning-rate warm-up (the paper's 1000)."""
    total_steps: int = 100_000
    """Inner step at which the cosine decay reaches min_lr_ratio; constant afterwards."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak; 1.0 makes the schedule constant after warm-up."""
    grad_clip: float | None = 1.0
    """Max global L2 norm of the inner gradient; None disables clipping."""
    outer_lr: float | None = None
    """Outer SGD learning rate on the pseudo-gradient; None (the default) takes
    `tuned_outer_lr(inner_steps)`, measured (class docstring). Always a number once built."""
    outer_momentum: float = 0.5
    """Outer SGD momentum; measured (class docstring), not the paper's 0.9."""
    outer_nesterov: bool = True
    """Nesterov momentum in the outer step: the paper's best outer optimizer; at momentum 0.3–0.5
    it also beat plain averaging (SGD lr 1.0) at every H measured."""
    outer_warmup_rounds: int = 0
    """Outer rounds over which the outer lr ramps up linearly: round r (0-based) steps at
    lr × min(1, (r + 1) / outer_warmup_rounds); 0: no warm-up (this config's default; RESULTS.md).
    A network.toml that names none gets 3 (network_definition.DEFAULT_OUTER_WARMUP_ROUNDS): the
    ramp is part of the defence against attackers present from a run's first round."""

    @property
    def outer_step_lr(self) -> float:
        """`outer_lr` as the number it always is after construction (typed for the optimizer)."""
        assert self.outer_lr is not None
        return self.outer_lr

    def __post_init__(self) -> None:
        if self.outer_lr is None:
            self.outer_lr = tuned_outer_lr(self.inner_steps)
        checks = [
            (self.inner_steps >= 1, f"inner_steps must be >= 1, got {self.inner_steps}"),
            (self.inner_lr > 0, f"inner_lr must be > 0, got {self.inner_lr}"),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
            (all(0 <= b < 1 for b in self.betas), f"betas must lie in [0, 1), got {self.betas}"),
            (self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}"),
            (
                self.total_steps >= max(1, self.warmup_steps),
                f"total_steps ({self.total_steps}) must be >= 1 and >= warmup_steps ({self.warmup_steps})",
            ),
            (0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}"),
            (self.grad_clip is None or self.grad_clip > 0, f"grad_clip must be > 0, got {self.grad_clip}"),
            (self.outer_lr > 0, f"outer_lr must be > 0, got {self.outer_lr}"),
            (0 <= self.outer_momentum < 1, f"outer_momentum must lie in [0, 1), got {self.outer_momentum}"),
            (
                type(self.outer_warmup_rounds) is int and self.outer_warmup_rounds >= 0,
                f"outer_warmup_rounds must be an integer >= 0, got {self.outer_warmup_rounds!r}",
            ),
            (
                not (self.outer_nesterov and self.outer_momentum == 0),
                "outer_nesterov=True needs outer_momentum > 0 (got 0); set outer_nesterov=False",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"DiLoCoConfig: {message}")


TUNED_OUTER_LR_SHORT_ROUNDS = 0.7
TUNED_OUTER_LR = 1.0
SHORT_ROUNDS_BELOW = 20
"""H below which the gentler outer lr won (DiLoCoConfig's docstring: ahead at H = 10, tied at 20)."""


def tuned_outer_lr(inner_steps: int) -> float:
    """The outer lr a DiLoCoConfig built without one carries: 0.7 for rounds of fewer than 20
    inner steps, 1.0 from 20 (measured; DiLoCoConfig's docstring)."""
    return TUNED_OUTER_LR_SHORT_ROUNDS if inner_steps < SHORT_ROUNDS_BELOW else TUNED_OUTER_LR


def lr_factor(step: int, cfg: DiLoCoConfig) -> float:
    """Multiplier of the peak inner lr at 0-based inner step ``step``.

    Linear warm-up (step+1)/warmup_steps, so the first step already learns, then cosine
    decay from 1 to min_lr_ratio at total_steps, then flat. With warmup_steps == 0, step 0
    gets exactly 1.0; with total_steps == warmup_steps the factor drops to min_lr_ratio
    right after the warm-up.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = cfg.total_steps - cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps) if decay_steps > 0 else 1.0
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def default_inner_optimizer(
    params: list[nn.Parameter], cfg: DiLoCoConfig, *, fused: bool = True
) -> torch.optim.AdamW:
    """AdamW with decay on matrices only: decaying a norm gain pulls it towards 0 instead of 1.

    fused=True runs the whole update in one kernel per parameter group (CPU and CUDA since
    torch 2.4, MPS since 2.5: `Placement.fused_adamw`); on the tiny model at 2 threads it
    measured ~4% faster per inner step than the default per-tensor loop (bench/bench_inner_loop.py).
    """
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.inner_lr, betas=cfg.betas, fused=fused
    )


@torch.no_grad()
def flat_parameters(params: Iterable[nn.Parameter]) -> Tensor:
    """A detached float32 copy of the parameters as one flat vector (d,) on the CPU, wherever the
    parameters live: everything replicas must agree on is computed there."""
    # parameters_to_vector already builds a new tensor (torch.cat): no second copy on the CPU.
    return parameters_to_vector(params).detach().to(device="cpu", dtype=torch.float32)


@torch.no_grad()
def copy_into_parameters(vector: Tensor, params: Iterable[nn.Parameter]) -> None:
    """Copy a flat vector into the parameters in place.

    Not torch's vector_to_parameters: it rebinds ``param.data`` to views of the vector,
    so the model would alias θ_round and the inner steps would overwrite it.
    """
    params = list(params)
    total = sum(p.numel() for p in params)
    if vector.shape != (total,):
        raise ValueError(f"vector has shape {tuple(vector.shape)}, the parameters need ({total},)")
    if params and params[0].device != vector.device:
        # One host-to-device transfer, then copies on the device, rather than one small transfer
        # from pageable CPU memory per parameter.
        vector = vector.to(params[0].device)
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(vector[offset : offset + n].view_as(p))
        offset += n


def float32_scalar(value: float) -> float:
    """`value` rounded to the nearest float32, as a Python float: a scalar every kernel, whatever
    precision it takes scalars in, multiplies by exactly."""
    return float(torch.tensor(value, dtype=torch.float32))


@torch.no_grad()
def outer_sgd_step(
    theta: Tensor, buffer: Tensor | None, delta: Tensor, *, lr: float, momentum: float, nesterov: bool
) -> Tensor | None:
    """One outer SGD step on the flat float32 θ in place, torch.optim.SGD's rule (no dampening or
    weight decay); returns the momentum buffer (created on the first step, updated in place after),
    or None without momentum.

        b ← μ·b + Δ  (b ← Δ on the first step);   u = Δ + μ·b (Nesterov) or b;   θ ← θ − lr·u

    Every operation is one correctly rounded float32 multiply, add or subtract, with no fused
    multiply-add anywhere: torch.optim.SGD's ``add(x, alpha=a)`` is a fused multiply-add on some
    kernels (vectorised CPU code, CUDA) and two roundings on others, so its last bit depends on the
    hardware. This sequence gives the same bits on every IEEE-754 device, which lets a CUDA replica
    take the outer step where θ's model lives and still agree bit for bit with a CPU replica.
    """
    lr, momentum = float32_scalar(lr), float32_scalar(momentum)
    if momentum == 0.0:
        update = delta
        buffer = None
    else:
        if buffer is None:
            buffer = delta.clone()
        else:
            buffer.mul_(momentum).add_(delta)
        update = torch.mul(buffer, momentum).add_(delta) if nesterov else buffer
    theta.sub_(torch.mul(update, lr))
    return buffer


def tensor_digest(vector: Tensor) -> str:
    """sha256 hex of a tensor's little-endian float32 bytes; replicas compare θ by it. On a
    little-endian machine the bytes are hashed from the tensor's memory, without a copy (0.16 s
    instead of 0.22 s per 29.5M values)."""
    data = vector.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    if sys.byteorder == "little":
        return hashlib.sha256(data.view("uint8").data).hexdigest()
    return hashlib.sha256(data.astype("<f4").tobytes()).hexdigest()


class DiLoCo:
    """One replica's DiLoCo state: the model it trains, θ_round, and both optimizers.

    The model, its inner optimizer and the batches live on `placement.device` (forward and loss
    under its autocast). θ_round and the outer momentum are float32 vectors kept on the CPU: what
    the weight hash, checkpoints, receipts and peers read. The outer step itself is
    `outer_sgd_step`, whose operations round the same way on every IEEE-754 device, so on CUDA it
    runs on the device (where the model and, for a lone replica, Δ already are) on copies of
    θ_round and the momentum made for the step, and the CPU vectors are refreshed from them;
    elsewhere it runs on the CPU. Either way replicas on different devices or precisions end every round
    bit-identical. ``outer_optimizer`` is a torch.optim.SGD that holds the outer rule's settings
    and the momentum buffer (its state_dict is the checkpoint's format); its own ``step`` is never
    called (see `outer_sgd_step` for why).
    """

    def __init__(
        self,
        model: nn.Module,
        config: DiLoCoConfig,
        *,
        inner_optimizer: InnerOptimizerFactory | None = None,
        loss_fn: LossFn = cross_entropy_loss,
        placement: Placement | None = None,
    ) -> None:
        self.placement = placement or Placement.cpu()
        self.model = model.to(self.placement.device)
        self.config = config
        self.loss_fn = loss_fn
        self.params = list(model.parameters())
        if not self.params:
            raise ValueError("DiLoCo needs a model with at least one parameter")
        if any(p.dtype != torch.float32 for p in self.params):
            raise ValueError("DiLoCo keeps float32 master weights; autocast gives the low precision")
        fused = self.placement.fused_adamw()
        make_inner = inner_optimizer or (lambda ps: default_inner_optimizer(ps, config, fused=fused))
        self.inner_optimizer = make_inner(self.params)
        # fp16 needs loss scaling (its 5-bit exponent underflows small gradients); bf16 does not.
        self.scaler = (
            torch.amp.GradScaler(self.placement.device.type) if self.placement.precision == "fp16" else None
        )
        self._peak_lrs = [float(group["lr"]) for group in self.inner_optimizer.param_groups]
        # θ_round: the round's start, one flat float32 vector (d,), the outer optimizer's only parameter.
        # Pinned next to a CUDA model: refreshing it from the device's outer step is then one fast copy.
        theta = flat_parameters(self.params).clone()
        self.theta_round = (theta.pin_memory() if self.placement.is_cuda else theta).requires_grad_(True)
        self._hash_memo: tuple[tuple[int, int], str] | None = None
        self.outer_optimizer = torch.optim.SGD(
            [self.theta_round],
            lr=config.outer_step_lr,
            momentum=config.outer_momentum,
            nesterov=config.outer_nesterov,
        )
        self.step = 0  # inner steps since training began
        self.round = 0  # outer steps since training began
        self.steps_in_round = 0  # inner steps since the current round began

    @property
    def round_complete(self) -> bool:
        """True once the current round has run its H inner steps."""
        return self.steps_in_round >= self.config.inner_steps

    @property
    def schedule_step(self) -> int:
        """The network's inner step, round × H + inner steps in this round: where the inner lr
        schedule is. A function of the round, not of this replica's history, so a replica that
        joined mid-run (or adopted a later round's state) continues the schedule where its peers
        are instead of warming up again with a short, refusable Δ."""
        return self.round * self.config.inner_steps + self.steps_in_round

    @property
    def current_lr(self) -> float:
        """Learning rate the next inner step will use (first parameter group)."""
        return self._peak_lrs[0] * lr_factor(self.schedule_step, self.config)

    def inner_step(self, input_ids: Tensor, labels: Tensor) -> float:
        """One inner step on (B, T) input ids and labels; returns the loss before the update."""
        return self.queue_inner_step(input_ids, labels).item()

    def queue_inner_step(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        """`inner_step` without waiting for the device: returns the loss as a 0-d tensor on the
        device, so the caller can prepare the next batch while the kernels run."""
        loss = self.backward(input_ids, labels)
        self.inner_update(scaled=self.scaler is not None)
        return loss

    def backward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        """The forward and backward of an inner step, not stepped: the gradients are left in
        ``.grad`` (scaled when `scaler` is set) for `inner_update`, or for the caller to clear
        (`inner_optimizer.zero_grad`). Returns the loss as a detached 0-d tensor on the device."""
        x, y = self.placement.to_device(input_ids), self.placement.to_device(labels)
        with self.placement.autocast():
            loss = self.loss_fn(self.model(x), y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()
        return loss.detach()

    def inner_update(self, *, scaled: bool = False) -> None:
        """Clip, step the inner optimizer and schedule, clear grads. For stages whose backward ran
        elsewhere (the pipeline), call this after their gradients are in ``.grad``. `scaled`: the
        gradients carry fp16 loss scaling (`self.scaler`), removed before clipping."""
        if scaled:
            assert self.scaler is not None
            self.scaler.unscale_(self.inner_optimizer)
        if self.config.grad_clip is not None:
            nn.utils.clip_grad_norm_(self.params, self.config.grad_clip, foreach=True)
        factor = lr_factor(self.schedule_step, self.config)
        for group, peak in zip(self.inner_optimizer.param_groups, self._peak_lrs, strict=True):
            group["lr"] = peak * factor
        if scaled:
            assert self.scaler is not None
            self.scaler.step(self.inner_optimizer)  # skipped when the scaled gradients overflowed
            self.scaler.update()
        else:
            self.inner_optimizer.step()
        self.inner_optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.steps_in_round += 1

    def pseudo_gradient(self) -> Tensor:
        """Δ = θ_round − θ_local as a flat float32 vector (d,): it points from the local weights back
        to the round's start, so subtracting it (SGD) moves towards where the replicas went."""
        local = flat_parameters(self.params)
        return torch.sub(self.theta_round.detach(), local, out=local)

    def outer_step(self, delta: Tensor) -> None:
        """Apply the aggregated Δ (d,) to θ_round with the outer SGD, then load θ_round into the model."""
        self._check_delta(delta)
        if self._outer_on_device:
            self._device_step(delta)
        else:
            group = self.outer_optimizer.param_groups[0]
            state = self.outer_optimizer.state[self.theta_round]
            buffer = outer_sgd_step(
                self.theta_round.detach(),
                state.get("momentum_buffer"),
                delta.to(self.theta_round.device),
                lr=self._outer_lr_now(),
                momentum=group["momentum"],
                nesterov=group["nesterov"],
            )
            if buffer is not None:  # torch.optim.SGD keeps no state without momentum
                state["momentum_buffer"] = buffer
            copy_into_parameters(self.theta_round.detach(), self.params)
        self.round += 1
        self.steps_in_round = 0

    def local_outer_step(self) -> None:
        """`outer_step(pseudo_gradient())` for a replica alone in its stage, with the same bits;
        on CUDA, Δ is formed and applied on the device and never crosses to the CPU."""
        if not self._outer_on_device:
            self.outer_step(self.pseudo_gradient())
            return
        self._check_local_delta()
        self._device_step(None)
        self.round += 1
        self.steps_in_round = 0

    @property
    def _outer_on_device(self) -> bool:
        """Whether the outer step runs on the model's device: CUDA, whose float32 kernels round
        IEEE-754 (torch is built without fast-math); MPS is not relied on for that."""
        return self.placement.is_cuda and self.params[0].device.type == "cuda"

    def _slices(self) -> Iterator[tuple[nn.Parameter, slice]]:
        """Each parameter with its slice of θ_round."""
        offset = 0
        for p in self.params:
            yield p, slice(offset, offset + p.numel())
            offset += p.numel()

    @torch.no_grad()
    def _check_local_delta(self) -> None:
        """`_check_delta` of θ_round − θ_local, formed on the device one parameter at a time."""
        theta = self.theta_round.detach()
        squares = torch.zeros((), dtype=torch.float32, device=self.params[0].device)
        for p, span in self._slices():
            part = torch.sub(theta[span].to(p.device, non_blocking=True), p.detach().reshape(-1))
            squares += torch.dot(part, part)
        if not math.isfinite(float(squares)):  # non-finite, or squares that overflow: check exactly
            self._check_delta(torch.sub(theta, flat_parameters(self.params)))

    def _outer_lr_now(self) -> float:
        """This round's outer lr: the optimizer's, ramped over `config.outer_warmup_rounds`."""
        lr = float(self.outer_optimizer.param_groups[0]["lr"])
        warmup = self.config.outer_warmup_rounds
        return lr if warmup == 0 else lr * min(1.0, (self.round + 1) / warmup)

    @torch.no_grad()
    def _device_step(self, delta: Tensor | None) -> None:
        """The outer step on the model's CUDA device, one parameter at a time: its slices of
        θ_round, the momentum and Δ (given, or θ_round − θ_local when None) go up from pinned CPU
        memory, `outer_sgd_step` runs there, θ goes into the parameter, and θ_round's and the
        momentum's slices come back. Nothing stays on the device between rounds, and what the
        step holds there at once is a few copies of the largest parameter, not of the model
        (the 1b preset's 15 GB of training state leaves no room on a 24 GB card for three more
        model-sized vectors)."""
        group = self.outer_optimizer.param_groups[0]
        rule = {"lr": self._outer_lr_now(), "momentum": group["momentum"], "nesterov": group["nesterov"]}
        theta_host = self.theta_round.detach()
        state = self.outer_optimizer.state[self.theta_round]
        previous = state.get("momentum_buffer")
        device = self.params[0].device
        pin = device.type == "cuda"
        momentum = None
        if float32_scalar(group["momentum"]) != 0.0:  # as outer_sgd_step decides it
            momentum = previous if previous is not None and (previous.is_pinned() or not pin) else None
            if momentum is None:  # the first step, or a loaded checkpoint's (pageable) buffer
                momentum = torch.empty(theta_host.shape, dtype=torch.float32, pin_memory=pin)
                if previous is not None:
                    momentum.copy_(previous)
        try:
            self._device_step_slices(theta_host, momentum, previous is not None, delta, rule)
        finally:
            # The CPU vectors are whole only after this. An error part-way (a CUDA fault, out of
            # memory) propagates and leaves a half-applied step: the engine must not be used
            # again; a restarted node resumes from its last checkpoint.
            if pin:
                torch.cuda.current_stream(device).synchronize()
        if momentum is not None:
            state["momentum_buffer"] = momentum

    def _device_step_slices(  # on the CPU (tests) the copies are views and the step is in place
        self,
        theta_host: Tensor,
        momentum: Tensor | None,
        had_momentum: bool,
        delta: Tensor | None,
        rule: dict[str, Any],
    ) -> None:
        for p, span in self._slices():
            theta = theta_host[span].to(p.device, non_blocking=True)
            if delta is None:
                step_delta = torch.sub(theta, p.detach().reshape(-1))
            else:
                step_delta = delta[span].to(p.device, non_blocking=True)
            buffer = None
            if momentum is not None and had_momentum:
                buffer = momentum[span].to(p.device, non_blocking=True)
            buffer = outer_sgd_step(theta, buffer, step_delta, **rule)
            p.copy_(theta.view_as(p))
            # Queued on the same stream after the uploads that read these slices: in order.
            theta_host[span].copy_(theta, non_blocking=True)
            if momentum is not None and buffer is not None:
                momentum[span].copy_(buffer, non_blocking=True)

    def _check_delta(self, delta: Tensor) -> None:
        if not isinstance(delta, Tensor):
            raise TypeError(f"pseudo-gradient must be a Tensor, got {type(delta).__name__}")
        if delta.shape != self.theta_round.shape or delta.dtype != torch.float32:
            raise ValueError(
                f"pseudo-gradient has shape {tuple(delta.shape)} dtype {delta.dtype}; "
                f"expected ({self.theta_round.numel()},) torch.float32"
            )
        if not all_finite(delta):  # one dot product, not isfinite().all(): 0.3 s per 91M values
            bad = int((~torch.isfinite(delta)).sum())
            raise ValueError(f"pseudo-gradient has {bad} non-finite values out of {delta.numel()}")

    def weights_hash(self) -> str:
        """sha256 of θ_round (little-endian float32); equal on every honest replica after a round.
        Remembered until θ_round changes in place (its autograd version counter moves with every
        in-place write: the outer step, a state load, an adopted state), so the round's vote and
        its log line hash hundreds of MB once."""
        hashed = self.known_weights_hash()
        if hashed is None:
            hashed = tensor_digest(self.theta_round)
            self._hash_memo = ((id(self.theta_round), self.theta_round._version), hashed)
        return hashed

    def known_weights_hash(self) -> str | None:
        """`weights_hash()` if it is already computed for θ_round as it is now, else None."""
        key = (id(self.theta_round), self.theta_round._version)
        return self._hash_memo[1] if self._hash_memo is not None and self._hash_memo[0] == key else None

    def move_to(self, placement: Placement) -> None:
        """Move the model and the inner optimizer's state to another placement (θ_round stays,
        and stays pageable when an engine built on the CPU moves to CUDA: the outer step is then
        correct but its copies are staged, slower than from the pinned θ_round a CUDA engine
        builds)."""
        self.placement = placement
        self.model.to(placement.device)  # same Parameter objects: the optimizer's keys stay valid
        for state in self.inner_optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, Tensor):
                    state[key] = value.to(placement.device)
        if placement.precision == "fp16" and self.scaler is None:
            self.scaler = torch.amp.GradScaler(placement.device.type)
        elif placement.precision != "fp16":
            self.scaler = None

    def state_dict(self) -> dict[str, Any]:
        """Everything but the model's weights needed to resume bit-identically; plain CPU tensors and
        numbers, loadable with torch.load(weights_only=True) on any machine. A snapshot: later steps
        don't change it."""
        state = {
            "inner_optimizer": snapshot_to_cpu(self.inner_optimizer.state_dict()),
            "outer_optimizer": copy.deepcopy(self.outer_optimizer.state_dict()),
            "theta_round": self.theta_round.detach().clone(),
            "step": self.step,
            "round": self.round,
            "steps_in_round": self.steps_in_round,
        }
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def checkpoint_state(self) -> dict[str, Any]:
        """{"model": the model's state_dict, "diloco": `state_dict()`}, a snapshot on the CPU for
        a checkpoint (it loads on any machine).

        At a round's start (no inner step since the outer step copied θ_round into the
        parameters) the weights are θ_round's bits, and a checkpoint would hold them twice. Each
        parameter whose bits equal its slice of θ_round (compared as integers: -0.0 and NaN
        payloads count) is then stored as a view of that slice, and torch.save writes a storage
        once: the final checkpoint of a 125M model is 365 MB smaller (one fifth). Loading is
        unchanged; the loaded model's tensors are views of θ_round's storage."""
        state = self.state_dict()
        model = snapshot_to_cpu(self.model.state_dict())
        if self.steps_in_round == 0:
            theta = state["theta_round"]
            names = [name for name, _ in self.model.named_parameters()]
            for name, (_, span) in zip(names, self._slices(), strict=True):
                shared = theta[span].view(model[name].shape)
                if torch.equal(shared.view(torch.int32), model[name].view(torch.int32)):
                    model[name] = shared
        return {"model": model, "diloco": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        theta = state["theta_round"]
        if theta.shape != self.theta_round.shape:
            raise ValueError(
                f"checkpoint θ_round has {theta.numel()} elements, this model {self.theta_round.numel()}"
            )
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        # The outer step is the config's (the run's), not the checkpoint's: one saved under another
        # lr (an earlier default or flag) must not make this replica step unlike its peers, whose
        # θ hashes would then part from its own. Only the momentum buffer is the checkpoint's.
        group = self.outer_optimizer.param_groups[0]
        group["lr"] = self.config.outer_step_lr
        group["momentum"] = self.config.outer_momentum
        group["nesterov"] = self.config.outer_nesterov
        with torch.no_grad():
            self.theta_round.copy_(theta)
        self.step = int(state["step"])
        self.round = int(state["round"])
        self.steps_in_round = int(state["steps_in_round"])
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])
