"""Growing the vocabulary keeps every old row and all optimizer state; new rows are deterministic."""

import torch

from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, Transformer
from neuroshard.node.vocab import grow_replica

CONFIG = ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16)
DILOCO = DiLoCoConfig(inner_steps=3, warmup_steps=0, total_steps=100)


def _trained() -> tuple[Transformer, DiLoCo]:
    model = Transformer(CONFIG)
    diloco = DiLoCo(model, DILOCO)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        for _ in range(3):
            x = torch.randint(0, 300, (2, 16), generator=gen)
            diloco.inner_step(x, torch.roll(x, -1, 1))
        diloco.outer_step(diloco.pseudo_gradient())
    return model, diloco


def test_old_rows_and_state_survive_and_new_rows_are_fresh_and_deterministic() -> None:
    model, diloco = _trained()
    grown, g = grow_replica(model, diloco, 340)
    assert grown.config.vocab_size == 340 and grown.embedding is not None and grown.head is not None
    assert torch.equal(grown.embedding.weight[:300], model.embedding.weight)  # type: ignore[union-attr]
    assert torch.equal(grown.head.weight[:300], model.head.weight)  # type: ignore[union-attr]
    fresh = Transformer(grown.config)
    assert torch.equal(grown.embedding.weight[300:], fresh.embedding.weight[300:])  # type: ignore[union-attr]
    assert torch.equal(g.theta_round, torch.nn.utils.parameters_to_vector(grown.parameters()))
    assert (g.step, g.round, g.current_lr) == (diloco.step, diloco.round, diloco.current_lr)
    old_m = diloco.outer_optimizer.state[diloco.theta_round]["momentum_buffer"]
    new_m = g.outer_optimizer.state[g.theta_round]["momentum_buffer"]
    assert new_m.numel() == g.theta_round.numel() and torch.equal(new_m[: 300 * 32], old_m[: 300 * 32])
    assert torch.count_nonzero(new_m[300 * 32 : 340 * 32]) == 0
    adam = g.inner_optimizer.state[grown.head.weight]  # type: ignore[union-attr]
    assert torch.count_nonzero(adam["exp_avg"][300:]) == 0 and torch.count_nonzero(adam["exp_avg"][:300]) > 0


def test_old_ids_predict_exactly_as_before_growth() -> None:
    model, diloco = _trained()
    grown, _ = grow_replica(model, diloco, 340)
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert torch.allclose(grown(x)[..., :300], model(x), atol=0, rtol=0)


def test_grown_replica_keeps_training() -> None:
    model, diloco = _trained()
    _, g = grow_replica(model, diloco, 340)
    x = torch.randint(0, 340, (2, 16))
    loss = g.inner_step(x, torch.roll(x, -1, 1))
    assert torch.isfinite(torch.tensor(loss))
    g.outer_step(g.pseudo_gradient())
    assert g.round == diloco.round + 1
