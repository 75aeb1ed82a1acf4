"""A node that joins a verifier trains by the network definition: its aggregation rule and f, its model."""

import torch

from neuroshard.cli.node import _aggregation_rule, _model_label
from neuroshard.node import aggregation
from neuroshard.node.model import ModelConfig
from neuroshard.testing.verifier import small_network


def test_a_joined_node_aggregates_with_the_definitions_rule_and_f() -> None:
    joined = small_network(aggregation={"rule": "multi_krum", "f": 1})
    xs = torch.randn(6, 30, generator=torch.Generator().manual_seed(0))
    assert torch.equal(_aggregation_rule(joined)(xs), aggregation.multi_krum(xs, 1))
    assert not torch.equal(_aggregation_rule(joined)(xs), aggregation.aggregate("default", xs))
    # Outside a network, as a network.toml that names nothing: the default rule, clipped with the
    # default knobs; a joined node takes the definition's.
    alone = aggregation.centered_clip(xs, **aggregation.DEFAULT_CLIPPING.keywords())
    assert torch.equal(_aggregation_rule(None)(xs), alone)
    default = small_network()
    assert default.clip == aggregation.DEFAULT_CLIPPING
    assert torch.equal(_aggregation_rule(default)(xs), alone)
    legacy = small_network(aggregation={"clip_scale": 1, "clip_iterations": 1})
    assert torch.equal(_aggregation_rule(legacy)(xs), aggregation.aggregate("default", xs))


def test_the_model_label_names_the_definitions_model() -> None:
    joined = small_network(model={"size": "micro", "vocab_size": 512})
    assert _model_label(joined.model) == "micro"
    custom = ModelConfig(vocab_size=512, dim=48, n_layers=3, n_heads=2, ffn_dim=96, max_seq_len=64)
    assert _model_label(custom) == "custom (dim 48, 3 layers, 2 heads)"
