"""Adopting a peer's state needs a quorum of signed statuses: one liar cannot redirect a replica."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from neuroshard.node.diloco import DiLoCo, DiLoCoConfig, tensor_digest
from neuroshard.node.p2p.plane import PeerPlane, PeerPlaneConfig
from neuroshard.node.p2p.quorum import backing, quorum, tolerated, vouched
from neuroshard.node.p2p.rounds import plurality
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.peer import StateInfo

H_A, H_B, H_X = "aa" * 32, "bb" * 32, "ee" * 32
M_1, M_2 = "11" * 32, "22" * 32


def _status(i: int, round_: int, theta_hash: str, momentum_hash: str = M_1) -> StateInfo:
    return StateInfo.create(
        Wallet.from_token(f"quorum-{i}"),
        stage=0,
        round=round_,
        theta_hash=theta_hash,
        momentum_hash=momentum_hash,
        numel=10,
    )


def test_quorum_is_one_more_than_the_liars_a_vote_can_outlast() -> None:
    assert [tolerated(n) for n in range(1, 11)] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert [quorum(n) for n in (1, 3, 4, 6, 7, 10)] == [1, 1, 2, 2, 3, 4]
    with pytest.raises(ValueError, match="at least one voter"):
        quorum(0)


def test_one_status_claiming_a_far_round_is_not_followed() -> None:
    honest = [_status(i, 5, H_A) for i in range(3)]
    liar = _status(9, 1000, H_X)
    vote = vouched([*honest, liar], 0, voters=5)
    assert vote is not None and (vote.round, vote.theta_hash, vote.votes) == (5, H_A, 3)
    # The old rule (plurality at the highest round anyone claims) would have taken the liar's.
    assert plurality([*honest, liar], 1000, None).theta_hash == H_X  # type: ignore[union-attr]


def test_two_peers_ahead_are_followed_and_a_lone_one_is_not() -> None:
    statuses = [_status(0, 5, H_A), _status(1, 6, H_B), _status(2, 6, H_B), _status(3, 7, H_X)]
    vote = vouched(statuses, 5, voters=5)  # quorum(5) = 2
    assert vote is not None and (vote.round, vote.theta_hash) == (6, H_B)
    assert vouched(statuses, 7, voters=5) is None


def test_a_state_must_be_vouched_for_with_its_momentum() -> None:
    # Two peers agree on θ but not on the momentum: neither pair has the quorum of 2.
    split = [_status(0, 5, H_A, M_1), _status(1, 5, H_A, M_2), _status(2, 4, H_B), _status(3, 4, H_B)]
    vote = vouched(split, 0, voters=5)
    assert vote is not None and (vote.round, vote.theta_hash) == (4, H_B)
    same = plurality(split, 5, None)
    assert same is not None and backing(same)[1] == 1


def test_below_four_voters_one_voucher_suffices() -> None:
    # n = 3 tolerates no liar (n >= 3f + 1), so refusing a lone voucher would only stop honest re-syncs.
    vote = vouched([_status(0, 7, H_A), _status(1, 5, H_B)], 0, voters=3)
    assert vote is not None and vote.round == 7


# --- live: a joiner among three honest replicas and one liar -----------------------------------


def _engine(seed: int, round_: int) -> DiLoCo:
    torch.manual_seed(seed)
    diloco = DiLoCo(nn.Linear(8, 4), DiLoCoConfig(inner_steps=2, warmup_steps=0, total_steps=10))
    diloco.round = round_
    return diloco


def _network(index: int, peers: tuple[str, ...], lines: list[str]) -> PeerPlane:
    config = PeerPlaneConfig(
        port=0,
        peers=peers,
        join_timeout_s=5.0,
        gossip_interval_s=0.2,
        hash_check_timeout_s=2.0,
        request_timeout_s=5.0,
        connect_timeout_s=2.0,
    )
    return PeerPlane(
        config, Wallet.from_token(f"quorum-live-{index}"), 0, lines.append, stop=threading.Event()
    )


@pytest.fixture
def networks() -> Iterator[list[PeerPlane]]:
    started: list[PeerPlane] = []
    yield started
    for network in started:
        network.stop()


def test_a_joiner_takes_the_honest_state_not_the_liars(networks: list[PeerPlane]) -> None:
    lines: list[str] = []
    honest = [_engine(seed=1, round_=5) for _ in range(3)]
    liar = _engine(seed=2, round_=1000)  # a forged θ "far ahead": the state it wants others to take
    first = _network(0, (), lines)
    networks.append(first)
    bootstrap = (first.start(),)
    for i in range(1, 4):
        network = _network(i, bootstrap, lines)
        networks.append(network)
        network.start()
    for network, engine in zip(networks, [*honest, liar], strict=True):
        network.join_state(engine)
    joiner_engine = _engine(seed=3, round_=0)
    joiner = _network(9, bootstrap, lines)
    networks.append(joiner)
    joiner.start()

    assert joiner.join_state(joiner_engine)
    assert joiner_engine.round == 5
    assert tensor_digest(joiner_engine.theta_round) == tensor_digest(honest[0].theta_round)
    assert tensor_digest(joiner_engine.theta_round) != tensor_digest(liar.theta_round)


def test_fetch_refuses_a_state_with_fewer_holders_than_the_quorum(make_node, wallets) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from neuroshard.node.p2p.exchange import Exchange, ExchangeTimings

    logged: list[str] = []
    timings = ExchangeTimings(
        poll_interval_s=0.1,
        hash_check_timeout_s=1.0,
        state_timeout_s=1.0,
        control_timeout_s=1.0,
    )
    exchange = Exchange(make_node(wallets[0]), None, timings, logged.append)  # type: ignore[arg-type]
    # One peer reports the winning hash in a vote among four: the minority re-sync must not follow it.
    # (a four-way tie, this replica's own "cc…" included, goes to the smallest hash: the liar's "aa…")
    vote = plurality([_status(1, 4, H_X), _status(2, 4, H_A), _status(3, 4, H_B)], 4, "cc" * 32)
    assert vote is not None and vote.theta_hash == H_A and backing(vote)[1] == 1
    assert asyncio.run(exchange.fetch_from(vote, need=quorum(vote.voters))) is None
    assert any("vouched for by 1 peer(s), fewer than the quorum of 2" in line for line in logged)
