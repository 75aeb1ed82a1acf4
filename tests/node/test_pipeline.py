"""The pipeline maths without a network: stages chained in-process equal the whole model."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

from neuroshard.node import pipeline
from neuroshard.node.device import Placement
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import MODEL_SIZES, ModelConfig, build_stage, cross_entropy_loss
from neuroshard.node.pipeline import (
    DEGENERATE_MEAN_SQUARE,
    MAX_WIRE_VALUE,
    NonFiniteStep,
    degenerate_problem,
    driver_inner_step,
    remote_loss,
    stage_inner_step,
)

MODEL = ModelConfig(vocab_size=64, dim=16, n_layers=3, n_heads=2, ffn_dim=32, max_seq_len=16)
SGD = DiLoCoConfig(inner_steps=100, warmup_steps=0, total_steps=100, grad_clip=None, min_lr_ratio=1.0)


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MODEL.vocab_size, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_three_chained_stages_step_exactly_like_the_whole_model() -> None:
    whole = DiLoCo(build_stage(MODEL, 0, 1), SGD, inner_optimizer=_sgd)
    stages = [DiLoCo(build_stage(MODEL, i, 3), SGD, inner_optimizer=_sgd) for i in range(3)]
    last = lambda h, y: stage_inner_step(stages[2], h, y, None)  # noqa: E731
    middle = lambda h, y: stage_inner_step(stages[1], h, y, last)  # noqa: E731
    stages[0].loss_fn = remote_loss(middle)
    for step in range(3):
        inputs, labels = _batch(step)
        expected = whole.inner_step(inputs, labels)
        got = stages[0].inner_step(inputs, labels)
        assert got == pytest.approx(expected, rel=1e-5)
    params = dict(whole.model.named_parameters())
    for stage in stages:
        for name, p in stage.model.named_parameters():
            torch.testing.assert_close(p, params[name], rtol=1e-5, atol=1e-6)
        assert stage.step == 3 and stage.steps_in_round == 3


def test_the_last_stage_returns_the_input_gradient_of_the_loss() -> None:
    stage = DiLoCo(build_stage(MODEL, 1, 2), SGD, inner_optimizer=_sgd)
    reference = build_stage(MODEL, 1, 2)
    hidden = torch.randn(2, 8, MODEL.dim, generator=torch.Generator().manual_seed(3))
    _, labels = _batch()
    x = hidden.clone().requires_grad_(True)
    loss = cross_entropy_loss(reference(x), labels)
    loss.backward()
    grad, value = stage_inner_step(stage, hidden, labels, None)
    assert value == pytest.approx(loss.item(), rel=1e-6)
    torch.testing.assert_close(grad, x.grad)
    # The step happened: the stage's weights moved away from the untouched reference.
    assert not torch.equal(stage.model.head.weight, reference.head.weight)  # type: ignore[union-attr]


def test_a_failing_downstream_leaves_the_stage_untouched() -> None:
    stage = DiLoCo(build_stage(MODEL, 1, 3), SGD, inner_optimizer=_sgd)
    before = [p.detach().clone() for p in stage.model.parameters()]

    def unreachable(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
        raise ConnectionError("stage 2 is gone")

    with pytest.raises(ConnectionError):
        stage_inner_step(stage, torch.randn(2, 8, MODEL.dim), _batch()[1], unreachable)
    assert stage.step == 0
    assert all(p.grad is None for p in stage.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, stage.model.parameters(), strict=True))


def _placements() -> list[object]:
    cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return [
        pytest.param(Placement(device=torch.device("cpu"), precision="bf16"), id="cpu-bf16"),
        pytest.param("cuda-fp32", id="cuda-fp32", marks=cuda),
        pytest.param("cuda-bf16", id="cuda-bf16", marks=cuda),
    ]


def _placement(spec: object) -> Placement:
    if isinstance(spec, Placement):
        return spec
    precision = str(spec).split("-")[1]
    return Placement(device=torch.device("cuda", 0), precision=precision)


@pytest.mark.parametrize("spec", _placements())
def test_chained_stages_on_a_device_hand_their_neighbours_cpu_float32(spec: object) -> None:
    """Every stage runs its layers on its placement; what crosses a stage boundary (the wire's
    input) is CPU float32 both ways, so stages on different hardware can be chained."""
    placement = _placement(spec)
    seen: list[tuple[str, torch.dtype, str]] = []
    config = DiLoCoConfig(inner_steps=100, inner_lr=1e-2, warmup_steps=0, total_steps=100)
    stages = [DiLoCo(build_stage(MODEL, i, 3), config, placement=placement) for i in range(3)]

    def boundary(stage: DiLoCo, downstream):  # type: ignore[no-untyped-def]
        def call(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
            seen.append((hidden.device.type, hidden.dtype, labels.device.type))
            grad, loss = stage_inner_step(stage, hidden, labels, downstream)
            seen.append((grad.device.type, grad.dtype, "cpu"))
            return grad, loss

        return call

    stages[0].loss_fn = remote_loss(boundary(stages[1], boundary(stages[2], None)))
    losses = [stages[0].inner_step(*_batch(0)) for _ in range(8)]  # one batch, learnt
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert seen and set(seen) == {("cpu", torch.float32, "cpu")}
    for stage in stages:
        assert all(p.device.type == placement.device.type and p.dtype == torch.float32 for p in stage.params)
        assert stage.theta_round.device.type == "cpu"  # the outer round stays on the CPU in fp32


class _Bf16Out(torch.nn.Module):
    """A stage whose output comes out in bf16 (a Linear under bf16 autocast, no fp32 residual after
    it): what a device stage can hand its neighbour, and the wire must still get CPU float32."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(MODEL.dim, MODEL.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).to(torch.bfloat16)


def test_low_precision_outputs_cross_a_stage_boundary_as_float32() -> None:
    received: list[torch.dtype] = []

    def downstream(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        received.append(hidden.dtype)
        return torch.ones_like(hidden), 1.5

    hidden = torch.randn(2, 8, MODEL.dim).to(torch.bfloat16).requires_grad_(True)
    loss = remote_loss(downstream)(hidden, torch.zeros(2, 8, dtype=torch.long))
    loss.backward()
    assert received == [torch.float32] and hidden.grad is not None and hidden.grad.dtype == torch.bfloat16
    engine = DiLoCo(_Bf16Out(), SGD, inner_optimizer=_sgd)
    grad, value = stage_inner_step(
        engine, torch.randn(2, 8, MODEL.dim), torch.zeros(2, 8, dtype=torch.long), downstream
    )
    assert received == [torch.float32, torch.float32] and value == 1.5
    assert grad.dtype == torch.float32 and grad.device.type == "cpu"


def test_an_input_gradient_no_codec_carries_is_refused_before_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gradient a replica sends back must be encodable (a rotating codec sums 64 values in
    float32): one beyond MAX_WIRE_VALUE is refused before the update (NonFiniteStep, nothing
    stepped), so a replica never trains on a micro-batch it cannot answer. The bound is lowered
    here to reach it with finite parameter gradients; real ones that large overflow the layers."""
    assert torch.finfo(torch.float32).max > MAX_WIRE_VALUE * 64
    monkeypatch.setattr(pipeline, "MAX_WIRE_VALUE", 1e-6)
    stage = DiLoCo(build_stage(MODEL, 1, 2), SGD, inner_optimizer=_sgd)
    before = [p.detach().clone() for p in stage.model.parameters()]
    with pytest.raises(NonFiniteStep, match="beyond what the wire carries"):
        stage_inner_step(stage, torch.randn(2, 8, MODEL.dim), _batch()[1], None)
    assert stage.step == 0 and all(p.grad is None for p in stage.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, stage.model.parameters(), strict=True))


# --- a gradient that overflows the backward -------------------------------------------------

HUGE = 3e38
"""A finite float32 (and bf16) that no backward survives: what a hostile next stage answers."""


def _weights(engine: DiLoCo) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.model.parameters()]


def _banning(log: list[str]) -> Callable[[str], bool]:
    """A transport's blame that always finds the answering replica to ban."""

    def blame(why: str) -> bool:
        log.append(why)
        return True

    return blame


def _honest(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
    """A next stage that answers with a fixed, modest gradient."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(hidden.shape, generator=g) * 1e-3, 2.0


def test_a_driver_refuses_a_gradient_that_overflows_its_backward_and_keeps_its_weights() -> None:
    """Before: one such gradient turned every weight of an honest stage 0 to NaN (the infinite
    gradient norm makes clip_grad_norm_ multiply by 0). Now nothing is stepped and the gradient,
    not the forward, is named at fault."""
    torch.manual_seed(0)
    engine = DiLoCo(build_stage(MODEL, 0, 2), DiLoCoConfig(inner_steps=100, warmup_steps=0, total_steps=100))
    engine.loss_fn = remote_loss(lambda h, labels: (torch.full_like(h, HUGE), 1.0))
    before = _weights(engine)
    with pytest.raises(NonFiniteStep) as refused:
        driver_inner_step(engine, *_batch(0))
    assert refused.value.gradient_at_fault
    assert engine.step == 0 and all(p.grad is None for p in engine.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(engine), strict=True))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_driver_blames_an_overflowing_gradient_and_steps_on_the_next_one_as_if_it_never_came(
    precision: str,
) -> None:
    torch.manual_seed(0)
    config = DiLoCoConfig(inner_steps=100, warmup_steps=0, total_steps=100)
    place = Placement(device=torch.device("cpu"), precision=precision)  # bf16: autocast on the CPU
    clean = DiLoCo(build_stage(MODEL, 0, 2), config, placement=place)
    attacked = DiLoCo(copy.deepcopy(clean.model), config, placement=place)
    clean.loss_fn = remote_loss(_honest)
    answers = iter([(HUGE, 1.0), (HUGE, 1.0)])
    sent: list[torch.Tensor] = []
    blamed: list[str] = []

    def downstream(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        sent.append(hidden)
        answer = next(answers, None)
        return _honest(hidden, labels) if answer is None else (torch.full_like(hidden, answer[0]), answer[1])

    attacked.loss_fn = remote_loss(downstream, _banning(blamed))
    assert float(driver_inner_step(attacked, *_batch(0))) == 2.0
    clean.inner_step(*_batch(0))
    assert len(blamed) == 2 and "non-finite" in blamed[0] and attacked.step == 1
    assert all(s is sent[0] for s in sent)  # every attempt sends the same activations, not a recomputation
    assert all(torch.equal(a, b) for a, b in zip(_weights(clean), _weights(attacked), strict=True))


def test_a_driver_gives_up_after_max_blamed_gradients() -> None:
    engine = DiLoCo(build_stage(MODEL, 0, 2), DiLoCoConfig(inner_steps=100, warmup_steps=0, total_steps=100))
    blamed: list[str] = []
    engine.loss_fn = remote_loss(lambda h, labels: (torch.full_like(h, HUGE), 1.0), _banning(blamed))
    with pytest.raises(NonFiniteStep):
        driver_inner_step(engine, *_batch(0))
    assert len(blamed) == pipeline.MAX_BLAMED and engine.step == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_middle_stage_blames_an_overflowing_gradient_and_resends_the_same_output(precision: str) -> None:
    torch.manual_seed(0)
    layered = dataclasses.replace(MODEL, n_layers=3)
    config = DiLoCoConfig(inner_steps=100, warmup_steps=0, total_steps=100)
    place = Placement(device=torch.device("cpu"), precision=precision)
    clean = DiLoCo(build_stage(layered, 1, 3), config, placement=place)
    attacked = DiLoCo(copy.deepcopy(clean.model), config, placement=place)
    hidden, labels = torch.randn(2, 8, MODEL.dim), _batch()[1]
    sent: list[torch.Tensor] = []
    blamed: list[str] = []

    def downstream(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
        sent.append(h)
        return (torch.full_like(h, HUGE), 1.0) if len(sent) == 1 else _honest(h, y)

    grad, loss = stage_inner_step(attacked, hidden, labels, downstream, _banning(blamed))
    want, _ = stage_inner_step(clean, hidden, labels, _honest)
    assert len(blamed) == 1 and loss == 2.0 and len(sent) == 2 and sent[1] is sent[0]
    assert torch.equal(grad, want)
    assert all(torch.equal(a, b) for a, b in zip(_weights(clean), _weights(attacked), strict=True))
    # Without a blame (a segment check's replay) the same gradient is refused, at fault.
    with pytest.raises(NonFiniteStep) as refused:
        stage_inner_step(attacked, hidden, labels, lambda h, y: (torch.full_like(h, HUGE), 1.0))
    assert refused.value.gradient_at_fault and attacked.step == 1


def test_activations_that_overflow_the_forward_are_not_blamed_on_the_next_stage() -> None:
    """A backward that overflows even from a unit gradient is the forward's doing (the activations
    it was sent, or its own weights): the next stage's replica is not blamed; the sender is."""
    layered = dataclasses.replace(MODEL, n_layers=3)
    engine = DiLoCo(
        build_stage(layered, 1, 3), DiLoCoConfig(inner_steps=100, warmup_steps=0, total_steps=100)
    )
    blamed: list[str] = []
    for answer in (1e-3, HUGE):  # a modest gradient, and one that would be blamed on a sound forward
        with pytest.raises(NonFiniteStep) as refused:
            stage_inner_step(
                engine, torch.full((2, 8, MODEL.dim), HUGE), _batch()[1],
                lambda h, y, a=answer: (torch.full_like(h, a), 1.0), _banning(blamed),
            )  # fmt: skip
        assert not refused.value.gradient_at_fault
    assert blamed == [] and engine.step == 0 and all(p.grad is None for p in engine.model.parameters())


def test_a_blame_that_bans_no_one_ends_the_retries_at_once() -> None:
    """A transport that knows no answer to the id bans no one, so a retry could reach the same
    replica: the step gives up (NonFiniteStep, still naming the gradient) instead of retrying."""
    engine = DiLoCo(build_stage(MODEL, 0, 2), DiLoCoConfig(inner_steps=100, warmup_steps=0, total_steps=100))
    calls: list[str] = []

    def unknown(why: str) -> bool:
        calls.append(why)
        return False

    engine.loss_fn = remote_loss(lambda h, labels: (torch.full_like(h, HUGE), 1.0), unknown)
    with pytest.raises(NonFiniteStep) as refused:
        driver_inner_step(engine, *_batch(0))
    assert refused.value.gradient_at_fault and len(calls) == 1 and engine.step == 0


def test_a_forward_that_amplifies_a_unit_gradient_past_the_sound_gain_is_the_sender_s_fault(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Degenerate activations (all zeros through RMSNorm, on a large model) make even an honest
    next stage's gradient overflow the step; the test for fault bounds what the forward does to a
    unit gradient, so such a step is the sender's fault. The bound is lowered here to reach it on
    the test model, whose gain at a unit gradient is far below MAX_SOUND_GAIN."""
    layered = dataclasses.replace(MODEL, n_layers=3)
    engine = DiLoCo(
        build_stage(layered, 1, 3), DiLoCoConfig(inner_steps=100, warmup_steps=0, total_steps=100)
    )
    hidden, labels = torch.zeros(2, 8, MODEL.dim), _batch()[1]
    answer = lambda h, y: (torch.full_like(h, HUGE), 1.0)  # noqa: E731
    with pytest.raises(NonFiniteStep) as refused:
        stage_inner_step(engine, hidden, labels, answer)
    assert refused.value.gradient_at_fault  # a sound gain at this size: the gradient's fault
    monkeypatch.setattr(pipeline, "MAX_SOUND_GAIN", 1e-9)
    blamed: list[str] = []
    with pytest.raises(NonFiniteStep) as refused:
        stage_inner_step(engine, hidden, labels, answer, _banning(blamed))
    assert not refused.value.gradient_at_fault and blamed == [] and engine.step == 0


def test_an_fp16_driver_blames_an_overflowing_gradient_without_touching_its_loss_scale() -> None:
    """Under fp16 loss scaling the scaler would skip such a step and halve its scale; a hostile
    replica answering every time would drive the scale down until honest gradients underflow. The
    gradient is blamed first, and the scaler sees only the honest step."""
    engine = DiLoCo(
        build_stage(MODEL, 0, 2), DiLoCoConfig(inner_steps=100, warmup_steps=0, total_steps=100),
        placement=Placement(device=torch.device("cpu"), precision="fp16"),
    )  # fmt: skip
    assert engine.scaler is not None
    scale = engine.scaler.get_scale()
    answers = iter([HUGE])
    blamed: list[str] = []

    def downstream(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        value = next(answers, None)
        return (torch.full_like(hidden, value), 1.0) if value is not None else _honest(hidden, labels)

    engine.loss_fn = remote_loss(downstream, _banning(blamed))
    driver_inner_step(engine, *_batch(0))
    assert len(blamed) == 1 and engine.step == 1 and engine.scaler.get_scale() == scale
    assert all(bool(torch.isfinite(p).all()) for p in engine.model.parameters())


# --- degenerate activations ------------------------------------------------------------------


def _at_mean_square(shape: tuple[int, ...], mean_square: float, seed: int = 0) -> torch.Tensor:
    """Random activations whose every position has exactly this mean square over the width."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return x * (mean_square / x.pow(2).mean(-1, keepdim=True)).sqrt()


def test_degenerate_problem_counts_positions_under_a_quarter_of_the_norm_eps() -> None:
    eps = 1e-5
    assert degenerate_problem(torch.randn(2, 8, 16), eps) is None
    assert degenerate_problem(_at_mean_square((2, 8, 16), 0.26 * eps), eps) is None
    problem = degenerate_problem(_at_mean_square((2, 8, 16), 0.24 * eps), eps)
    assert problem is not None and problem.startswith("16 of 16 positions")
    one = torch.randn(2, 8, 16)
    one[1, 3] = 0.0  # a single all-zero position is enough to pass zeros on
    assert (degenerate_problem(one, eps) or "").startswith("1 of 16 positions")
    assert degenerate_problem(torch.zeros(0, 8, 16), eps) is None
    # The bound follows the model's eps, and a margin raises it (a sender's check of its output).
    assert degenerate_problem(_at_mean_square((2, 8, 16), 0.24 * eps), eps / 10) is None
    assert degenerate_problem(_at_mean_square((2, 8, 16), 0.4 * eps), eps) is None
    assert (degenerate_problem(_at_mean_square((2, 8, 16), 0.4 * eps), eps, margin=2.0) or "").startswith(
        "16 of"
    )


def test_a_stage_restores_activations_at_the_bound_but_passes_zeros_on_as_zeros() -> None:
    """Why a bound at a quarter of eps (pipeline.DEGENERATE_MEAN_SQUARE) is enough: zeros come out
    of a stage as zeros, so the next stage sees them too and the gain compounds down the pipeline;
    activations just above the bound come out above it (RMSNorm restores each position), so each
    stage's first norm sees a restored input and nothing compounds. Honest stage-0 output sits
    well above the bound from initialisation on."""
    config = ModelConfig(vocab_size=512, **dict(MODEL_SIZES["tiny"]) | {"n_layers": 6})
    torch.manual_seed(0)
    first, middle = build_stage(config, 0, 3), build_stage(config, 1, 3)
    eps = config.norm_eps
    with torch.no_grad():
        honest = first(torch.randint(0, config.vocab_size, (2, 32)))
    assert degenerate_problem(honest, eps) is None
    assert float(honest.pow(2).mean(-1).min()) > 20 * eps

    def through(x: torch.Tensor) -> tuple[torch.Tensor, float]:
        x = x.clone().requires_grad_(True)
        out = middle(x)
        unit = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        out.backward(unit / unit.abs().max())
        assert x.grad is not None
        return out.detach(), float(x.grad.abs().max())

    zeros_out, zeros_gain = through(torch.zeros(2, 32, config.dim))
    assert torch.equal(zeros_out, torch.zeros_like(zeros_out))
    edge = _at_mean_square((2, 32, config.dim), DEGENERATE_MEAN_SQUARE * eps * 1.01)
    assert degenerate_problem(edge, eps) is None
    edge_out, edge_gain = through(edge)
    assert degenerate_problem(edge_out, eps) is None
    # Nothing degenerate passes on: the first norm restores every position (here to ~10× the bound
    # on a 2-layer stage at initialisation, whose layers add little yet; 3,700× on a 4-layer
    # stage of the 350m preset, bench/bench_degenerate.py), and the stage gains less than on zeros.
    assert float(edge_out.pow(2).mean(-1).min()) > 4 * DEGENERATE_MEAN_SQUARE * eps
    assert edge_gain < zeros_gain, (edge_gain, zeros_gain)


# --- audits: do two next-stage answers to one micro-batch agree? -----------------------------


def _answer(seed: int = 0) -> torch.Tensor:
    return torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(seed))


def _bent(grad: torch.Tensor, cosine: float, seed: int = 1) -> torch.Tensor:
    """`grad` turned, sequence by sequence, to the given cosine with itself, norms kept."""
    flat = grad.flatten(1)
    noise = torch.randn(flat.shape, generator=torch.Generator().manual_seed(seed))
    noise -= (noise * flat).sum(1, keepdim=True) / (flat * flat).sum(1, keepdim=True) * flat
    noise *= flat.norm(dim=1, keepdim=True) / noise.norm(dim=1, keepdim=True)
    return (cosine * flat + math.sqrt(1 - cosine**2) * noise).view_as(grad)


def test_honest_looking_answers_agree_and_each_lie_is_told_apart() -> None:
    grad = _answer()
    agree = pipeline.answers_disagree
    assert agree(grad, grad.clone()) is None
    # Drift within what honest replicas showed: turned, rescaled.
    assert agree(grad, _bent(grad, 0.2) * 15) is None
    for lie, why in [
        (-grad, "cosine"),
        (_bent(grad, -0.2), "cosine"),
        (torch.zeros_like(grad), "norms"),
        (grad * 150, "norms"),
        (grad / 150, "norms"),
    ]:
        problem = agree(grad, lie)
        assert problem is not None and why in problem, (why, problem)
    assert agree(grad, torch.full_like(grad, math.inf)) == "a gradient is not finite"
    assert agree(grad, grad[:2]) is not None
    assert agree(torch.zeros_like(grad), torch.zeros_like(grad)) is None  # nothing to learn: both honest
    # Values whose squares overflow float32 are compared in float64.
    assert agree(grad * 1e30, grad * 1e30) is None


def test_each_audit_bound_is_where_its_constant_says() -> None:
    grad = _answer(3)
    agree = pipeline.answers_disagree
    cos = pipeline.AUDIT_MIN_COSINE
    assert agree(grad, _bent(grad, cos + 0.01)) is None
    assert agree(grad, _bent(grad, cos - 0.01)) is not None
    ratio = pipeline.AUDIT_MAX_NORM_RATIO
    assert agree(grad, grad * (ratio * 0.99)) is None
    assert agree(grad, grad * (ratio * 1.01)) is not None
