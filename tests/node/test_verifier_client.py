"""The node's verifier client against a real verifier (uvicorn on loopback, SQLite)."""

import json
import math
import socket
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuroshard.cli.embedded import EmbeddedVerifier, start_embedded_verifier
from neuroshard.node import verifier_client
from neuroshard.node.network_definition import NetworkError
from neuroshard.node.verifier_client import (
    VerifierClient,
    VerifierClientConfig,
    VerifierUnreachable,
    fetch_network,
    splay_share,
)
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.reports import Receipt
from neuroshard.protocol.roster import MemberList
from neuroshard.testing.api import receipt_doc
from neuroshard.testing.ports import free_port
from neuroshard.testing.verifier import small_network

NODE = Wallet.from_token("tracker-test-node")


@pytest.fixture
def verifier(tmp_path: Path) -> Iterator[EmbeddedVerifier]:
    server = start_embedded_verifier(
        home=tmp_path / "verifier", network=small_network(), port=free_port(), log=lambda line: None
    )
    yield server
    server.stop()


def _get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())


def _wait(condition, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def test_network_definition_trusted_on_first_use_then_pinned(
    verifier: EmbeddedVerifier, tmp_path: Path
) -> None:
    known = tmp_path / "node" / "verifiers"
    seen: list[str] = []
    definition, key = fetch_network(verifier.url, operator_key=None, known_keys=known, log=seen.append)
    assert key == verifier.operator_key_hex and definition == small_network()
    assert any("trusting operator key" in line for line in seen)
    assert [p.read_text().strip() for p in known.glob("*.operator")] == [key]
    seen.clear()
    fetch_network(verifier.url, operator_key=None, known_keys=known, log=seen.append)
    assert seen == []  # remembered: no second "trusting"
    with pytest.raises(NetworkError, match="pinned with --operator-key"):
        fetch_network(verifier.url, operator_key="ab" * 32, known_keys=None, log=seen.append)


def test_a_different_operator_at_a_remembered_url_is_refused(tmp_path: Path) -> None:
    port, known = free_port(), tmp_path / "verifiers"
    first = start_embedded_verifier(
        home=tmp_path / "v1", network=small_network(), port=port, log=lambda s: None
    )
    try:
        fetch_network(first.url, operator_key=None, known_keys=known, log=lambda s: None)
    finally:
        first.stop()
    impostor = start_embedded_verifier(
        home=tmp_path / "v2", network=small_network(), port=port, log=lambda s: None
    )
    try:
        assert impostor.operator_key_hex != first.operator_key_hex
        with pytest.raises(NetworkError, match="remembered in"):
            fetch_network(impostor.url, operator_key=None, known_keys=known, log=lambda s: None)
    finally:
        impostor.stop()


def test_a_restart_while_the_verifier_is_down_trains_by_the_saved_definition(tmp_path: Path) -> None:
    known, lines = tmp_path / "verifiers", []
    server = start_embedded_verifier(
        home=tmp_path / "v", network=small_network(), port=free_port(), log=print
    )
    try:
        fetch_network(server.url, operator_key=None, known_keys=known, log=lines.append)
    finally:
        server.stop()
    definition, key = fetch_network(server.url, operator_key=None, known_keys=known, log=lines.append)
    assert definition == small_network() and key == server.operator_key_hex
    assert "unreachable" in lines[-1]
    # The saved copy is checked again: edited, it is worth nothing.
    (saved,) = known.glob("*.network.json")
    saved.write_text(saved.read_text().replace('"tiny"', '"small"').replace("test", "evil"))
    with pytest.raises(NetworkError, match="cannot fetch"):
        fetch_network(server.url, operator_key=None, known_keys=known, log=lines.append)
    with pytest.raises(NetworkError, match="cannot fetch"):  # and never without a key to check it with
        fetch_network(server.url, operator_key=None, known_keys=tmp_path / "elsewhere", log=lines.append)


def test_registers_heartbeats_and_delivers_receipts(verifier: EmbeddedVerifier) -> None:
    lines: list[str] = []
    peers_seen: list[list[str]] = []
    config = VerifierClientConfig(url=verifier.url, address="127.0.0.1:7999", peers_every_s=0.2)
    tracker = VerifierClient(config, NODE, lines.append, progress=lambda: (2, 1), on_peers=peers_seen.append)
    tracker.start()
    try:
        for r in range(3):
            tracker.submit(Receipt.from_obj(receipt_doc(r, f"{r:064x}")))
        _wait(lambda: tracker.delivered == 3)
    finally:
        tracker.stop()
    node = _get(f"{verifier.url}/api/nodes/{NODE.wallet_id}")
    assert isinstance(node, dict)
    assert node["receipts"] == 3 and [r["round"] for r in node["recent_receipts"]] == [2, 1, 0]
    peers = _get(f"{verifier.url}/api/peers?stage=0")
    assert [p["address"] for p in peers] == ["http://127.0.0.1:7999"]  # type: ignore[index, union-attr]
    assert peers_seen == []  # its own entry is not a peer to dial
    assert tracker.dropped == 0 and any("registered" in line for line in lines)


def test_splay_shares_spread_a_stage_evenly_and_are_reproducible() -> None:
    wallets = [Wallet.from_token(f"splay-{i}").public_key_hex for i in range(2000)]
    shares = [splay_share(w, 7) for w in wallets]
    assert all(0 <= s < 1 for s in shares)
    tenths = Counter(int(s * 10) for s in shares)
    assert sorted(tenths) == list(range(10)) and min(tenths.values()) > 150  # 200 each on average
    assert splay_share(wallets[0], 7) == shares[0] != splay_share(wallets[0], 8)


def _due_in(tracker: VerifierClient) -> list[float]:
    """Seconds until each queued receipt may go (the queue's own due times; no wall-clock guesses)."""
    now = time.monotonic()
    return [due - now for due, _ in tracker._queue]


def test_a_receipt_waits_its_share_of_half_the_time_since_the_last_and_never_behind_a_later_one() -> None:
    """Not started, so nothing is sent: what is checked is when each receipt would go."""
    config = VerifierClientConfig(url="http://127.0.0.1:9", address="127.0.0.1:7998", receipt_splay=0.5)
    node = Wallet.from_token("splay-node-3")  # shares 0.70 for round 1, 0.71 for round 2
    tracker = VerifierClient(config, node, lambda line: None)
    tracker.submit(Receipt.from_obj(receipt_doc(0, "0" * 64)))
    assert _due_in(tracker)[0] <= 0  # the first goes at once
    tracker._last_queued -= 40.0  # as if the round took 40 s
    before = time.monotonic()
    tracker.submit(Receipt.from_obj(receipt_doc(1, "1" * 64)))
    expected = 0.5 * 40.0 * splay_share(node.public_key_hex, 1)  # ~14 s
    assert expected - 0.5 <= _due_in(tracker)[1] <= expected + (time.monotonic() - before) + 0.5
    tracker._last_queued -= 4.0  # a 4 s round: round 2 is due in ~1.4 s, and round 1 no later
    tracker.submit(Receipt.from_obj(receipt_doc(2, "2" * 64)))
    first, second, third = _due_in(tracker)
    assert third <= 0.5 * 4.0 + 0.5 and second == third and first <= 0
    tracker._last_queued -= 10_000.0
    tracker.submit(Receipt.from_obj(receipt_doc(3, "3" * 64)))
    assert _due_in(tracker)[3] <= config.receipt_splay_max_s  # the cap


def test_waiting_receipts_go_when_due_and_stop_sends_what_waits(verifier: EmbeddedVerifier) -> None:
    config = VerifierClientConfig(url=verifier.url, address="127.0.0.1:7998", receipt_splay=0.5)
    node = Wallet.from_token("splay-node-3")
    tracker = VerifierClient(config, node, lambda line: None)
    tracker.start()
    try:
        tracker.submit(Receipt.from_obj(receipt_doc(0, "0" * 64)))
        _wait(lambda: tracker.delivered == 1)
        tracker._last_queued -= 6.0  # a 6 s round: round 1 waits ~2.1 s
        tracker.submit(Receipt.from_obj(receipt_doc(1, "1" * 64)))
        due = time.monotonic() + _due_in(tracker)[0]
        _wait(lambda: tracker.delivered == 2, timeout_s=30)
        assert time.monotonic() >= due  # not before its time (the flush is the only exception)

        tracker._last_queued -= 100.0  # round 2 would wait ~35 s
        tracker.submit(Receipt.from_obj(receipt_doc(2, "2" * 64)))
        due = time.monotonic() + _due_in(tracker)[0]
        assert tracker.pending() == 1 and due - time.monotonic() > 20
    finally:
        tracker.stop(flush_s=10.0)
    assert tracker.delivered == 3 and time.monotonic() < due  # sent by the stop, long before its time


def test_an_unreachable_verifier_never_blocks_and_the_queue_stays_bounded() -> None:
    lines: list[str] = []
    config = VerifierClientConfig(url=f"http://127.0.0.1:{free_port()}", address="127.0.0.1:7999", queue_size=5,
                           retry_s=0.1, timeout_s=0.5)  # fmt: skip
    tracker = VerifierClient(config, NODE, lines.append)
    tracker.start()
    try:
        started = time.monotonic()
        for r in range(12):
            tracker.submit(Receipt.from_obj(receipt_doc(r, f"{r:064x}")))
        assert time.monotonic() - started < 0.5  # the training thread is never held up
        assert tracker.pending() == 5 and tracker.dropped == 7
        _wait(lambda: any("retrying every" in line for line in lines), timeout_s=5)
    finally:
        stopped = time.monotonic()
        tracker.stop(flush_s=0.5)
        assert time.monotonic() - stopped < 3.0
    assert not tracker.registered and tracker.delivered == 0
    assert sum("retrying every" in line for line in lines) == 1  # one line per outage, not per attempt


def test_a_verifier_that_stopped_answering_does_not_hold_up_stop() -> None:
    """The node's exit waits `flush_s` and a second, not a request timeout: a verifier that accepts
    the connection and never answers keeps the tracker's request open for `timeout_s`."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    config = VerifierClientConfig(url=f"http://127.0.0.1:{silent.getsockname()[1]}", address="127.0.0.1:7999",
                                  timeout_s=30.0)  # fmt: skip
    tracker = VerifierClient(config, NODE, lambda line: None)
    tracker.start()
    try:
        tracker.submit(Receipt.from_obj(receipt_doc(0, "0" * 64)))
        time.sleep(0.3)  # the tracker is inside its registration request, waiting for an answer
        stopped = time.monotonic()
        tracker.stop(flush_s=0.5)
        assert time.monotonic() - stopped < 3.0
    finally:
        silent.close()


def test_join_asks_again_until_the_verifier_answers_or_time_is_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from neuroshard.node import reporting
    from neuroshard.node.verifier_client import VerifierUnreachable

    monkeypatch.setattr(reporting, "JOIN_TIMEOUT_S", 0.1)
    lines: list[str] = []
    with pytest.raises(VerifierUnreachable, match="cannot fetch the network definition"):
        reporting.join_network(
            f"http://127.0.0.1:{free_port()}", operator_key=None, home=tmp_path, log=lines.append
        )
    assert any("retrying" in line for line in lines)


def test_the_tracker_reads_the_member_lists_of_its_pipeline_neighbours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A middle replica reads the lists of stages 0 and 2 beside its own: each valid, newer one is
    handed on once; one signed by another key, or older than what it holds, is not; one stage's
    list not read (refused, or the verifier unreachable) leaves the other read all the same."""
    operator, stranger = Wallet.from_token("neighbours-operator"), Wallet.from_token("neighbours-stranger")
    served: dict[int, bytes] = {}

    def listing(stage: int, epoch: int, signer: Wallet = operator) -> bytes:
        return MemberList.create(
            signer, network="n", expires_at=2**40, stage=stage, epoch=epoch, effective_round=0,
            policy="allowlist", admitted=(NODE.public_key_hex,), probation=(), admission_rounds=3,
        ).to_json()  # fmt: skip

    failing: dict[int, Exception] = {}

    def request(url: str, path: str, **_: object) -> tuple[bytes, dict[str, str]]:
        stage = int(path.split("/")[3])
        if stage in failing:
            raise failing[stage]
        return served[stage], {}

    monkeypatch.setattr(verifier_client, "_request", request)
    own: list[MemberList] = []
    neighbours: list[MemberList] = []
    lines: list[str] = []
    config = VerifierClientConfig(
        url="http://127.0.0.1:9", address="127.0.0.1:7999", stage=1, operator_key=operator.public_key_hex,
        network="n", neighbour_stages=(0, 2),
    )  # fmt: skip
    tracker = VerifierClient(
        config, NODE, lines.append, on_members=own.append, on_neighbours=neighbours.append
    )
    served.update({0: listing(0, 3), 1: listing(1, 1), 2: listing(2, 5)})
    tracker._members()
    assert tracker._read_neighbours() == config.neighbours_every_s == 15.0  # its own pace
    assert [m.stage for m in own] == [1] and [(m.stage, m.epoch) for m in neighbours] == [(0, 3), (2, 5)]
    served.update({0: listing(0, 2), 2: listing(2, 6, signer=stranger)})  # replayed older; forged
    tracker._read_neighbours()
    assert len(neighbours) == 2 and {s: m.epoch for s, m in tracker.neighbour_members.items()} == {0: 3, 2: 5}
    assert any("stage 2's member list refused" in line for line in lines)
    served[0] = listing(0, 4)
    tracker._read_neighbours()
    assert [(m.stage, m.epoch) for m in neighbours[2:]] == [(0, 4)] and len(own) == 1
    for failure in (Refused("busy", "try again later"), VerifierUnreachable("GET: timed out")):
        failing[0] = failure
        served[2] = listing(2, tracker.neighbour_members[2].epoch + 1)
        tracker._read_neighbours()
        tracker._read_neighbours()  # still failing: said once
        assert neighbours[-1].stage == 2 and neighbours[-1].epoch == tracker.neighbour_members[2].epoch
        assert sum(f"stage 0's member list not read: {failure}" in line for line in lines) == 1
        del failing[0]
        tracker._read_neighbours()  # read again: the next failure is said again
    # A verifier that serves no member lists at all: neither its own nor its neighbours' are asked for.
    failing[1] = Refused("not_found", "no such route")
    tracker._members()
    assert tracker._read_neighbours() == math.inf
