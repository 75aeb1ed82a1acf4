"""Helpers shared by tests (importable: tests/ is on sys.path through pytest's pythonpath)."""

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from neuroshard.data.corpus import read_documents, stdlib_source_files
from neuroshard.node.model import Transformer, build_stage
from neuroshard.node.network_definition import NetworkDefinition
from neuroshard.protocol.refusal import Refused


def small_corpus(max_bytes: int = 400_000) -> list[str]:
    """A few hundred KB of real text every machine with Python has: standard-library source."""
    return list(read_documents(stdlib_source_files(), max_bytes))


def majority_stages(network: NetworkDefinition, seed: int) -> list[Transformer]:
    """A majority model for the verifier's round files: every stage of `network` with weights of
    its own (norm gains too, so a swap of stages shows), seeded."""
    gen = torch.Generator().manual_seed(seed)
    stages = []
    for s in range(network.num_stages):
        stage = build_stage(network.model, s, network.num_stages)
        with torch.no_grad():
            for p in stage.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        stages.append(stage.eval())
    return stages


@contextmanager
def refused(code: str, match: str | None = None) -> Iterator[None]:
    """pytest.raises(Refused) whose refusal also carries `code` (malformed, invalid, stale…)."""
    with pytest.raises(Refused, match=match) as err:
        yield
    assert err.value.code == code, f"refused with {err.value.code!r}, expected {code!r}: {err.value}"
