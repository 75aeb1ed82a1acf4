"""Spot checks: an honest replica's Δ replays exactly; a lying Δ or one trained on other data fails."""

import copy
from dataclasses import dataclass

import pytest
import torch
from conftest import PublishedData

from neuroshard.data import BatchStream, assign_shards
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.replay import InnerState, capture_inner_state
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.reports import DataSpan
from neuroshard.verifier.spotcheck import (
    SpotCheckError,
    check_data_spans,
    claimed_batches,
    compare_deltas,
    replay_inner_steps,
)

B, T, H = 4, 32, 4
DILOCO = DiLoCoConfig(inner_steps=H, warmup_steps=2, total_steps=100)
WALLET = Wallet.from_token("spot-check").wallet_id


def model_config(published: PublishedData) -> ModelConfig:
    return ModelConfig(
        vocab_size=published.dataset.tokenizer.vocab_size,
        dim=64,
        n_layers=2,
        n_heads=2,
        ffn_dim=176,
        max_seq_len=64,
    )


@dataclass
class Round:
    """What a replica knows at the end of its second round, and what its receipt claims."""

    theta_round: torch.Tensor
    round: int
    inner_state: InnerState
    spans: list[DataSpan]
    delta: torch.Tensor


def train_two_rounds(published: PublishedData, order: list[int]) -> Round:
    """A lone replica exactly as the node trains: BatchStream over `order`, DiLoCo, outer step after round 0."""
    ds = published.dataset
    diloco = DiLoCo(build_stage(model_config(published), 0, 1), DILOCO)
    stream = BatchStream(
        source=ds.source, manifest=ds.manifest, order=order, seed=WALLET, batch_size=B, seq_len=T
    )
    for _ in range(H):
        diloco.inner_step(*stream.next_batch())
    diloco.outer_step(diloco.pseudo_gradient())
    theta = diloco.theta_round.detach().clone()
    state = capture_inner_state(diloco)
    assert state is not None
    position = copy.copy(stream.position)
    for _ in range(H):
        diloco.inner_step(*stream.next_batch())
    assigned = assign_shards(WALLET, ds.manifest)  # what the receipt claims: the assigned data
    span = DataSpan(
        shard_id=assigned[position.order_index],
        offset_start=position.offset,
        offset_end=position.offset + H * B,
    )
    return Round(theta, diloco.round, state, [span], diloco.pseudo_gradient())


def replay(published: PublishedData, claim: Round) -> torch.Tensor:
    ds = published.dataset
    batches = claimed_batches(
        source=ds.source, manifest=ds.manifest, wallet_id=WALLET, spans=claim.spans, batch_size=B, seq_len=T
    )
    assert len(batches) == H
    return replay_inner_steps(
        model_config(published),
        DILOCO,
        claim.theta_round,
        batches,
        round_=claim.round,
        inner_state=claim.inner_state,
    )


@pytest.fixture(scope="module")
def honest(published: PublishedData) -> Round:
    return train_two_rounds(published, assign_shards(WALLET, published.dataset.manifest))


def test_honest_replica_passes(published: PublishedData, honest: Round) -> None:
    result = compare_deltas(honest.delta, replay(published, honest))
    assert result.ok, result.reason
    assert result.cosine > 0.999999
    assert result.norm_ratio == pytest.approx(1.0, abs=1e-6)


def test_replay_does_not_consume_the_given_optimizer_state(published: PublishedData, honest: Round) -> None:
    assert torch.equal(replay(published, honest), replay(published, honest))


def test_honest_replay_at_another_thread_count(published: PublishedData, honest: Round) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = compare_deltas(honest.delta, replay(published, honest))
    finally:
        torch.set_num_threads(threads)
    assert result.ok, result.reason


def test_a_made_up_delta_fails(published: PublishedData, honest: Round) -> None:
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(honest.delta.shape, generator=gen)
    fake = noise * (honest.delta.norm() / noise.norm())
    result = compare_deltas(fake, replay(published, honest))
    assert not result.ok
    assert abs(result.cosine) < 0.1
    assert "cosine" in result.reason


def test_a_scaled_delta_fails_on_its_norm(published: PublishedData, honest: Round) -> None:
    result = compare_deltas(1.5 * honest.delta, replay(published, honest))
    assert not result.ok
    assert result.cosine > 0.999
    assert "norm ratio 1.5" in result.reason


def test_training_on_unassigned_data_fails(published: PublishedData) -> None:
    assigned = assign_shards(WALLET, published.dataset.manifest)
    cheat = train_two_rounds(published, assigned[1:] + assigned[:1])  # reads other shards, claims its own
    result = compare_deltas(cheat.delta, replay(published, cheat))
    assert not result.ok
    assert result.cosine < 0.9


def test_replay_without_the_inner_optimizer_state_is_not_exact(
    published: PublishedData, honest: Round
) -> None:
    ds = published.dataset
    batches = claimed_batches(
        source=ds.source, manifest=ds.manifest, wallet_id=WALLET, spans=honest.spans, batch_size=B, seq_len=T
    )
    replayed = replay_inner_steps(
        model_config(published), DILOCO, honest.theta_round, batches, round_=honest.round
    )
    assert not compare_deltas(honest.delta, replayed).ok  # why nodes must ship their AdamW moments


def test_span_past_the_end_of_the_shard_cannot_be_replayed(published: PublishedData) -> None:
    ds = published.dataset
    info = ds.manifest.shard(0)
    windows = (info.tokens - 1) // T
    span = DataSpan(shard_id=0, offset_start=windows - windows % B, offset_end=windows - windows % B + B)
    with pytest.raises(SpotCheckError, match="past the shard's last batch"):
        claimed_batches(
            source=ds.source, manifest=ds.manifest, wallet_id=WALLET, spans=[span], batch_size=B, seq_len=T
        )


def test_theta_of_the_wrong_size_is_refused(published: PublishedData) -> None:
    with pytest.raises(SpotCheckError, match="θ_round has shape"):
        replay_inner_steps(model_config(published), DILOCO, torch.zeros(7), [])


def test_compare_deltas_shape_and_non_finite() -> None:
    assert not compare_deltas(torch.zeros(3), torch.ones(4)).ok
    assert not compare_deltas(torch.tensor([float("nan"), 1.0]), torch.ones(2)).ok
    assert compare_deltas(torch.zeros(2), torch.zeros(2)).ok


def test_check_data_spans() -> None:
    order = [3, 0, 2, 1]
    ok = [
        DataSpan(shard_id=3, offset_start=40, offset_end=48),
        DataSpan(shard_id=0, offset_start=0, offset_end=8),
    ]
    assert check_data_spans(order, ok, batch_size=4, inner_steps=4) == []
    skipped = [
        DataSpan(shard_id=3, offset_start=40, offset_end=48),
        DataSpan(shard_id=2, offset_start=0, offset_end=8),
    ]
    assert any(
        "does not follow shard 3" in p for p in check_data_spans(order, skipped, batch_size=4, inner_steps=4)
    )
    ragged = [DataSpan(shard_id=3, offset_start=0, offset_end=6)]
    problems = check_data_spans(order, ragged, batch_size=4, inner_steps=4)
    assert any("not whole batches" in p for p in problems)
    assert any("need 16" in p for p in problems)
    assert check_data_spans(
        order, [DataSpan(shard_id=9, offset_start=0, offset_end=16)], batch_size=4, inner_steps=4
    ) == ["span 0: shard 9 is not in the manifest"]
