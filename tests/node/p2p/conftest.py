"""Shared pieces of the peer-network tests: wallets, a settable clock, a node state with a published snapshot."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from neuroshard.node.diloco import tensor_digest
from neuroshard.node.p2p.peers import PeerTable
from neuroshard.node.p2p.server import NodeState, ServerLimits
from neuroshard.node.p2p.state import Snapshot
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.signing import NonceCache

NUMEL = 1000
ROUND = 3


@dataclass
class Clock:
    """A settable clock: tests move time instead of sleeping."""

    now: float

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def wallets() -> list[Wallet]:
    return [Wallet.from_token(f"p2p-test-wallet-{i}") for i in range(4)]


@pytest.fixture
def clock() -> Clock:
    return Clock(time.time())


def _snapshot(round_: int = ROUND, numel: int = NUMEL, seed: int = 0) -> Snapshot:
    theta = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return Snapshot(
        round=round_, theta=theta, momentum=None, theta_hash=tensor_digest(theta), momentum_hash=""
    )


@pytest.fixture
def make_node(clock: Clock) -> Callable[..., NodeState]:
    def make(wallet: Wallet, *, stage: int = 0, snapshot: Snapshot | None = None, **limits: int) -> NodeState:
        node = NodeState(
            wallet=wallet,
            stage=stage,
            peers=PeerTable(own_wallet=wallet.public_key_hex, ttl_s=30.0, ban_after=3, ban_s=30.0),
            nonces=NonceCache(60.0),
            clock=clock,
            limits=ServerLimits(**limits),
            log=lambda line: None,
        )
        node.address = "127.0.0.1:1"
        node.set_snapshot(snapshot or _snapshot())
        return node

    return make


@pytest.fixture
def make_snapshot() -> Callable[..., Snapshot]:
    """Snapshot(round, θ (numel,) seeded, no momentum); the default is what `make_node` publishes."""
    return _snapshot
