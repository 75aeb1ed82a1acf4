import hashlib
import io
import json
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from neuroshard.cli.node_flags import build_parser, diloco_config_from_args
from neuroshard.node.diloco import (
    DiLoCo,
    DiLoCoConfig,
    copy_into_parameters,
    default_inner_optimizer,
    flat_parameters,
    lr_factor,
    outer_sgd_step,
    tensor_digest,
)
from neuroshard.node.model import ModelConfig, Transformer, cross_entropy_loss
from neuroshard.node.network_definition import DEFAULT_OUTER_WARMUP_ROUNDS, parse_network
from neuroshard.node.p2p.state import adopt_state

MODEL = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16)

# Outer SGD lr 1 without momentum: θ_round − Δ lands where the replica went.
PLAIN_OUTER = {"outer_lr": 1.0, "outer_momentum": 0.0, "outer_nesterov": False}
# A constant inner lr: no warm-up, and the cosine decays from 1 to min_lr_ratio = 1.
CONSTANT_LR = {"warmup_steps": 0, "total_steps": 1, "min_lr_ratio": 1.0}


def batch(replica: int, step: int) -> tuple[Tensor, Tensor]:
    """A fixed random (input_ids, labels) pair, each (4, 16), for every (replica, step)."""
    gen = torch.Generator().manual_seed(1000 * replica + step)
    tokens = torch.randint(0, MODEL.vocab_size, (4, 17), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def sgd(lr: float) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    return lambda params: torch.optim.SGD(params, lr=lr)


def flat_grad(model: nn.Module) -> Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def set_flat_grad(model: nn.Module, vector: Tensor) -> None:
    sizes = [p.numel() for p in model.parameters()]
    for p, g in zip(model.parameters(), vector.split(sizes), strict=True):
        p.grad = g.view_as(p).clone()


def test_h1_sgd_diloco_equals_synchronous_data_parallel_sgd() -> None:
    config = DiLoCoConfig(inner_steps=1, grad_clip=None, **CONSTANT_LR, **PLAIN_OUTER)  # type: ignore[arg-type]
    replicas = [DiLoCo(Transformer(MODEL), config, inner_optimizer=sgd(0.5)) for _ in range(3)]
    reference = Transformer(MODEL)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    theta_0 = flat_parameters(reference.parameters())
    for step in range(4):
        for i, replica in enumerate(replicas):
            replica.inner_step(*batch(i, step))
        delta = torch.stack([r.pseudo_gradient() for r in replicas]).mean(dim=0)
        for replica in replicas:
            replica.outer_step(delta)

        # Synchronous data parallel: one model, the replicas' gradients averaged, one SGD step.
        grads = []
        for i in range(3):
            inputs, labels = batch(i, step)
            cross_entropy_loss(reference(inputs), labels).backward()
            grads.append(flat_grad(reference))
            reference_optimizer.zero_grad()
        set_flat_grad(reference, torch.stack(grads).mean(dim=0))
        reference_optimizer.step()
        reference_optimizer.zero_grad()

        expected = flat_parameters(reference.parameters())
        for replica in replicas:
            torch.testing.assert_close(replica.theta_round.detach(), expected, atol=1e-6, rtol=0)
            assert torch.equal(flat_parameters(replica.model.parameters()), replica.theta_round.detach())
    assert (expected - theta_0).norm() > 0.05  # the runs really moved


def test_one_replica_with_plain_outer_step_equals_local_adamw_training() -> None:
    config = DiLoCoConfig(inner_steps=4, warmup_steps=3, total_steps=12, **PLAIN_OUTER)  # type: ignore[arg-type]
    diloco = DiLoCo(Transformer(MODEL), config)
    for step in range(12):
        diloco.inner_step(*batch(0, step))
        if diloco.round_complete:
            diloco.outer_step(diloco.pseudo_gradient())
    assert diloco.round == 3

    local = Transformer(MODEL)
    params = list(local.parameters())
    optimizer = default_inner_optimizer(params, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    for step in range(12):
        inputs, labels = batch(0, step)
        cross_entropy_loss(local(inputs), labels).backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    torch.testing.assert_close(diloco.theta_round.detach(), flat_parameters(params), atol=1e-6, rtol=0)


def test_nesterov_outer_steps_match_the_hand_computed_formula() -> None:
    lr, mu = 0.7, 0.9
    diloco = DiLoCo(Transformer(MODEL), DiLoCoConfig(outer_lr=lr, outer_momentum=mu, outer_nesterov=True))
    theta_0 = diloco.theta_round.detach().clone()
    gen = torch.Generator().manual_seed(5)
    delta_1 = torch.randn(theta_0.shape, generator=gen) * 1e-3
    delta_2 = torch.randn(theta_0.shape, generator=gen) * 1e-3

    diloco.outer_step(delta_1)
    theta_1 = theta_0 - lr * (1 + mu) * delta_1  # buffer = Δ1, step = Δ1 + μ·buffer
    torch.testing.assert_close(diloco.theta_round.detach(), theta_1, atol=1e-7, rtol=0)
    assert torch.equal(flat_parameters(diloco.model.parameters()), diloco.theta_round.detach())

    diloco.outer_step(delta_2)
    buffer = mu * delta_1 + delta_2
    theta_2 = theta_1 - lr * (delta_2 + mu * buffer)
    torch.testing.assert_close(diloco.theta_round.detach(), theta_2, atol=1e-7, rtol=0)
    assert diloco.round == 2


def awkward_values(n: int, seed: int) -> Tensor:
    """float32 values that catch a fused multiply-add or a flushed subnormal: normal values of
    every scale, subnormals, zeros of both signs and values near the overflow edge."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.pow(10.0, torch.randint(-6, 3, (n,), generator=gen).float())
    x[::17] = torch.randn(x[::17].shape, generator=gen) * 1e-39  # subnormal
    x[::31] = 0.0
    x[1::31] = -0.0
    x[::97] = torch.randn(x[::97].shape, generator=gen) * 1e37
    return x


@pytest.mark.parametrize(("momentum", "nesterov"), [(0.9, True), (0.5, False), (0.0, False)])
def test_the_outer_step_rounds_every_operation_once(momentum: float, nesterov: bool) -> None:
    """Bit for bit the float32 sequence numpy computes one correctly rounded operation at a time:
    no fused multiply-add, no flushed subnormals, scalars rounded to float32 first."""
    np = pytest.importorskip("numpy")
    lr = 0.7
    theta, buffer = awkward_values(20_011, 0), None
    want_theta = theta.numpy().copy()
    want_buffer = None
    lr32, mu32 = np.float32(lr), np.float32(momentum)
    for step in range(3):
        delta = awkward_values(20_011, step + 1)
        buffer = outer_sgd_step(theta, buffer, delta, lr=lr, momentum=momentum, nesterov=nesterov)
        d = delta.numpy()
        if momentum == 0.0:
            update = d
        else:
            want_buffer = d.copy() if want_buffer is None else want_buffer * mu32 + d
            update = want_buffer * mu32 + d if nesterov else want_buffer
        want_theta = want_theta - update * lr32
        assert np.array_equal(theta.numpy().view(np.uint32), want_theta.view(np.uint32)), step
        if momentum == 0.0:
            assert buffer is None
        else:
            assert buffer is not None
            assert np.array_equal(buffer.numpy().view(np.uint32), want_buffer.view(np.uint32)), step


def test_the_outer_step_agrees_with_torch_sgd_to_the_last_bits() -> None:
    """The same rule as torch.optim.SGD (Nesterov, no dampening): equal up to the rounding of
    its fused multiply-adds."""
    theta = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    reference = theta.clone().requires_grad_(True)
    sgd_ = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    buffer = None
    for step in range(4):
        delta = torch.randn(5000, generator=torch.Generator().manual_seed(10 + step)) * 1e-2
        buffer = outer_sgd_step(theta, buffer, delta, lr=0.7, momentum=0.9, nesterov=True)
        reference.grad = delta.clone()
        sgd_.step()
    torch.testing.assert_close(theta, reference.detach(), rtol=0, atol=1e-6)


def twins(config: DiLoCoConfig, cls: type[DiLoCo] = DiLoCo) -> tuple[DiLoCo, DiLoCo]:
    """A plain engine and a `cls` engine in the same state, each stepped with `step_both`."""
    one, two = DiLoCo(Transformer(MODEL), config), cls(Transformer(MODEL), config)
    two.model.load_state_dict(one.model.state_dict())
    two.load_state_dict(one.state_dict())
    return one, two


def step_both(engines: tuple[DiLoCo, DiLoCo], round_: int) -> None:
    """Two inner steps of round `round_` on each engine, on the same batches."""
    for step in range(2):
        for engine in engines:
            engine.inner_step(*batch(0, 2 * round_ + step))


def test_a_lone_replicas_outer_step_equals_the_step_on_its_pseudo_gradient() -> None:
    two, one = twins(DiLoCoConfig(inner_steps=2, warmup_steps=1, total_steps=20))
    for r in range(3):
        step_both((one, two), r)
        one.local_outer_step()
        two.outer_step(two.pseudo_gradient())
        assert one.weights_hash() == two.weights_hash()
        assert torch.equal(flat_parameters(one.params), one.theta_round.detach())
    assert one.round == two.round == 3


class SlicedOuterStep(DiLoCo):
    """The outer step's CUDA path (one parameter at a time) forced on the CPU."""

    @property
    def _outer_on_device(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("momentum", "nesterov", "outer_warmup"),
    [(0.5, True, 0), (0.9, False, 0), (0.0, False, 0), (0.5, True, 3)],
)
def test_the_sliced_outer_step_gives_the_whole_vector_steps_bits(
    momentum: float, nesterov: bool, outer_warmup: int
) -> None:
    """The CUDA path's logic (per-parameter slices, the momentum built on the first step, a state
    loaded mid-run, a refused Δ changing nothing, the outer warm-up's ramp), run on the CPU
    against the whole-vector step."""
    config = DiLoCoConfig(
        inner_steps=2,
        warmup_steps=1,
        total_steps=20,
        outer_momentum=momentum,
        outer_nesterov=nesterov,
        outer_warmup_rounds=outer_warmup,
    )
    plain, sliced = twins(config, SlicedOuterStep)
    for r in range(4):
        step_both((plain, sliced), r)
        plain.outer_step(plain.pseudo_gradient())
        if r % 2:
            sliced.outer_step(sliced.pseudo_gradient())
        else:
            sliced.local_outer_step()
        assert sliced.weights_hash() == plain.weights_hash(), r
        assert torch.equal(flat_parameters(sliced.params), sliced.theta_round.detach())
        mine, theirs = sliced.state_dict()["outer_optimizer"], plain.state_dict()["outer_optimizer"]
        assert mine["state"].keys() == theirs["state"].keys()
        if momentum:
            assert torch.equal(mine["state"][0]["momentum_buffer"], theirs["state"][0]["momentum_buffer"])
        if r == 1:
            sliced.load_state_dict(plain.state_dict())  # a loaded checkpoint's buffer is taken up
    before = sliced.state_dict()
    with torch.no_grad():
        sliced.params[0].view(-1)[0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        sliced.local_outer_step()
    after = sliced.state_dict()
    assert torch.equal(after["theta_round"], before["theta_round"]) and after["round"] == before["round"]


def test_pseudo_gradient_points_from_local_weights_to_the_round_start() -> None:
    config = DiLoCoConfig(inner_steps=1, grad_clip=None, **CONSTANT_LR)  # type: ignore[arg-type]
    diloco = DiLoCo(Transformer(MODEL), config, inner_optimizer=sgd(0.5))
    reference = Transformer(MODEL)
    inputs, labels = batch(0, 0)
    cross_entropy_loss(reference(inputs), labels).backward()
    gradient = flat_grad(reference)

    diloco.inner_step(inputs, labels)
    delta = diloco.pseudo_gradient()
    local = flat_parameters(diloco.model.parameters())
    torch.testing.assert_close(local + delta, diloco.theta_round.detach(), atol=1e-7, rtol=0)
    # One SGD step moved the local weights by −lr·g, so Δ = +lr·g: same sign as the gradient.
    torch.testing.assert_close(delta, 0.5 * gradient, atol=1e-7, rtol=0)
    assert delta.dtype == torch.float32 and delta.shape == (MODEL.num_params(),)


def run(diloco: DiLoCo, steps: range) -> list[float]:
    """Inner steps on replica 0's batches with an outer step whenever a round completes."""
    losses = []
    for step in steps:
        losses.append(diloco.inner_step(*batch(0, step)))
        if diloco.round_complete:
            diloco.outer_step(diloco.pseudo_gradient())
    return losses


@pytest.mark.parametrize("stop", [4, 6])  # mid-round and right after an outer step
def test_state_dict_round_trip_resumes_bit_identically(stop: int) -> None:
    config = DiLoCoConfig(inner_steps=3, warmup_steps=2, total_steps=20)
    uninterrupted = DiLoCo(Transformer(MODEL), config)
    expected_losses = run(uninterrupted, range(11))

    first = DiLoCo(Transformer(MODEL), config)
    losses = run(first, range(stop))
    buffer = io.BytesIO()
    torch.save(first.checkpoint_state(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed = DiLoCo(Transformer(MODEL), config)
    resumed.model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["diloco"])
    assert (resumed.step, resumed.round, resumed.steps_in_round) == (stop, stop // 3, stop % 3)
    losses += run(resumed, range(stop, 11))

    assert losses == expected_losses
    assert torch.equal(resumed.theta_round.detach(), uninterrupted.theta_round.detach())
    assert torch.equal(
        flat_parameters(resumed.model.parameters()), flat_parameters(uninterrupted.model.parameters())
    )
    assert (resumed.step, resumed.round) == (uninterrupted.step, uninterrupted.round) == (11, 3)


def _saved_bytes(state: dict) -> int:  # type: ignore[type-arg]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


def test_a_checkpoint_at_a_round_boundary_holds_the_weights_once() -> None:
    """After an outer step the weights are θ_round's bits: the checkpoint stores them as views of
    θ_round (one storage, written once) and loads back bit for bit, signed zeros included."""
    diloco = DiLoCo(Transformer(MODEL), DiLoCoConfig(inner_steps=3, warmup_steps=2, total_steps=20))
    run(diloco, range(3))
    first = diloco.params[0]
    with torch.no_grad():  # same value, other bits: the first parameter must not be shared
        first.view(-1)[0] = -0.0
        diloco.theta_round.detach()[0] = 0.0
    state = diloco.checkpoint_state()
    theta = state["diloco"]["theta_round"]
    shared = {
        name
        for name, tensor in state["model"].items()
        if tensor.untyped_storage().data_ptr() == theta.untyped_storage().data_ptr()
    }
    names = [name for name, _ in diloco.model.named_parameters()]
    assert shared == set(names[1:])
    apart = {**state, "model": {k: v.clone() for k, v in state["model"].items()}}
    assert _saved_bytes(apart) - _saved_bytes(state) >= 4 * sum(p.numel() for p in diloco.params[1:])

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    resumed = DiLoCo(Transformer(MODEL), DiLoCoConfig(inner_steps=3, warmup_steps=2, total_steps=20))
    resumed.model.load_state_dict(loaded["model"])
    resumed.load_state_dict(loaded["diloco"])
    for a, b in zip(resumed.params, diloco.params, strict=True):
        assert torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32))
    assert torch.signbit(resumed.params[0].detach().view(-1)[0])
    # Views in the loaded file, copies in the model: training the model leaves θ_round alone.
    run(resumed, range(3, 4))
    assert torch.equal(resumed.theta_round.detach().view(torch.int32), theta.view(torch.int32))


def test_a_checkpoint_mid_round_shares_nothing() -> None:
    diloco = DiLoCo(Transformer(MODEL), DiLoCoConfig(inner_steps=3, warmup_steps=2, total_steps=20))
    run(diloco, range(4))
    state = diloco.checkpoint_state()
    theta = state["diloco"]["theta_round"].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() != theta for t in state["model"].values())


def test_state_dict_is_a_snapshot() -> None:
    diloco = DiLoCo(Transformer(MODEL), DiLoCoConfig(inner_steps=2))
    run(diloco, range(3))
    state = diloco.state_dict()
    theta, exp_avg = state["theta_round"].clone(), state["inner_optimizer"]["state"][0]["exp_avg"].clone()
    run(diloco, range(3, 5))
    assert torch.equal(state["theta_round"], theta)
    assert torch.equal(state["inner_optimizer"]["state"][0]["exp_avg"], exp_avg)
    assert state["step"] == 3 and diloco.step == 5


def test_load_state_dict_refuses_another_model_size() -> None:
    state = DiLoCo(Transformer(MODEL), DiLoCoConfig()).state_dict()
    other = DiLoCo(Transformer(ModelConfig.from_dict({**MODEL.to_dict(), "dim": 16})), DiLoCoConfig())
    with pytest.raises(ValueError, match=r"checkpoint θ_round has \d+ elements, this model \d+"):
        other.load_state_dict(state)


def test_outer_step_rejects_bad_pseudo_gradients() -> None:
    diloco = DiLoCo(Transformer(MODEL), DiLoCoConfig())
    d = MODEL.num_params()
    theta = diloco.theta_round.detach().clone()
    with pytest.raises(ValueError, match=rf"shape \({d + 1},\) dtype torch.float32; expected \({d},\)"):
        diloco.outer_step(torch.zeros(d + 1))
    with pytest.raises(ValueError, match=r"dtype torch\.float64"):
        diloco.outer_step(torch.zeros(d, dtype=torch.float64))
    bad = torch.zeros(d)
    bad[3], bad[7] = float("nan"), float("inf")
    with pytest.raises(ValueError, match=rf"2 non-finite values out of {d}"):
        diloco.outer_step(bad)
    opposite = torch.zeros(d)
    opposite[0], opposite[1] = float("inf"), float("-inf")
    with pytest.raises(ValueError, match=rf"2 non-finite values out of {d}"):
        diloco.outer_step(opposite)
    assert torch.equal(diloco.theta_round.detach(), theta) and diloco.round == 0


def test_outer_step_takes_finite_values_whose_square_overflows() -> None:
    """The finiteness check takes Δ·Δ first (codec.all_finite); a dot that overflows float32 must
    not refuse a Δ whose every value is finite."""
    diloco = DiLoCo(Transformer(MODEL), DiLoCoConfig())
    huge = torch.zeros(MODEL.num_params())
    huge[:4] = 3e38
    assert not torch.isfinite(torch.dot(huge, huge))
    diloco.outer_step(huge)
    assert diloco.round == 1


def test_round_complete_after_h_inner_steps() -> None:
    diloco = DiLoCo(Transformer(MODEL), DiLoCoConfig(inner_steps=2))
    assert not diloco.round_complete
    diloco.inner_step(*batch(0, 0))
    assert not diloco.round_complete
    diloco.inner_step(*batch(0, 1))
    assert diloco.round_complete and diloco.steps_in_round == 2
    diloco.outer_step(diloco.pseudo_gradient())
    assert not diloco.round_complete and diloco.steps_in_round == 0 and diloco.step == 2


def test_inner_step_returns_the_loss_and_follows_the_schedule() -> None:
    config = DiLoCoConfig(inner_lr=1e-2, warmup_steps=4, total_steps=10)
    diloco = DiLoCo(Transformer(MODEL), config)
    inputs, labels = batch(0, 0)
    with torch.no_grad():
        expected = cross_entropy_loss(diloco.model(inputs), labels).item()
    assert diloco.current_lr == pytest.approx(1e-2 * 0.25)
    assert diloco.inner_step(inputs, labels) == expected
    assert diloco.current_lr == pytest.approx(1e-2 * 0.5)
    assert all(p.grad is None for p in diloco.model.parameters())


def test_a_replica_that_adopts_a_later_round_continues_the_network_schedule() -> None:
    """A joiner's schedule is where the network's is (round × H), not at its own step 0: else
    its warm-up Δ is short and its peers refuse it as a near free rider."""
    config = DiLoCoConfig(inner_lr=1e-2, inner_steps=4, warmup_steps=8, total_steps=40)
    veteran = DiLoCo(Transformer(MODEL), config)
    for step in range(12):
        veteran.inner_step(*batch(0, step))
        if veteran.round_complete:
            veteran.outer_step(veteran.pseudo_gradient())
    joiner = DiLoCo(Transformer(MODEL), config)
    adopt_state(joiner, veteran.theta_round.detach(), None, veteran.round)
    assert joiner.step == 0 and joiner.schedule_step == veteran.schedule_step == 12
    assert joiner.current_lr == veteran.current_lr == pytest.approx(1e-2 * lr_factor(12, config))
    assert joiner.current_lr > 1e-2 * lr_factor(0, config) * 5  # not back in the warm-up
    veteran.inner_step(*batch(0, 12))
    joiner.inner_step(*batch(0, 12))
    assert joiner.current_lr == veteran.current_lr == pytest.approx(1e-2 * lr_factor(13, config))


def test_lr_factor_warms_up_then_decays_to_the_floor() -> None:
    config = DiLoCoConfig(warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [lr_factor(s, config) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, config) == 1.0
    assert lr_factor(9, config) == pytest.approx(0.55)  # half-way down the cosine
    assert lr_factor(14, config) == pytest.approx(0.1)
    assert lr_factor(1000, config) == pytest.approx(0.1)
    no_warmup = DiLoCoConfig(warmup_steps=0, total_steps=10)
    assert lr_factor(0, no_warmup) == 1.0
    assert lr_factor(5, DiLoCoConfig(warmup_steps=5, total_steps=5, min_lr_ratio=0.2)) == 0.2


def test_default_inner_optimizer_does_not_decay_norm_gains() -> None:
    model = Transformer(MODEL)
    optimizer = default_inner_optimizer(list(model.parameters()), DiLoCoConfig(weight_decay=0.1))
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (not name.endswith("norm.weight")), name


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"inner_steps": 0}, "inner_steps must be >= 1, got 0"),
        ({"inner_lr": 0.0}, "inner_lr must be > 0"),
        ({"betas": (0.9, 1.0)}, r"betas must lie in \[0, 1\)"),
        (
            {"warmup_steps": 10, "total_steps": 5},
            r"total_steps \(5\) must be >= 1 and >= warmup_steps \(10\)",
        ),
        ({"min_lr_ratio": 1.5}, r"min_lr_ratio must lie in \[0, 1\], got 1.5"),
        ({"grad_clip": 0.0}, "grad_clip must be > 0"),
        ({"outer_lr": -0.7}, "outer_lr must be > 0"),
        ({"outer_momentum": 1.0}, r"outer_momentum must lie in \[0, 1\)"),
        ({"outer_momentum": 0.0}, "outer_nesterov=True needs outer_momentum > 0"),
    ],
)
def test_config_validation(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DiLoCoConfig(**fields)  # type: ignore[arg-type]


def test_copy_into_parameters_round_trips_and_checks_the_length() -> None:
    model = Transformer(MODEL)
    vector = torch.arange(MODEL.num_params(), dtype=torch.float32)
    copy_into_parameters(vector, model.parameters())
    assert torch.equal(flat_parameters(model.parameters()), vector)
    vector += 1  # the model must not alias the vector
    assert not torch.equal(flat_parameters(model.parameters()), vector)
    with pytest.raises(ValueError, match=rf"shape \({MODEL.num_params() - 1},\), the parameters need"):
        copy_into_parameters(vector[1:], model.parameters())


def test_weights_hash_is_sha256_of_little_endian_float32() -> None:
    assert tensor_digest(torch.tensor([1.0])) == hashlib.sha256(bytes([0, 0, 0x80, 0x3F])).hexdigest()
    a = DiLoCo(Transformer(MODEL), DiLoCoConfig())
    b = DiLoCo(Transformer(MODEL), DiLoCoConfig())
    assert a.weights_hash() == b.weights_hash()
    a.outer_step(torch.full_like(a.theta_round.detach(), 1e-3))
    assert a.weights_hash() != b.weights_hash()


# The outer step's tuned defaults (bench/bench_convergence.py, bench/RESULTS.md "DiLoCo against
# synchronous data parallel"): pinned here so that changing them is a decision, not an accident.
TUNED_OUTER = (1.0, 0.5, True)  # Nesterov, lr 1.0, momentum 0.5, from H = 20
TUNED_OUTER_SHORT_ROUNDS = (0.7, 0.5, True)  # below H = 20


@pytest.mark.parametrize(
    ("inner_steps", "expected"),
    [(1, TUNED_OUTER_SHORT_ROUNDS), (10, TUNED_OUTER_SHORT_ROUNDS), (19, TUNED_OUTER_SHORT_ROUNDS)]
    + [(h, TUNED_OUTER) for h in (20, 50, 100, 500)],
)
def test_a_bare_config_carries_the_tuned_outer_defaults(
    inner_steps: int, expected: tuple[float, float, bool]
) -> None:
    config = DiLoCoConfig(inner_steps=inner_steps)
    assert (config.outer_lr, config.outer_momentum, config.outer_nesterov) == expected
    assert config.outer_step_lr == expected[0]
    assert (config.outer_lr, config.outer_momentum) != (0.7, 0.9)  # not the paper's H = 500 values


def test_an_outer_lr_given_is_kept_at_any_h() -> None:
    assert DiLoCoConfig(inner_steps=10, outer_lr=1.0).outer_lr == 1.0
    assert DiLoCoConfig(inner_steps=500, outer_lr=0.7).outer_lr == 0.7
    with pytest.raises(ValueError, match="outer_lr must be > 0"):
        DiLoCoConfig(inner_steps=10, outer_lr=0.0)


def test_the_outer_warmup_ramps_the_lr_over_its_rounds_and_none_changes_no_bit() -> None:
    # Plain outer SGD, so each round moves θ by exactly lr_r · Δ: lr_r = lr · min(1, (r + 1) / K).
    torch.manual_seed(0)
    plain = {"outer_lr": 0.8, "outer_momentum": 0.0, "outer_nesterov": False}
    ramped = DiLoCo(nn.Linear(4, 3), DiLoCoConfig(inner_steps=2, outer_warmup_rounds=4, **plain))
    delta = torch.full_like(ramped.theta_round.detach(), 0.5)
    steps = []
    for _ in range(6):
        before = ramped.theta_round.detach().clone()
        ramped.outer_step(delta)
        steps.append(float((before - ramped.theta_round.detach())[0] / 0.5))
    assert steps == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8])
    # Without a warm-up (the default) the step is outer_sgd_step at the config's lr, bit for bit,
    # every round; a warm-up of one round is the same step.
    for warmup in (0, 1):
        engine = DiLoCo(nn.Linear(4, 3), DiLoCoConfig(inner_steps=2, outer_warmup_rounds=warmup))
        theta, buffer = engine.theta_round.detach().clone(), None
        for r in range(3):
            delta = torch.full_like(theta, 1e-3 * (r + 1))
            buffer = outer_sgd_step(theta, buffer, delta, lr=0.7, momentum=0.5, nesterov=True)
            engine.outer_step(delta)
            assert torch.equal(engine.theta_round.detach(), theta), (warmup, r)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="outer_warmup_rounds must be an integer >= 0"):
            DiLoCoConfig(outer_warmup_rounds=bad)


def test_a_network_toml_ramps_the_outer_step_by_default_and_served_bytes_keep_their_meaning() -> None:
    # A network.toml that names no warm-up gets the default defence's ramp, signed explicitly; one
    # that names 0 signs no key, as definitions signed before the field existed; a served document
    # without the key means 0, so those bytes step as they always did.
    example = Path(__file__).resolve().parents[2] / "examples" / "network.toml"
    document = tomllib.loads(example.read_text())
    assert "outer_warmup_rounds" not in document.get("diloco", {})
    ramped = parse_network(document)
    assert ramped.diloco.outer_warmup_rounds == DEFAULT_OUTER_WARMUP_ROUNDS == 3
    served = json.loads(ramped.canonical_bytes())
    assert served["diloco"]["outer_warmup_rounds"] == 3
    assert parse_network(served, served=True).diloco.outer_warmup_rounds == 3
    document.setdefault("diloco", {})["outer_warmup_rounds"] = 0
    plain = parse_network(document)
    assert plain.diloco.outer_warmup_rounds == 0
    old_bytes = json.loads(plain.canonical_bytes())
    assert "outer_warmup_rounds" not in old_bytes["diloco"]
    assert parse_network(old_bytes, served=True).diloco.outer_warmup_rounds == 0


def test_a_resumed_checkpoint_steps_with_the_configs_outer_step_not_the_saved_one() -> None:
    # A checkpoint saved under lr 1.0 at H = 10 (the default before tuned_outer_lr) resumes with the
    # config's 0.7 and the saved momentum: replicas that started fresh and that resumed step alike.
    torch.manual_seed(0)
    saved = DiLoCo(nn.Linear(4, 3), DiLoCoConfig(inner_steps=10, outer_lr=1.0))
    saved.outer_step(torch.full_like(saved.theta_round.detach(), 0.5))  # a momentum buffer to keep
    resumed = DiLoCo(nn.Linear(4, 3), DiLoCoConfig(inner_steps=10))
    resumed.load_state_dict(saved.state_dict())
    group = resumed.outer_optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.7, 0.5, True)
    assert torch.equal(
        resumed.outer_optimizer.state[resumed.theta_round]["momentum_buffer"],
        saved.outer_optimizer.state[saved.theta_round]["momentum_buffer"],
    )
    delta = torch.full_like(saved.theta_round.detach(), 0.25)
    resumed.outer_step(delta)
    saved.outer_step(delta)
    assert resumed.weights_hash() != saved.weights_hash()


@pytest.mark.parametrize("inner_steps", [10, 100])
def test_the_network_definition_and_the_node_take_the_config_defaults(inner_steps: int) -> None:
    expected = DiLoCoConfig(inner_steps=inner_steps)
    example = Path(__file__).resolve().parents[2] / "examples" / "network.toml"
    document = tomllib.loads(example.read_text())
    document.setdefault("diloco", {})["inner_steps"] = inner_steps
    net = parse_network(document)
    node = diloco_config_from_args(build_parser().parse_args(["--inner-steps", str(inner_steps)]))
    for config in (net.diloco, node):
        assert (config.outer_lr, config.outer_momentum, config.outer_nesterov) == (
            expected.outer_lr,
            expected.outer_momentum,
            expected.outer_nesterov,
        )
    # The one exception: a network.toml ramps the outer step by default, the flags do not.
    assert (net.diloco.outer_warmup_rounds, node.outer_warmup_rounds) == (DEFAULT_OUTER_WARMUP_ROUNDS, 0)
    # A definition that leaves the outer step out serves the same values to every joining node.
    served = parse_network(json.loads(json.dumps(net.to_document())), served=True)
    assert served.diloco == net.diloco


def test_the_remembered_weights_hash_follows_every_in_place_change_of_theta() -> None:
    torch.manual_seed(0)
    engine = DiLoCo(nn.Linear(4, 3), DiLoCoConfig(inner_steps=2))
    first = engine.weights_hash()
    assert first == tensor_digest(engine.theta_round) and engine.weights_hash() == first
    engine.outer_step(torch.full_like(engine.theta_round.detach(), 0.5))
    assert engine.weights_hash() == tensor_digest(engine.theta_round) != first
    with torch.no_grad():
        engine.theta_round.copy_(torch.zeros_like(engine.theta_round))  # as an adopted state does
    assert engine.weights_hash() == tensor_digest(torch.zeros_like(engine.theta_round))
    engine.load_state_dict(
        {**engine.state_dict(), "theta_round": torch.ones_like(engine.theta_round.detach())}
    )
    assert engine.weights_hash() == tensor_digest(torch.ones_like(engine.theta_round))
