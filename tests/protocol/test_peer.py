"""Peer-plane messages (protocol/peer.py) and the machinery under them (protocol/schema.py): strict
schemas derived from the fields, canonical signatures, domain separation, refusal codes."""

import json

import pytest
from tests_support import refused

from neuroshard.protocol.peer import PeerList, PeerRecord, StateInfo
from neuroshard.protocol.schema import canonical_json

HASH = "ab" * 32


def _status(wallet, **over):  # type: ignore[no-untyped-def]
    values = dict(stage=0, round=5, theta_hash=HASH, momentum_hash="", numel=10)
    return StateInfo.create(wallet, **{**values, **over})


def test_status_round_trips_and_verifies(wallets) -> None:
    status = _status(wallets[0])
    again = StateInfo.from_json(status.to_json())
    assert again == status and again.signature_valid()
    assert status.to_json() == canonical_json(json.loads(status.to_json()))


def test_changed_field_breaks_the_signature(wallets) -> None:
    obj = json.loads(_status(wallets[0]).to_json())
    obj["round"] = 6
    assert not StateInfo.from_obj(obj).signature_valid()


def test_signature_of_one_message_type_does_not_pass_as_another(wallets) -> None:
    record = PeerRecord.create(wallets[0], address="127.0.0.1:7000", stage=0, last_seen=1.0)
    info = StateInfo.create(wallets[0], stage=0, round=1, theta_hash=HASH, momentum_hash="", numel=10)
    assert record.signature_valid() and info.signature_valid()
    # Same signer, different domains: swapping signatures between types fails.
    swapped = StateInfo.from_obj({**json.loads(info.to_json()), "signature": record.signature})
    assert not swapped.signature_valid()


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (lambda o: o.update(extra=1), "malformed", "unknown field(s) extra"),
        (lambda o: o.pop("numel"), "malformed", "missing field(s) numel"),
        (lambda o: o.update(round="5"), "malformed", "must be an integer"),
        (lambda o: o.update(round=5.0), "malformed", "must be an integer"),
        (lambda o: o.update(round=True), "malformed", "must be an integer"),
        (lambda o: o.update(round=-1), "invalid", "outside"),
        (lambda o: o.update(stage=5000), "invalid", "outside"),
        (lambda o: o.update(numel=0), "invalid", "outside"),
        (lambda o: o.update(theta_hash="AB" * 32), "malformed", "lowercase hex"),
        (lambda o: o.update(momentum_hash="ab"), "malformed", "64 lowercase hex"),
        (lambda o: o.update(wallet="00"), "malformed", "64 lowercase hex"),
    ],
)
def test_schema_is_strict(wallets, mutate, error, message) -> None:
    obj = json.loads(_status(wallets[0]).to_json())
    mutate(obj)
    with refused(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        StateInfo.from_obj(obj)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"a": 1, "a": 2}', "duplicate JSON key"),
        (b'{"x": NaN}', "NaN is not allowed"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[1, 2", "not JSON"),
        (b"[]", "must be a JSON object"),
        (b"[" * 3000 + b"]" * 3000, "nests too deep"),
        (b'{"a":' * 3000 + b"1" + b"}" * 3000, "nests too deep"),
        (b'{"round": ' + b"9" * 5000 + b"}", "not acceptable JSON"),  # past Python's int digits limit
        (b'{"x": 1e999}', "overflows a float"),
    ],
)
def test_json_parsing_is_strict(raw, message) -> None:
    with refused("malformed", match=message):
        StateInfo.from_json(raw)


@pytest.mark.parametrize("address", ["nohost", "h:0", "h:65536", "h:x", ":80", "a b:80", "h:-1"])
def test_bad_addresses_are_refused(wallets, address) -> None:
    with refused("invalid", match="host:port"):
        PeerRecord.create(wallets[0], address=address, stage=0, last_seen=1.0)


def test_addresses_accept_names_ipv4_ipv6(wallets) -> None:
    for address in ("node.example.org:7420", "10.0.0.1:1", "[::1]:65535"):
        assert PeerRecord.create(wallets[0], address=address, stage=0, last_seen=1.0).signature_valid()


def test_peer_list_nests_records_strictly(wallets) -> None:
    record = PeerRecord.create(wallets[0], address="127.0.0.1:7000", stage=0, last_seen=1.0)
    listed = PeerList.from_json(PeerList(peers=(record,)).to_json())
    assert listed.peers == (record,)
    bad = json.loads(PeerList(peers=(record,)).to_json())
    bad["peers"][0]["stage"] = "0"
    with refused("malformed", match=r"peer list.peers\[0\].stage must be an integer"):
        PeerList.from_obj(bad)
