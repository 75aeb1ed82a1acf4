"""The peer table: only self-signed records, fresher wins, expiry, failure bans; the nonce cache."""

import dataclasses

import pytest

from neuroshard.node.p2p.peers import PeerTable
from neuroshard.protocol.peer import PeerRecord
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.signing import NonceCache

NOW = 1_000_000.0


def _table(own: str) -> PeerTable:
    return PeerTable(
        own_wallet=own, bootstrap=["10.0.0.1:7420", "10.0.0.1:7420"], ttl_s=30.0, ban_after=3, ban_s=10.0
    )


def _record(wallet, *, address="127.0.0.1:7000", last_seen=NOW, stage=0):  # type: ignore[no-untyped-def]
    return PeerRecord.create(wallet, address=address, stage=stage, last_seen=last_seen)


def test_only_validly_self_signed_records_enter(wallets) -> None:
    table = _table(wallets[0].public_key_hex)
    assert table.bootstrap == ("10.0.0.1:7420",)
    good = _record(wallets[1])
    # Someone re-points wallet 2's identity at their own address: the signature no longer verifies.
    forged = dataclasses.replace(_record(wallets[2]), address="6.6.6.6:7000")
    own = _record(wallets[0])
    assert table.merge([good, forged, own], NOW) == 1
    assert [e.wallet for e in table.live(NOW)] == [wallets[1].public_key_hex]


def test_fresher_record_wins_and_stale_or_future_ones_are_ignored(wallets) -> None:
    table = _table(wallets[0].public_key_hex)
    table.merge([_record(wallets[1], address="127.0.0.1:7000", last_seen=NOW - 5)], NOW)
    table.merge([_record(wallets[1], address="127.0.0.1:7001", last_seen=NOW - 1)], NOW)
    table.merge([_record(wallets[1], address="127.0.0.1:7002", last_seen=NOW - 3)], NOW)
    entry = table.get(wallets[1].public_key_hex)
    assert entry is not None and entry.address == "127.0.0.1:7001"
    assert table.merge([_record(wallets[2], last_seen=NOW - 31)], NOW) == 0  # already expired
    assert table.merge([_record(wallets[2], last_seen=NOW + 3600)], NOW) == 0  # would never expire


def test_silent_peers_expire(wallets) -> None:
    table = _table(wallets[0].public_key_hex)
    table.merge([_record(wallets[1], last_seen=NOW), _record(wallets[2], last_seen=NOW + 20)], NOW + 20)
    assert len(table.live(NOW + 25)) == 2
    assert table.expire(NOW + 31) == [wallets[1].public_key_hex]
    assert [e.wallet for e in table.live(NOW + 31)] == [wallets[2].public_key_hex]


def test_failures_ban_for_a_while_and_success_resets(wallets) -> None:
    table = _table(wallets[0].public_key_hex)
    table.merge([_record(wallets[1]), _record(wallets[2], stage=1)], NOW)
    w = wallets[1].public_key_hex
    assert [table.failed(w, NOW) for _ in range(3)] == [False, False, True]
    assert [e.wallet for e in table.live(NOW)] == [wallets[2].public_key_hex]
    assert table.live(NOW, stage=0) == []
    assert [e.wallet for e in table.live(NOW + 10, stage=0)] == [w]  # ban over
    table.failed(w, NOW + 10)
    table.succeeded(w)
    assert table.get(w).failures == 0  # type: ignore[union-attr]
    assert len(table.records(NOW)) == 2  # a ban is local: the records are still shared


def test_nonce_cache_rejects_replays_and_forgets_after_the_window() -> None:
    cache = NonceCache(window_s=60.0, max_entries=2)
    assert cache.add("w", "n1", NOW, NOW)
    assert not cache.add("w", "n1", NOW, NOW + 1)
    assert cache.add("v", "n1", NOW, NOW)  # nonces are per wallet
    with pytest.raises(Refused) as full:
        cache.add("w", "n2", NOW, NOW + 1)
    assert full.value.code == "busy"
    # After timestamp + window the pair can go: a replay would be stale anyway.
    assert cache.add("w", "n2", NOW + 61, NOW + 61) and len(cache) == 1
