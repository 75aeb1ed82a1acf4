"""Device and precision: the inner loop on a device, the outer round exact on the CPU.

Every path that runs without a GPU is tested on the CPU (bf16 and fp16 autocast exist there);
the CUDA tests are skipped where torch sees no CUDA device, never faked."""

import dataclasses
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor

from neuroshard.cli.node_flags import build_parser, checkpoint_interval, placement_from_args
from neuroshard.node import aggregation
from neuroshard.node.checkpoint import CheckpointIdentity, load_checkpoint
from neuroshard.node.device import Placement, resolve, resolve_device, resolve_precision
from neuroshard.node.diloco import (
    DiLoCo,
    DiLoCoConfig,
    copy_into_parameters,
    flat_parameters,
    outer_sgd_step,
    tensor_digest,
)
from neuroshard.node.model import ModelConfig, Transformer
from neuroshard.node.pipeline import stage_fingerprint
from neuroshard.node.replay import capture_inner_state, install_inner_state
from neuroshard.node.rotation import RotationConfig
from neuroshard.node.trainer import Trainer, TrainerConfig
from neuroshard.node.work import RoundWork
from neuroshard.testing.ports import free_port

MODEL = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16)
DILOCO = DiLoCoConfig(inner_steps=5, warmup_steps=2, total_steps=100)
CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def batch(replica: int, step: int) -> tuple[Tensor, Tensor]:
    """A fixed random (input_ids, labels) pair, each (4, 16), for every (replica, step)."""
    gen = torch.Generator().manual_seed(1000 * replica + step)
    tokens = torch.randint(0, MODEL.vocab_size, (4, 17), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def test_resolve_cpu_and_precisions() -> None:
    assert resolve("cpu", "auto") == Placement(device=CPU, precision="fp32")
    assert resolve("cpu", "bf16").autocast_dtype == torch.bfloat16
    assert resolve("cpu", "fp16").autocast_dtype == torch.float16
    assert resolve("cpu", "fp32").autocast_dtype is None
    assert resolve_precision("auto", CPU) == "fp32"
    with pytest.raises(ValueError, match="precision"):
        resolve_precision("int4", CPU)
    with pytest.raises(ValueError, match="not a device"):
        resolve_device("gpu-please")
    with pytest.raises(ValueError, match="supported"):
        resolve_device("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_and_auto_falls_back() -> None:
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda:0")
    if not torch.backends.mps.is_available():
        assert resolve("auto", "auto") == Placement.cpu()


@needs_cuda
def test_auto_on_cuda_picks_bf16_autocast() -> None:
    placement = resolve("auto", "auto")
    assert placement.device.type == "cuda"
    assert placement.precision == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")
    assert torch.backends.cuda.matmul.allow_tf32


def test_cli_flags_reach_the_placement() -> None:
    args = build_parser().parse_args(["--device", "cpu", "--precision", "bf16"])
    assert placement_from_args(args, 1) == Placement(device=CPU, precision="bf16")
    assert placement_from_args(args, 2) == Placement(device=CPU, precision="bf16")  # a pipeline stage too
    fp16 = build_parser().parse_args(["--device", "cpu", "--precision", "fp16"])
    assert placement_from_args(fp16, 1) == Placement(device=CPU, precision="fp16")
    with pytest.raises(ValueError, match=r"pipeline stages .* fp32 or bf16"):
        placement_from_args(fp16, 2)


def test_bf16_autocast_keeps_fp32_master_weights_and_the_loss_falls() -> None:
    engine = DiLoCo(Transformer(MODEL), DILOCO, placement=Placement(device=CPU, precision="bf16"))
    x, y = batch(0, 0)
    losses = [engine.inner_step(x, y) for _ in range(30)]
    assert losses[-1] < 0.7 * losses[0]
    assert all(p.dtype == torch.float32 for p in engine.params)
    assert engine.theta_round.device == CPU and engine.theta_round.dtype == torch.float32
    assert engine.pseudo_gradient().dtype == torch.float32


def test_bf16_autocast_actually_changes_the_arithmetic() -> None:
    """Not a no-op: the same steps in fp32 and bf16 give close but different Δs."""
    deltas = []
    for precision in ("fp32", "bf16"):
        engine = DiLoCo(Transformer(MODEL), DILOCO, placement=Placement(device=CPU, precision=precision))
        for step in range(5):
            engine.inner_step(*batch(0, step))
        deltas.append(engine.pseudo_gradient())
    assert not torch.equal(deltas[0], deltas[1])
    assert torch.nn.functional.cosine_similarity(deltas[0], deltas[1], dim=0) > 0.95


def test_fp16_autocast_scales_the_loss_and_trains() -> None:
    engine = DiLoCo(Transformer(MODEL), DILOCO, placement=Placement(device=CPU, precision="fp16"))
    assert engine.scaler is not None
    x, y = batch(0, 0)
    losses = [engine.inner_step(x, y) for _ in range(30)]
    assert losses[-1] < 0.7 * losses[0]
    assert "grad_scaler" in engine.state_dict()


def _mixed_stage(placements: list[Placement], rounds: int) -> list[list[str]]:
    """Replicas on the given placements run `rounds` rounds, aggregating with the node's default
    rule; returns each round's θ hash per replica, checking each model holds θ_round."""
    engines = [DiLoCo(Transformer(MODEL), DILOCO, placement=p) for p in placements]
    hashes = []
    for r in range(rounds):
        for i, engine in enumerate(engines):
            for step in range(DILOCO.inner_steps):
                engine.inner_step(*batch(i, r * DILOCO.inner_steps + step))
        deltas = [engine.pseudo_gradient() for engine in engines]
        assert all(d.device == CPU and d.dtype == torch.float32 for d in deltas)
        agg = aggregation.aggregate("default", torch.stack(deltas))
        for engine in engines:
            engine.outer_step(agg.clone())
            assert torch.equal(flat_parameters(engine.params), engine.theta_round.detach())
        hashes.append([engine.weights_hash() for engine in engines])
    return hashes


def test_an_fp32_and_a_bf16_replica_end_every_round_bit_identical() -> None:
    hashes = _mixed_stage([Placement.cpu(), Placement(device=CPU, precision="bf16")], rounds=3)
    for round_hashes in hashes:
        assert len(set(round_hashes)) == 1
    assert len({h[0] for h in hashes}) == 3  # the rounds did move θ


@needs_cuda
def test_a_cpu_and_a_cuda_bf16_replica_end_every_round_bit_identical() -> None:
    cuda = resolve("cuda", "bf16")
    hashes = _mixed_stage([Placement.cpu(), cuda, Placement(device=cuda.device, precision="fp32")], rounds=2)
    for round_hashes in hashes:
        assert len(set(round_hashes)) == 1


@needs_cuda
@pytest.mark.parametrize("nesterov", [True, False])
def test_the_outer_step_on_cuda_gives_the_cpus_bits(nesterov: bool) -> None:
    """The outer rule on CUDA and on the CPU, from the same values (subnormals, zeros, values near
    overflow among them), three steps with momentum: the same bits every step."""
    gen = torch.Generator().manual_seed(0)
    n = 1_000_003
    scale = torch.pow(10.0, torch.randint(-8, 4, (n,), generator=gen).float())
    theta = torch.randn(n, generator=gen) * scale
    theta[::13] = torch.randn(theta[::13].shape, generator=gen) * 1e-39
    theta[::101] = torch.randn(theta[::101].shape, generator=gen) * 1e37
    on_cuda, on_cpu = theta.cuda(), theta.clone()
    buffer_cuda = buffer_cpu = None
    for step in range(3):
        delta = torch.randn(n, generator=gen) * torch.pow(
            10.0, torch.randint(-9, 2, (n,), generator=gen).float()
        )
        delta[::7] = torch.randn(delta[::7].shape, generator=gen) * 1e-40
        kw = {"lr": 0.7, "momentum": 0.9, "nesterov": nesterov}
        buffer_cuda = outer_sgd_step(on_cuda, buffer_cuda, delta.cuda(), **kw)  # type: ignore[arg-type]
        buffer_cpu = outer_sgd_step(on_cpu, buffer_cpu, delta, **kw)  # type: ignore[arg-type]
        assert torch.equal(on_cuda.cpu().view(torch.int32), on_cpu.view(torch.int32)), step
        assert buffer_cuda is not None and buffer_cpu is not None
        assert torch.equal(buffer_cuda.cpu().view(torch.int32), buffer_cpu.view(torch.int32)), step


@needs_cuda
def test_a_cuda_lone_replica_steps_on_the_device_and_matches_the_cpu_rule() -> None:
    """A lone CUDA replica's outer step (Δ formed and applied on the device, one parameter at a
    time) gives the bits the CPU computes from the same θ_round, momentum and local weights; a
    state loaded mid-run (pageable CPU vectors) is taken up."""
    engine = DiLoCo(Transformer(MODEL), DILOCO, placement=resolve("cuda", "bf16"))
    group = engine.outer_optimizer.param_groups[0]
    for r in range(4):
        for step in range(DILOCO.inner_steps):
            engine.inner_step(*batch(0, r * DILOCO.inner_steps + step))
        theta = engine.theta_round.detach().clone()
        momentum = engine.outer_optimizer.state.get(engine.theta_round, {}).get("momentum_buffer")
        momentum = None if momentum is None else momentum.clone()
        delta = theta - flat_parameters(engine.params)
        outer_sgd_step(
            theta, momentum, delta, lr=group["lr"], momentum=group["momentum"], nesterov=group["nesterov"]
        )
        engine.local_outer_step()
        assert engine.theta_round.device == CPU
        assert torch.equal(engine.theta_round.detach().view(torch.int32), theta.view(torch.int32)), r
        assert torch.equal(flat_parameters(engine.params), theta)
        if r == 1:  # a checkpoint loaded into the running engine replaces θ_round and the momentum
            state = engine.state_dict()
            state["theta_round"] = state["theta_round"] * 0.5
            engine.load_state_dict(state)
            copy_into_parameters(engine.theta_round.detach(), engine.params)
    assert engine.round == 4


@needs_cuda
def test_a_cuda_lone_replica_refuses_non_finite_weights_and_changes_nothing() -> None:
    engine = DiLoCo(Transformer(MODEL), DILOCO, placement=resolve("cuda", "fp32"))
    engine.inner_step(*batch(0, 0))
    engine.local_outer_step()
    theta, momentum = engine.theta_round.detach().clone(), engine.state_dict()["outer_optimizer"]
    with torch.no_grad():
        engine.params[-1].view(-1)[3] = float("nan")
    with pytest.raises(ValueError, match="1 non-finite"):
        engine.local_outer_step()
    assert torch.equal(engine.theta_round.detach(), theta) and engine.round == 1
    after = engine.state_dict()["outer_optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(after, momentum["state"][0]["momentum_buffer"])


def test_move_to_another_placement_and_back_changes_nothing() -> None:
    engine = DiLoCo(Transformer(MODEL), DILOCO, placement=Placement(device=CPU, precision="bf16"))
    for step in range(3):
        engine.inner_step(*batch(0, step))
    before = tensor_digest(flat_parameters(engine.params))
    engine.move_to(Placement.cpu())
    assert engine.placement.precision == "fp32"
    assert tensor_digest(flat_parameters(engine.params)) == before
    engine.inner_step(*batch(0, 3))  # the optimizer state still matches the parameters


@needs_cuda
def test_a_cuda_engine_state_is_all_cpu_and_resumes_on_the_cpu() -> None:
    engine = DiLoCo(Transformer(MODEL), DILOCO, placement=resolve("cuda", "bf16"))
    for step in range(3):
        engine.inner_step(*batch(0, step))
    state = engine.state_dict()
    tensors = [v for s in state["inner_optimizer"]["state"].values() for v in s.values()]
    assert all(t.device == CPU for t in tensors)
    cpu = DiLoCo(Transformer(MODEL), DILOCO)
    cpu.model.load_state_dict({k: v.cpu() for k, v in engine.model.state_dict().items()})
    cpu.load_state_dict(state)
    assert cpu.inner_step(*batch(0, 3)) == pytest.approx(engine.inner_step(*batch(0, 3)), rel=0.05)


def _trainer(  # type: ignore[no-untyped-def]
    published,
    directory: Path,
    placement: Placement,
    max_steps: int,
    rotation: RotationConfig | None = None,
    log: Callable[[str], None] = lambda line: None,
    **kw,
) -> Trainer:
    return Trainer(
        **kw,
        wallet_id="feedface",
        dataset=published.dataset,
        model_config=ModelConfig(
            vocab_size=published.dataset.tokenizer.vocab_size,
            dim=32,
            n_layers=2,
            n_heads=2,
            ffn_dim=64,
            max_seq_len=32,
        ),
        diloco_config=DiLoCoConfig(inner_steps=6, warmup_steps=3, total_steps=60),
        config=TrainerConfig(
            batch_size=4,
            seq_len=32,
            max_steps=max_steps,
            checkpoint_every=5,
            log_every=10,
            rotation=rotation or RotationConfig(),
        ),
        checkpoint_dir=directory,
        log=log,
        placement=placement,
    )


def test_trainer_device_cpu_precision_bf16_trains_and_the_loss_falls(published, tmp_path: Path) -> None:
    trainer = _trainer(published, tmp_path, Placement(device=CPU, precision="bf16"), max_steps=36)
    result = trainer.run(threading.Event())
    first, last = sum(result.losses[:6]) / 6, sum(result.losses[-6:]) / 6
    assert last < first - 0.5, (first, last)
    assert result.rounds == 6


def test_a_bf16_checkpoint_resumes_in_fp32_on_the_cpu(published, tmp_path: Path) -> None:
    trained = _trainer(published, tmp_path, Placement(device=CPU, precision="bf16"), max_steps=8)
    trained.run(threading.Event())
    identity = CheckpointIdentity(
        wallet_id="feedface",
        stage=0,
        model_fingerprint=stage_fingerprint(trained.model.config, 1),
        tokenizer_sha256=published.dataset.manifest.tokenizer.sha256,
    )
    state = load_checkpoint(trained.checkpoint_file, identity)
    assert state is not None
    assert all(t.device == CPU and t.dtype == torch.float32 for t in state["model"].values())
    resumed = _trainer(published, tmp_path, Placement.cpu(), max_steps=12)
    assert resumed.diloco.step == 8
    assert resumed.diloco.weights_hash() == trained.diloco.weights_hash()
    for a, b in zip(resumed.model.parameters(), trained.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert resumed.run(threading.Event()).steps == 12


@needs_cuda
def test_a_cuda_trainer_checkpoint_loads_on_the_cpu(published, tmp_path: Path) -> None:
    trained = _trainer(published, tmp_path, resolve("cuda", "bf16"), max_steps=8)
    trained.run(threading.Event())
    resumed = _trainer(published, tmp_path, Placement.cpu(), max_steps=12)
    assert resumed.diloco.weights_hash() == trained.diloco.weights_hash()
    assert resumed.batches.position == trained.batches.position
    assert resumed.run(threading.Event()).steps == 12


def test_a_background_round_line_hashes_the_rounds_theta_even_when_hashing_is_slow(
    published, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """The round line's thread reads θ_round itself, not a copy: a hash slower than a whole round
    must still name the θ its round ended with (the next round's hook waits for it)."""
    from neuroshard.node import trainer as trainer_module

    def slow_digest(vector: Tensor) -> str:
        time.sleep(0.2)  # longer than the next round's six tiny steps
        return tensor_digest(vector)

    monkeypatch.setattr(trainer_module, "tensor_digest", slow_digest)
    thetas: list[Tensor] = []

    def finish(diloco: DiLoCo) -> None:  # a round hook that never hashes θ itself
        diloco.outer_step(diloco.pseudo_gradient())  # in place on the CPU
        thetas.append(diloco.theta_round.detach().clone())

    lines: list[str] = []
    trainer = _trainer(
        published, tmp_path, resolve("cpu", "fp32"), max_steps=18, log=lines.append, finish_round=finish
    )
    trainer.hash_in_background = True
    trainer.run(threading.Event())
    logged = [re.fullmatch(r"round=(\d+) done; θ hash (\w+)", line) for line in lines]
    hashes = [(int(m[1]), m[2]) for m in logged if m is not None]
    assert len(thetas) >= 3
    assert hashes == [(r + 1, tensor_digest(theta)[:16]) for r, theta in enumerate(thetas)]


@needs_cuda
def test_a_cuda_lone_replica_logs_each_rounds_hash_in_round_order(published, tmp_path: Path) -> None:
    """On an accelerator a lone replica hashes θ for its round line on a background thread
    (Trainer._log_round_done); by the time run() returns every line is there, in round order,
    naming the θ that round ended with."""
    thetas: list[Tensor] = []

    def finish(diloco: DiLoCo) -> None:  # a round hook that never hashes θ itself
        diloco.outer_step(diloco.pseudo_gradient())
        thetas.append(diloco.theta_round.detach().clone())

    lines: list[str] = []
    trainer = _trainer(
        published, tmp_path, resolve("cuda", "bf16"), max_steps=18, log=lines.append, finish_round=finish
    )
    trainer.run(threading.Event())
    logged = [re.fullmatch(r"round=(\d+) done; θ hash (\w+)", line) for line in lines]
    hashes = [(int(m[1]), m[2]) for m in logged if m is not None]
    assert hashes == [(r + 1, tensor_digest(theta)[:16]) for r, theta in enumerate(thetas)]
    assert len(hashes) == 3


def test_the_look_ahead_feed_trains_on_and_records_exactly_the_same_batches(
    published, tmp_path: Path
) -> None:
    """On CUDA the trainer reads the next batch while a step computes; handing it back at round
    ends, checkpoints and plateau rotations must leave spans, losses and positions unchanged."""
    runs = []
    for ahead in (False, True):
        lines: list[str] = []
        work = RoundWork()
        spans: list[list[tuple[int, int, int]]] = []

        def finish(diloco: DiLoCo, work: RoundWork = work, spans: list = spans) -> None:  # type: ignore[type-arg]
            spans.append(list(work.spans))
            diloco.outer_step(diloco.pseudo_gradient())

        trainer = _trainer(
            published,
            tmp_path / str(ahead),
            Placement.cpu(),
            max_steps=30,
            rotation=RotationConfig(min_steps=4, window=2, z=10.0),
            log=lines.append,
            work=work,
            finish_round=finish,
        )
        trainer.lookahead = ahead
        result = trainer.run(threading.Event())
        rotations = sum("rotating to the next shard" in line for line in lines)
        runs.append(
            (result.losses, spans, trainer.batches.position, trainer.diloco.weights_hash(), rotations)
        )
    assert runs[0] == runs[1]
    assert runs[0][4] >= 2  # the plateau test rotated: a look-ahead batch was handed back


NODE = str(Path(sys.executable).parent / "neuroshard-node")
LOSS = re.compile(r"step=(\d+) round=(\d+) loss=([0-9.]+)")


def _node(published, home: Path, *extra: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    args = [
        NODE, "--home", str(home), "--data", str(published.directory),
        "--publisher-key", published.public_key_hex, "--batch-size", "4", "--seq-len", "64",
        "--inner-steps", "20", "--threads", "1", "--token", "device-test-token", "--verifier-port", str(free_port()), *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "NEUROSHARD_TOKEN"}
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_neuroshard_node_device_cpu_precision_bf16_trains_with_falling_loss(
    published, tmp_path: Path
) -> None:
    out = _node(
        published, tmp_path, "--device", "cpu", "--precision", "bf16", "--max-steps", "80", "--no-verifier"
    )
    assert out.returncode == 0, out.stderr
    assert "inner loop on cpu, bf16 autocast, fp32 master weights" in out.stdout
    losses = [float(loss) for _, _, loss in LOSS.findall(out.stdout)]
    assert len(losses) == 8 and sum(losses[-3:]) / 3 < losses[0] - 0.5, losses


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_neuroshard_node_device_cuda_without_a_gpu_gives_one_line(published, tmp_path: Path) -> None:
    out = _node(published, tmp_path, "--device", "cuda", "--max-steps", "1", "--no-verifier")
    assert out.returncode == 2
    assert "sees no CUDA device" in out.stderr and "Traceback" not in out.stderr


def test_a_checkpoint_turn_is_skipped_while_the_previous_write_is_in_flight(
    published, tmp_path: Path
) -> None:
    """The loop never waits on the disk: while a write is in flight, periodic and round-end
    checkpoints skip their turn (logged once); the final checkpoint waits and holds the last step."""
    lines: list[str] = []
    trainer = _trainer(published, tmp_path, Placement.cpu(), max_steps=12, log=lines.append)
    released = threading.Event()
    writes: list[int] = []
    write = trainer._writer._write

    def slow_write(path, identity, state) -> None:  # type: ignore[no-untyped-def]
        writes.append(state["diloco"]["step"])
        if len(writes) == 1:
            released.wait(timeout=60)  # the first background write stays in flight
        write(path, identity, state)

    trainer._writer._write = slow_write  # type: ignore[method-assign]
    stop = threading.Event()
    done = threading.Thread(target=lambda: trainer.run(stop))
    done.start()
    try:
        deadline = time.monotonic() + 60
        while trainer.diloco.step < 12 and done.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert trainer.diloco.step == 12, "the loop waited on the disk"
        assert trainer.checkpoints_skipped > 0
        assert sum("skipped: the previous write is still in flight" in line for line in lines) == 1
    finally:
        released.set()
        done.join(timeout=60)
    assert writes[0] < 12 and writes[-1] == 12  # the final write waited for the slow one, then ran
    state = load_checkpoint(
        trainer.checkpoint_file,
        CheckpointIdentity(
            wallet_id="feedface",
            stage=0,
            model_fingerprint=stage_fingerprint(trainer.model.config, 1),
            tokenizer_sha256=published.dataset.manifest.tokenizer.sha256,
        ),
    )
    assert state is not None and state["diloco"]["step"] == 12


@needs_cuda
def test_an_inner_state_captured_on_the_cpu_installs_on_a_cuda_engine() -> None:
    cpu = DiLoCo(Transformer(MODEL), DILOCO)
    for step in range(3):
        cpu.inner_step(*batch(0, step))
    inner = capture_inner_state(cpu)
    assert inner is not None
    cuda = DiLoCo(Transformer(MODEL), DILOCO, placement=resolve("cuda", "bf16"))
    install_inner_state(cuda, inner)
    assert all(
        t.device == cuda.placement.device
        for s in cuda.inner_optimizer.state.values()
        for t in s.values()
        if isinstance(t, Tensor)
    )
    cuda.inner_step(*batch(0, 3))  # fused AdamW on CUDA steps with the installed moments


def _steps_written(trainer: Trainer) -> list[int]:
    """Run the trainer with a checkpoint turn every 2 steps and a 1-hour interval; the inner step
    of every checkpoint it wrote."""
    trainer.config = dataclasses.replace(trainer.config, checkpoint_every=2, checkpoint_interval_s=3600.0)
    writes: list[int] = []
    write = trainer._writer._write

    def counted(path, identity, state) -> None:  # type: ignore[no-untyped-def]
        writes.append(state["diloco"]["step"])
        write(path, identity, state)

    trainer._writer._write = counted  # type: ignore[method-assign]
    trainer.run(threading.Event())
    return writes


@pytest.mark.parametrize(
    ("older", "fresh", "written"),
    [
        # The interval counts from the start, so every periodic and round-end turn falls within
        # it; the final checkpoint is written.
        (False, False, [12]),
        (True, False, [12]),  # resumed from the older file: it is the state the run starts from
        # A restart must not resume the run a fresh one replaced: its first turn writes at once.
        (True, True, [2, 12]),
    ],
    ids=["new", "resumed", "fresh-over-older"],
)
def test_checkpoints_within_the_interval_are_passed_over_and_the_final_one_is_written(
    published, tmp_path: Path, older: bool, fresh: bool, written: list[int]
) -> None:
    if older:
        _trainer(published, tmp_path, Placement.cpu(), max_steps=4).run(threading.Event())
    trainer = _trainer(published, tmp_path, Placement.cpu(), max_steps=12, fresh=fresh)
    assert _steps_written(trainer) == written


def test_a_pipeline_driver_that_records_segments_writes_every_round_s_end(published, tmp_path: Path) -> None:
    """A round whose segment log is committed must not be trained again after a restart (the
    headers it signs would name a round whose log cannot list them: node.segments), so a pipeline
    driver that records segments writes every round's end checkpoint, whatever the interval."""
    from neuroshard.node.segments import SegmentConfig, SegmentRecorder

    trainer = _trainer(
        published, tmp_path, Placement.cpu(), max_steps=12, num_stages=2,
        loss_fn=lambda out, labels: out.float().pow(2).mean(),
        segments=SegmentRecorder(SegmentConfig(segment_steps=3), stage=0),
    )  # fmt: skip
    assert _steps_written(trainer) == [6, 12, 12]  # both rounds' ends (H = 6), then the final one


def test_the_checkpoint_interval_defaults_to_every_turn_on_the_cpu() -> None:
    assert checkpoint_interval(build_parser().parse_args([]), Placement.cpu()) == 0.0
    chosen = build_parser().parse_args(["--checkpoint-interval", "30"])
    assert checkpoint_interval(chosen, Placement.cpu()) == 30.0
