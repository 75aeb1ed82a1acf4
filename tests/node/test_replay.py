"""What a replica keeps for replay spot checks: the inner state at each round's start, committed
in the receipt, and the round's θ_round and Δ, for the last few rounds."""

import hashlib
from typing import Any

import pytest
import torch

from neuroshard.node.diloco import DiLoCo, DiLoCoConfig, tensor_digest
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.p2p.rounds import RoundReport
from neuroshard.node.receipt import Receipting
from neuroshard.node.replay import ReplayArchive, ReplayRecord, capture_inner_state, install_inner_state
from neuroshard.node.work import RoundWork

MODEL = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, ffn_dim=32, max_seq_len=16)
H, B, T = 3, 2, 8


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (B, T + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def _engine() -> DiLoCo:
    torch.manual_seed(0)
    return DiLoCo(build_stage(MODEL, 0, 1), DiLoCoConfig(inner_steps=H, warmup_steps=2, total_steps=50))


def test_inner_state_round_trips_and_a_fresh_optimizer_is_zeros() -> None:
    diloco = _engine()
    fresh = capture_inner_state(diloco)
    assert fresh is not None and not fresh.steps.any() and not fresh.exp_avg.any()
    for step in range(2):
        diloco.inner_step(*_batch(step))
    state = capture_inner_state(diloco)
    assert state is not None and state.digest() != fresh.digest()
    assert state.steps.tolist() == [2.0] * len(diloco.params)

    other = _engine()
    install_inner_state(other, state)
    copied = capture_inner_state(other)
    assert copied is not None and copied.digest() == state.digest()
    other.inner_step(*_batch(5))
    assert capture_inner_state(other).digest() != state.digest()  # type: ignore[union-attr]
    assert torch.equal(state.exp_avg, copied.exp_avg)  # installing copied: `state` was not stepped on
    with pytest.raises(ValueError, match="step counts"):
        install_inner_state(other, type(state)(state.exp_avg, state.exp_avg_sq, state.steps[:1]))


def test_an_optimizer_that_is_not_adamw_cannot_be_captured() -> None:
    diloco = DiLoCo(
        build_stage(MODEL, 0, 1),
        DiLoCoConfig(inner_steps=H),
        inner_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    )
    diloco.inner_step(*_batch(0))
    assert capture_inner_state(diloco) is None


def test_the_archive_keeps_the_last_rounds() -> None:
    archive = ReplayArchive(keep_rounds=2)
    state = capture_inner_state(_engine())
    assert state is not None
    for r in range(4):
        archive.add(ReplayRecord(round=r, theta_round=torch.zeros(1), inner=state, delta=torch.zeros(1)))
    assert archive.rounds() == [2, 3] and archive.get(1) is None and archive.get(3) is not None


def _report(round_: int) -> RoundReport:
    return RoundReport(
        stage=0, round=round_, accepted=(), rejected=(), equivocators=(), late=False, next_round=round_ + 1,
        theta_hash=hashlib.sha256(b"x").hexdigest(), agree=1, voters=1, resynced_from=None, seconds=0.0,
    )  # fmt: skip


def test_receipts_commit_to_the_inner_state_the_round_started_from() -> None:
    diloco = _engine()
    work, reports, sent = RoundWork(), [], []  # type: ignore[var-annotated]
    archive = ReplayArchive(keep_rounds=4)

    def finish(engine: DiLoCo) -> None:
        reports.append(_report(engine.round))
        engine.outer_step(engine.pseudo_gradient())

    receipting = Receipting(
        finish,
        reports,
        work,
        sent.append,
        batch_size=B,
        tokens_per_step=B * T,
        log=lambda line: None,
        archive=archive,
    )
    receipting.round_started(diloco)
    starts: list[Any] = []
    for round_ in range(2):
        starts.append((capture_inner_state(diloco), diloco.theta_round.detach().clone()))
        for step in range(H):
            diloco.inner_step(*_batch(10 * round_ + step))
            work.read(1, step * B, (step + 1) * B)
        delta = diloco.pseudo_gradient()
        receipting(diloco)
        work.clear()
        doc, record = sent[-1], archive.get(round_)
        assert record is not None
        assert doc.inner_state_digest == starts[round_][0].digest() == record.inner.digest()
        assert doc.base_hash == tensor_digest(starts[round_][1]) == tensor_digest(record.theta_round)
        assert doc.delta_digest == tensor_digest(delta) == tensor_digest(record.delta)
        assert doc.start_step == round_ * H  # the schedule's position, a function of the round
    assert starts[1][0].digest() != starts[0][0].digest()  # round 1 starts from round 0's moments


def test_a_bf16_replicas_round_passes_the_verifiers_fp32_replay_and_its_lies_do_not() -> None:
    """Cross-precision replay (issue 14): a replica training with bf16 autocast commits the state a
    CPU fp32 replay starts from; its honest Δ passes the cross-precision tolerance, the lies the
    replay exists for fail it, and a same-precision receipt keeps the strict one."""
    from neuroshard.node.device import Placement
    from neuroshard.verifier.replaycheck import ReplayCheckConfig, tolerance_for
    from neuroshard.verifier.spotcheck import compare_deltas, replay_inner_steps

    config = DiLoCoConfig(inner_steps=8, warmup_steps=2, total_steps=50)
    bf16 = Placement(device=torch.device("cpu"), precision="bf16")
    node = DiLoCo(build_stage(MODEL, 0, 1), config, placement=bf16)
    for step in range(8):  # round 0: the moments the replay must start from
        node.inner_step(*_batch(step))
    node.outer_step(node.pseudo_gradient())
    theta, inner = node.theta_round.detach().clone(), capture_inner_state(node)
    assert inner is not None
    batches = [_batch(100 + k) for k in range(8)]
    for x, y in batches:
        node.inner_step(x, y)
    honest = node.pseudo_gradient()
    replayed = replay_inner_steps(MODEL, config, theta, batches, round_=1, inner_state=inner)
    cfg = ReplayCheckConfig()
    cross = tolerance_for("cpu", "bf16", cfg)
    assert tolerance_for(None, None, cfg) == tolerance_for("cpu", "fp32", cfg) == cfg.tolerance
    assert tolerance_for("cuda", "fp32", cfg) == cross  # TF32 matmuls: not an exact replay
    # short segments are held tighter whatever the precision; long ones like whole rounds
    assert tolerance_for("cuda", "bf16", cfg, segment_steps=12) == cfg.segment
    assert tolerance_for("cpu", "fp32", cfg, segment_steps=12) == cfg.segment
    assert tolerance_for("cuda", "bf16", cfg, segment_steps=500) == cross
    assert cfg.segment.norm_tolerance < cross.norm_tolerance and cfg.segment.min_cosine > cross.min_cosine
    assert not torch.equal(honest, replayed)
    assert compare_deltas(honest, replayed, cross).ok
    elsewhere = replay_inner_steps(
        MODEL, config, theta, [_batch(200 + k) for k in range(8)], round_=1, inner_state=inner
    )
    skipped = replay_inner_steps(MODEL, config, theta, batches[:6], round_=1, inner_state=inner)
    for lie in (
        1.25 * honest,
        elsewhere,
        skipped,
        torch.randn(honest.shape) * honest.norm() / honest.numel() ** 0.5,
    ):
        assert not compare_deltas(lie, replayed, cross).ok
