import pytest
import torch

from neuroshard.node.model import (
    MODEL_SIZES,
    ModelConfig,
    Transformer,
    apply_rope,
    build_stage,
    cross_entropy_loss,
    estimate_memory,
    param_seed,
    rope_tables,
    stage_layers,
)

# sha256 of {"dim":128,"ffn_dim":352,"init_seed":0,"max_seq_len":256,"n_heads":4,"n_layers":4,
# "norm_eps":1e-05,"rope_theta":10000.0,"vocab_size":4096}
PINNED_TINY_4096_FINGERPRINT = "6604d6396e8d31277dfb32924661057835cf40ac37aa6afcaaf873e2024f4bb3"


def small_config(**overrides: object) -> ModelConfig:
    fields: dict[str, object] = {
        "vocab_size": 97,
        "dim": 32,
        "n_layers": 4,
        "n_heads": 4,
        "ffn_dim": 64,
        "max_seq_len": 16,
    }
    return ModelConfig(**{**fields, **overrides})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("size", "low", "high"), [("tiny", 1_000_000, 3_000_000), ("small", 20_000_000, 40_000_000)]
)
def test_named_sizes_have_the_stated_parameter_counts(size: str, low: int, high: int) -> None:
    config = ModelConfig.named(size, vocab_size=4096)
    model = Transformer(config)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == config.num_params()
    assert low <= counted <= high


def test_named_applies_overrides_and_rejects_unknown_size() -> None:
    config = ModelConfig.named("tiny", vocab_size=300, n_layers=2, init_seed=7)
    assert (config.vocab_size, config.n_layers, config.init_seed) == (300, 2, 7)
    assert config.dim == MODEL_SIZES["tiny"]["dim"]
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        ModelConfig.named("huge", vocab_size=300)


def test_stage_parameter_count_matches_num_params() -> None:
    config = small_config()
    for stage in range(3):
        model = build_stage(config, stage, 3)
        expected = config.num_params(layers=model.layer_range, embedding=stage == 0, head=stage == 2)
        assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dim": 30, "n_heads": 4}, r"dim \(30\) must be divisible by n_heads \(4\)"),
        ({"dim": 12, "n_heads": 4}, r"head_dim = dim / n_heads = 12 / 4 = 3 must be even"),
        ({"n_layers": 0}, r"n_layers must be a positive int, got 0"),
        ({"vocab_size": -5}, r"vocab_size must be a positive int, got -5"),
        ({"ffn_dim": 64.0}, r"ffn_dim must be a positive int, got 64.0"),
        ({"rope_theta": 0.0}, r"rope_theta must be > 0"),
        ({"norm_eps": -1e-5}, r"norm_eps must be > 0"),
    ],
)
def test_config_validation_names_the_numbers(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


def test_fingerprint_is_pinned_and_changes_with_any_field() -> None:
    config = ModelConfig.named("tiny", vocab_size=4096)
    # Pinned: a change of the canonical form would orphan every existing checkpoint.
    assert config.fingerprint() == ModelConfig.named("tiny", vocab_size=4096).fingerprint()
    assert config.fingerprint() == PINNED_TINY_4096_FINGERPRINT
    assert ModelConfig.named("tiny", vocab_size=4097).fingerprint() != config.fingerprint()
    for change in ({"init_seed": 1}, {"rope_theta": 500000.0}, {"norm_eps": 1e-6}, {"n_layers": 5}):
        assert ModelConfig.named("tiny", vocab_size=4096, **change).fingerprint() != config.fingerprint()


def test_dict_round_trip_and_unknown_fields() -> None:
    config = small_config(init_seed=3)
    assert ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"unknown ModelConfig fields \['dropout'\]"):
        ModelConfig.from_dict({**config.to_dict(), "dropout": 0.1})


def test_init_is_deterministic_and_depends_on_the_seed() -> None:
    a = Transformer(small_config()).state_dict()
    b = Transformer(small_config()).state_dict()
    c = Transformer(small_config(init_seed=1)).state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(not torch.equal(a[k], c[k]) for k in a if not k.endswith("norm.weight"))


def test_init_statistics() -> None:
    config = ModelConfig.named("tiny", vocab_size=4096)
    params = dict(Transformer(config).named_parameters())
    assert torch.equal(params["layers.0.attn_norm.weight"], torch.ones(config.dim))
    assert params["embedding.weight"].std().item() == pytest.approx(0.02, rel=0.02)
    residual = 0.02 / (2 * config.n_layers) ** 0.5
    assert params["layers.1.mlp.down.weight"].std().item() == pytest.approx(residual, rel=0.05)
    assert params["layers.1.attn.proj.weight"].std().item() == pytest.approx(residual, rel=0.05)
    assert params["layers.1.attn.qkv.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    # Each parameter has its own stream: two same-shape matrices are not copies of each other.
    assert not torch.equal(params["layers.0.mlp.gate.weight"], params["layers.0.mlp.up.weight"])


def test_param_seed_is_stable() -> None:
    assert param_seed(0, "embedding.weight") == param_seed(0, "embedding.weight")
    assert param_seed(0, "embedding.weight") != param_seed(1, "embedding.weight")
    assert 0 <= param_seed(12345, "head.weight") < 2**63


@pytest.mark.parametrize(
    ("n_layers", "num_stages", "expected"),
    [
        (4, 2, [range(0, 2), range(2, 4)]),
        (4, 4, [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]),
        (7, 3, [range(0, 3), range(3, 5), range(5, 7)]),
        (5, 1, [range(0, 5)]),
    ],
)
def test_stage_layers_are_contiguous_and_near_equal(
    n_layers: int, num_stages: int, expected: list[range]
) -> None:
    assert [stage_layers(n_layers, s, num_stages) for s in range(num_stages)] == expected


def test_stage_layers_rejects_bad_stagings() -> None:
    with pytest.raises(ValueError, match=r"num_stages \(5\) must be between 1 and n_layers \(4\)"):
        stage_layers(4, 0, 5)
    with pytest.raises(ValueError, match=r"stage \(2\) must be in range\(0, 2\)"):
        stage_layers(4, 2, 2)
    with pytest.raises(ValueError, match="contiguous range"):
        Transformer(small_config(), layers=range(0, 4, 2))
    with pytest.raises(ValueError, match="contiguous range"):
        Transformer(small_config(), layers=range(2, 6))


@pytest.mark.parametrize("num_stages", [2, 4])
def test_chained_stages_equal_the_full_model(num_stages: int) -> None:
    config = ModelConfig.named("tiny", vocab_size=4096, max_seq_len=32)
    full = Transformer(config)
    full_state = full.state_dict()
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    x: torch.Tensor = tokens
    with torch.no_grad():
        for stage in range(num_stages):
            model = build_stage(config, stage, num_stages)
            assert (model.embedding is not None, model.head is not None) == (
                stage == 0,
                stage == num_stages - 1,
            )
            for name, value in model.state_dict().items():
                assert torch.equal(value, full_state[name]), name
            x = model(x)
            if stage < num_stages - 1:
                assert x.shape == (2, 32, config.dim)
        expected = full(tokens)
    assert x.shape == (2, 32, config.vocab_size)
    torch.testing.assert_close(x, expected, atol=1e-6, rtol=0)


def test_attention_is_causal() -> None:
    model = Transformer(small_config())
    tokens = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 97
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], atol=0, rtol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_positions_matter() -> None:
    # In one causal layer without positional information the last position attends to the same
    # set of (key, value) pairs whatever their order; rotary embeddings make the order matter.
    model = Transformer(small_config(n_layers=1))
    tokens = torch.tensor([[3, 7, 11, 5]])
    swapped = torch.tensor([[7, 3, 11, 5]])
    with torch.no_grad():
        a, b = model(tokens), model(swapped)
    assert not torch.allclose(a[0, -1], b[0, -1])


def test_rotary_scores_depend_only_on_relative_position() -> None:
    config = small_config()
    cos, sin = rope_tables(config)
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(config.head_dim, generator=gen), torch.randn(config.head_dim, generator=gen)

    def score(m: int, n: int) -> float:
        rq = apply_rope(q.expand(config.max_seq_len, -1), cos, sin)[m]
        rk = apply_rope(k.expand(config.max_seq_len, -1), cos, sin)[n]
        return float(rq @ rk)

    assert score(5, 2) == pytest.approx(score(12, 9), abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)
    assert score(0, 0) == pytest.approx(float(q @ k), abs=1e-5)


def test_sequence_longer_than_max_seq_len_is_refused() -> None:
    model = Transformer(small_config())
    with pytest.raises(ValueError, match="sequence length 17 exceeds max_seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_cross_entropy_of_a_fresh_model_is_near_uniform() -> None:
    config = ModelConfig.named("tiny", vocab_size=4096, max_seq_len=32)
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        loss = cross_entropy_loss(Transformer(config)(tokens), tokens)
    assert loss.item() == pytest.approx(torch.log(torch.tensor(4096.0)).item(), abs=0.1)


def test_training_reduces_loss_on_a_fixed_batch() -> None:
    model = Transformer(small_config())
    tokens = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("size", ["125m", "350m", "1b"])
def test_gpu_presets_are_counted_without_allocating(size: str) -> None:
    """The GPU presets are built on the meta device (no memory): num_params and the memory
    estimate agree with the module that would be trained."""
    config = ModelConfig.named(size, vocab_size=32768)
    with torch.device("meta"):
        model = Transformer(config)
    n = sum(p.numel() for p in model.parameters())
    assert n == config.num_params()
    expected = {"125m": 135e6, "350m": 375e6, "1b": 956e6}[size]
    assert abs(n - expected) / expected < 0.01
    estimate = estimate_memory(config, batch=8, seq=2048)
    assert estimate.train_state == 16 * n and estimate.round_state == 12 * n
    assert estimate_memory(config, batch=8, seq=2048, activation_checkpointing=True).activations < (
        estimate.activations
    )


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    config = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, ffn_dim=64, max_seq_len=16)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    grads = []
    for recompute in (False, True):
        model = Transformer(config)
        model.activation_checkpointing = recompute
        cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
