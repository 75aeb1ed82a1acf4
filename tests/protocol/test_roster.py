"""The signed membership documents a node checks (protocol.roster), and the registration hashcash."""

import time
from dataclasses import replace

import pytest
from tests_support import refused

from neuroshard.node.wallet import Wallet
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.roster import MemberList, Roster, RosterError, pow_ok, solve_pow

OPERATOR = Wallet.from_token("roster-operator")
OTHER = Wallet.from_token("roster-other")
A, B = (Wallet.from_token(f"roster-{i}").public_key_hex for i in range(2))
NOW = 1_700_000_000


def _list(epoch: int = 3, **kw: object) -> MemberList:
    fields: dict[str, object] = {
        "network": "net",
        "expires_at": NOW + 600,
        "stage": 0,
        "epoch": epoch,
        "effective_round": 7,
        "policy": "probation",
        "admitted": tuple(sorted([A])),
        "probation": (B,),
        "admission_rounds": 3,
        **kw,
    }
    return MemberList.create(OPERATOR, **fields)


def test_member_list_round_trips_and_verifies() -> None:
    doc = _list()
    parsed = MemberList.from_json(doc.to_json())
    assert parsed == doc
    parsed.verify(OPERATOR.public_key_hex, network="net", now=NOW)


@pytest.mark.parametrize(
    "signer, network, now, message",
    [
        (OTHER.public_key_hex, "net", NOW, "signed by"),
        (OPERATOR.public_key_hex, "other", NOW, "not 'other'"),
        (OPERATOR.public_key_hex, "net", NOW + 600, "expired"),
    ],
)
def test_member_list_is_refused_for_another_signer_network_or_after_expiry(
    signer: str, network: str, now: int, message: str
) -> None:
    with pytest.raises(RosterError, match=message):
        _list().verify(signer, network=network, now=now)


def test_a_tampered_list_does_not_verify() -> None:
    forged = replace(_list(), admitted=tuple(sorted([A, B])), probation=())
    with pytest.raises(RosterError, match="signature does not verify"):
        MemberList.from_json(forged.to_json()).verify(OPERATOR.public_key_hex, network="net", now=NOW)


def test_newer_lists_replace_older_ones() -> None:
    old, new = _list(epoch=3), _list(epoch=4)
    assert new.newer_than(old) and not old.newer_than(new) and new.newer_than(None)
    resigned = _list(epoch=3, expires_at=NOW + 1200)
    assert resigned.newer_than(old) and not old.newer_than(resigned)
    with pytest.raises(RosterError):
        _list(stage=1).newer_than(old)


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"admitted": tuple(sorted([A, B], reverse=True)), "probation": ()}, "invalid"),
        ({"admitted": (A,), "probation": (A,)}, "invalid"),
        ({"policy": "allowlist"}, "invalid"),
        ({"policy": "anyone"}, "invalid"),
        ({"admitted": ("XYZ",)}, "malformed"),
    ],
    ids=["unsorted", "both lists", "allowlist with probationers", "unknown policy", "bad key"],
)
def test_inconsistent_lists_cannot_be_made(fields: dict[str, object], error: str) -> None:
    with refused(error):
        _list(**fields)


def test_duplicate_keys_are_refused_like_every_wire_message() -> None:
    body = _list().to_json()
    with refused("malformed", match="duplicate JSON key"):
        MemberList.from_json(body[:-1] + b',"epoch":99}')


def test_roster_lists_wallets_per_stage() -> None:
    roster = Roster.build(OPERATOR, network="net", version=2, expires_at=NOW + 60, stages={1: [B, A], 0: [A]})
    parsed = Roster.from_json(roster.to_json())
    parsed.verify(OPERATOR.public_key_hex, network="net", now=NOW)
    assert parsed.wallets(0) == {A} and parsed.wallets(1) == {A, B} and parsed.wallets(7) == frozenset()
    assert [s.stage for s in parsed.stages] == [0, 1]


def test_a_roster_and_a_member_list_do_not_pass_for_each_other() -> None:
    roster = Roster.build(OPERATOR, network="net", version=1, expires_at=NOW + 60, stages={0: [A]})
    with refused("malformed"):
        MemberList.from_json(roster.to_json())


def test_proof_of_work() -> None:
    start = time.perf_counter()
    nonce = solve_pow("net", A, 16)
    assert time.perf_counter() - start < 10
    assert pow_ok("net", A, nonce, 16)
    # Bound to the network and the wallet (fixed inputs: these two hashes have fewer zero bits).
    assert not pow_ok("other-net", A, nonce, 16)
    assert not pow_ok("net", B, nonce, 16)
    assert pow_ok("net", A, 0, 0)  # no work asked
    assert not pow_ok("net", A, -1, 1)
    with pytest.raises(ValueError):
        solve_pow("net", A, 64)


def test_member_list_vocab_growth_fields_are_absent_until_a_growth_is_scheduled() -> None:
    plain = _list()
    assert (plain.vocab_size, plain.vocab_from_round) == (None, None)
    assert b"vocab" not in plain.to_json()  # a node from before the fields reads it as it always did
    grown = _list(vocab_size=600, vocab_from_round=12)
    parsed = MemberList.from_json(grown.to_json())
    assert (parsed.vocab_size, parsed.vocab_from_round) == (600, 12)
    parsed.verify(OPERATOR.public_key_hex, network="net", now=NOW)
    with pytest.raises(Refused, match="together or neither"):
        _list(vocab_size=600)
