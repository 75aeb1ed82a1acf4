import pytest
import torch
from conftest import PublishedData

from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.verifier.evaluate import (
    build_from_state_dicts,
    evaluate_model,
    held_out_batches,
    measure_loss,
    measure_state_dicts,
    stage_hash,
)

CONFIG = ModelConfig(vocab_size=512, dim=32, n_layers=2, n_heads=2, ffn_dim=96, max_seq_len=64)


def held_out(published: PublishedData) -> torch.Tensor:
    # The last shard stands in for a held-out shard no node trains on.
    manifest = published.dataset.manifest
    return published.dataset.source.fetch(manifest.shard(manifest.total_shards - 1))


def test_batches_are_consecutive_windows() -> None:
    tokens = torch.arange(100, dtype=torch.int32)
    batches = list(held_out_batches(tokens, batch=2, seq=10))
    assert len(batches) == 4  # 9 windows of 10+1 tokens at stride 10 → 4 full batches of 2
    inputs, labels = batches[1]
    assert inputs.dtype == torch.long and inputs.shape == (2, 10)
    assert inputs[0].tolist() == list(range(20, 30))
    assert labels[0].tolist() == list(range(21, 31))
    assert len(list(held_out_batches(tokens, batch=2, seq=10, max_batches=1))) == 1
    with pytest.raises(ValueError, match="one batch needs 50"):
        list(held_out_batches(tokens, batch=50, seq=10))


def test_a_fresh_model_scores_about_log_vocab() -> None:
    tokens = torch.randint(0, 512, (2000,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    m = measure_loss(build_stage(CONFIG, 0, 1), tokens, batch=4, seq=32)
    assert m.loss == pytest.approx(torch.log(torch.tensor(512.0)).item(), abs=0.1)
    assert m.tokens == m.batches * 4 * 32
    assert m.stderr is not None and m.stderr > 0


def test_training_lowers_the_measured_held_out_loss(published: PublishedData) -> None:
    ds = published.dataset
    config = ModelConfig(**{**CONFIG.to_dict(), "vocab_size": ds.tokenizer.vocab_size})
    model = build_stage(config, 0, 1)
    test_tokens = held_out(published)
    before = evaluate_model(model, test_tokens, batch=4, seq=32)
    train = ds.source.fetch(ds.manifest.shard(0))
    diloco = DiLoCo(model, DiLoCoConfig(inner_steps=30, warmup_steps=0, total_steps=100, inner_lr=1e-2))
    for inputs, labels in held_out_batches(train, batch=8, seq=32, max_batches=30):
        diloco.inner_step(inputs, labels)
    after = evaluate_model(model, test_tokens, batch=4, seq=32)
    assert after < before - 0.2
    assert model.training  # evaluation restores the mode it found


def test_stages_in_order_equal_the_whole_model() -> None:
    tokens = torch.randint(0, 512, (1000,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    whole = measure_loss(build_stage(CONFIG, 0, 1), tokens, batch=2, seq=16).loss
    split = measure_loss([build_stage(CONFIG, 0, 2), build_stage(CONFIG, 1, 2)], tokens, batch=2, seq=16).loss
    assert split == pytest.approx(whole, rel=1e-5)


def test_state_dicts_are_checked_against_the_majority_hash() -> None:
    stages = [build_stage(CONFIG, s, 2) for s in range(2)]
    with torch.no_grad():
        stages[1].head.weight.mul_(0.5)  # type: ignore[union-attr]
    states = [s.state_dict() for s in stages]
    hashes = [stage_hash(s) for s in stages]
    rebuilt = build_from_state_dicts(CONFIG, states, hashes)
    assert [stage_hash(s) for s in rebuilt] == hashes
    tokens = torch.randint(0, 512, (1000,), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    assert measure_state_dicts(CONFIG, states, tokens, 2, 16, expected_hashes=hashes).loss == pytest.approx(
        measure_loss(stages, tokens, 2, 16).loss
    )
    with pytest.raises(ValueError, match="stage 1: weights hash"):
        build_from_state_dicts(CONFIG, states, [hashes[0], hashes[0]])
