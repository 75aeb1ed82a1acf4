"""The signed objects of a partitioned round and the fraud proof's byte format
(protocol/round.py): round trips, signatures that break on any change, strict schemas."""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from typing import Any

import pytest
from tests_support import refused

from neuroshard.node.wallet import Wallet
from neuroshard.protocol.identity import verify
from neuroshard.protocol.round import (
    AggregateClaim,
    Dropped,
    Echo,
    EquivocationProof,
    FraudProof,
    InputList,
    RoundCommitment,
    RoundDigest,
    claims_sha256,
)
from neuroshard.protocol.schema import Signed

ROUND_FIELDS: dict[str, Any] = {
    "stage": 3,
    "round": 12,
    "base_hash": "ab" * 32,
    "members_sha256": "cd" * 32,
}


@functools.cache
def wallet(i: int) -> Wallet:
    return Wallet.from_token(f"outer-messages-{i}")


def commitment(i: int, **over: Any) -> RoundCommitment:
    fields = {
        **ROUND_FIELDS,
        "tokens": 4096,
        "encoding": "int8",
        "numel": 1000,
        "parts_root": hashlib.sha256(f"root {i}".encode()).hexdigest(),
    }
    return RoundCommitment.create(wallet(i), **{**fields, **over})


def claim(i: int, part: int = 2, **over: Any) -> AggregateClaim:
    fields = {
        **ROUND_FIELDS,
        "part": part,
        "encoding": "fp16",
        "replaces": "",
        "inputs_sha256": "01" * 32,
        "accepted": 4,
        "aggregate_sha256": hashlib.sha256(f"aggregate {i} {part}".encode()).hexdigest(),
    }
    return AggregateClaim.create(wallet(i), **{**fields, **over})


def digest(i: int) -> RoundDigest:
    return RoundDigest.create(
        wallet(i), **ROUND_FIELDS, claims_sha256="23" * 32, frauds=(1, 3), equivocations=(2,)
    )


def echo(i: int, *claims: AggregateClaim) -> Echo:
    return Echo.create(wallet(i), **ROUND_FIELDS, part=2, claims=claims)


def input_list(part: int = 1) -> InputList:
    considered = tuple(sorted((commitment(i) for i in range(3)), key=lambda c: c.wallet))
    dropped = (Dropped(wallet="ff" * 32, reason="no valid commitment held by the owner"),)
    return InputList(part=part, considered=considered, dropped=dropped)


SIGNED: dict[str, Any] = {
    "commitment": lambda: commitment(0),
    "claim": lambda: claim(0),
    "claim of a backup": lambda: claim(0, replaces=wallet(5).public_key_hex),
    "digest": lambda: digest(0),
    "digest without frauds": lambda: RoundDigest.create(
        wallet(0), **ROUND_FIELDS, claims_sha256="23" * 32, frauds=(), equivocations=()
    ),
    "echo of a claim": lambda: echo(0, claim(1)),
    "echo of none": lambda: echo(0),
}


def altered(value: Any) -> Any:
    """Another value of the same JSON type that still passes the schema."""
    if isinstance(value, bool):
        raise AssertionError("no boolean fields expected")
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        if value in ("int8", "fp16"):
            return "fp16" if value == "int8" else "int8"
        if value == "":
            return "ab" * 32
        return value[:-1] + ("1" if value[-1] == "0" else "0")  # still lowercase hex
    if isinstance(value, list):
        return value[:-1] if value else [0]
    raise AssertionError(f"no alteration for {value!r}")


@pytest.mark.parametrize("name", list(SIGNED))
def test_a_signed_message_round_trips(name: str) -> None:
    msg: Signed = SIGNED[name]()
    assert msg.signature_valid()
    raw = msg.to_json()
    back = type(msg).from_json(raw)
    assert back == msg and back.to_json() == raw and back.signature_valid()


@pytest.mark.parametrize("name", list(SIGNED))
def test_changing_any_field_breaks_the_signature(name: str) -> None:
    msg: Signed = SIGNED[name]()
    cls = type(msg)
    obj = msg.to_obj()
    for field in obj:
        if field == "signature":
            continue
        value = [claim(1).to_obj()] if field == "claims" and not obj[field] else altered(obj[field])
        changed = dict(obj, **{field: value})
        forged = cls.from_obj(changed)  # a well-formed message ...
        assert not forged.signature_valid(), field  # ... whose signature no longer verifies
    other = cls.from_obj(dict(obj, wallet=wallet(9).public_key_hex))
    assert not other.signature_valid()
    sig = obj["signature"]
    flipped = cls.from_obj(dict(obj, signature=sig[:10] + ("1" if sig[10] == "0" else "0") + sig[11:]))
    assert not flipped.signature_valid()


def test_changing_the_claim_inside_an_echo_breaks_the_echos_signature() -> None:
    obj = echo(0, claim(1)).to_obj()
    obj["claims"][0] = dict(obj["claims"][0], aggregate_sha256="77" * 32)
    assert not Echo.from_obj(obj).signature_valid()
    obj = echo(0, claim(1)).to_obj()
    obj["claims"] = []
    assert not Echo.from_obj(obj).signature_valid()


def test_an_echo_holds_at_most_one_claim() -> None:
    obj = echo(0, claim(1)).to_obj()
    obj["claims"] = [obj["claims"][0], claim(2).to_obj()]
    with refused("invalid", match="at most 1"):
        Echo.from_obj(obj)


def test_an_equivocation_proof_round_trips_and_holds_at_most_two_claims() -> None:
    proof = EquivocationProof(claims=(claim(1), claim(1, aggregate_sha256="55" * 32)))
    back = EquivocationProof.from_json(proof.to_json())
    assert back == proof and all(c.signature_valid() for c in back.claims)
    obj = proof.to_obj()
    obj["claims"].append(claim(2).to_obj())
    with refused("invalid", match="at most 2"):
        EquivocationProof.from_obj(obj)


def test_a_signature_is_bound_to_its_message_type() -> None:
    """Each type signs under its own domain: the same fields signed as one type never verify as another."""
    d = digest(0)
    body = d.signing_bytes()[len(RoundDigest.DOMAIN) :]
    signature = bytes.fromhex(d.signature)
    assert verify(wallet(0).public_key, RoundDigest.DOMAIN + body, signature)
    others = (RoundCommitment, AggregateClaim, Echo)
    assert len({RoundDigest.DOMAIN, *(cls.DOMAIN for cls in others)}) == 4
    for cls in others:
        assert not verify(wallet(0).public_key, cls.DOMAIN + body, signature), cls.NAME


@pytest.mark.parametrize("name", [*SIGNED, "input list"])
def test_unknown_and_missing_fields_are_refused(name: str) -> None:
    msg = input_list() if name == "input list" else SIGNED[name]()
    cls = type(msg)
    obj = msg.to_obj()
    with refused("malformed", match="unknown field"):
        cls.from_obj(dict(obj, extra=1))
    with refused("malformed", match="unknown field"):
        cls.from_json(json.dumps(dict(obj, Round=1)))
    for field in obj:
        missing = {k: v for k, v in obj.items() if k != field}
        with refused("malformed", match="missing field"):
            cls.from_obj(missing)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("stage", "3", "malformed"),
        ("stage", True, "malformed"),
        ("stage", 3.0, "malformed"),
        ("stage", 1024, "invalid"),
        ("round", -1, "invalid"),
        ("round", 2**53, "invalid"),
        ("encoding", "bf16", "invalid"),
        ("numel", 0, "invalid"),
        ("parts_root", "AB" * 32, "malformed"),
        ("parts_root", "ab" * 31, "malformed"),
        ("base_hash", "", "malformed"),
        ("wallet", "zz" * 32, "malformed"),
        ("signature", "00" * 32, "malformed"),
    ],
)
def test_a_commitment_with_a_bad_value_is_refused(field: str, value: Any, error: str) -> None:
    obj = commitment(0).to_obj()
    with refused(error):
        RoundCommitment.from_obj(dict(obj, **{field: value}))


def test_a_claim_names_a_replaced_wallet_or_none() -> None:
    obj = claim(0).to_obj()
    assert AggregateClaim.from_obj(dict(obj, replaces=wallet(3).public_key_hex)).replaces
    with refused("malformed"):
        AggregateClaim.from_obj(dict(obj, replaces="ab"))
    with refused("invalid"):
        AggregateClaim.from_obj(dict(obj, part=4096))
    with refused("invalid"):
        AggregateClaim.from_obj(dict(obj, accepted=4097))


def test_a_digest_names_at_most_64_fraud_parts() -> None:
    fields = {**ROUND_FIELDS, "claims_sha256": "23" * 32}
    assert (
        len(RoundDigest.create(wallet(0), **fields, frauds=tuple(range(64)), equivocations=()).frauds) == 64
    )
    with refused("invalid", match="at most 64"):
        RoundDigest.create(wallet(0), **fields, frauds=tuple(range(65)), equivocations=())


def test_an_input_list_round_trips() -> None:
    inputs = input_list()
    raw = inputs.to_json()
    back = InputList.from_json(raw)
    assert back == inputs and back.to_json() == raw and back.sha256() == inputs.sha256()
    assert all(c.signature_valid() for c in back.considered)
    assert inputs.sha256() == hashlib.sha256(raw).hexdigest()


def test_an_input_lists_hash_covers_every_entry() -> None:
    inputs = input_list()
    assert InputList(part=2, considered=inputs.considered, dropped=inputs.dropped).sha256() != inputs.sha256()
    assert (
        InputList(part=1, considered=inputs.considered[1:], dropped=inputs.dropped).sha256()
        != inputs.sha256()
    )
    reason = (Dropped(wallet="ff" * 32, reason="banned in an earlier round"),)
    assert InputList(part=1, considered=inputs.considered, dropped=reason).sha256() != inputs.sha256()


def test_an_input_list_refuses_unsorted_or_repeated_wallets() -> None:
    obj = input_list().to_obj()
    unsorted = dict(obj, considered=list(reversed(obj["considered"])))
    with refused("invalid", match="wallet order, one per wallet"):
        InputList.from_obj(unsorted)
    repeated = dict(obj, considered=[obj["considered"][0], *obj["considered"]])
    with refused("invalid", match="wallet order, one per wallet"):
        InputList.from_obj(repeated)
    # Two commitments of one wallet (equivocation) are two entries for one wallet: refused too.
    twice = sorted([commitment(0).to_obj(), commitment(0, tokens=1).to_obj()], key=lambda c: c["signature"])
    with refused("invalid", match="wallet order, one per wallet"):
        InputList.from_obj(dict(obj, considered=twice))


def test_an_input_list_checks_its_nested_messages() -> None:
    obj = input_list().to_obj()
    bad_commitment = [dict(obj["considered"][0], extra=1), *obj["considered"][1:]]
    with refused("malformed", match="unknown field"):
        InputList.from_obj(dict(obj, considered=bad_commitment))
    with refused("malformed", match="missing field"):
        InputList.from_obj(dict(obj, dropped=[{"wallet": "ff" * 32}]))
    with refused("invalid"):
        InputList.from_obj(dict(obj, dropped=[{"wallet": "ff" * 32, "reason": "x" * 301}]))
    with refused("malformed"):
        InputList.from_obj(dict(obj, considered={}))


def test_claims_sha256_is_over_parts_in_order() -> None:
    a, b = claim(1, part=0), claim(2, part=5)
    digest_ab = claims_sha256({0: a, 5: b})
    assert claims_sha256({5: b, 0: a}) == digest_ab  # insertion order does not matter
    assert claims_sha256({0: a, 4: b}) != digest_ab  # the part number does
    assert claims_sha256({0: a}) != digest_ab
    assert claims_sha256({0: a, 5: claim(3, part=5)}) != digest_ab
    assert claims_sha256({}) == hashlib.sha256(b"").hexdigest()
    expected = f"0:{a.sha256()}\n5:{b.sha256()}".encode()
    assert digest_ab == hashlib.sha256(expected).hexdigest()


# --- fraud proofs on the wire ----------------------------------------------------------------------


def fraud_proof(parts: tuple[tuple[bytes, bytes], ...] | None = None) -> FraudProof:
    inputs = input_list()
    if parts is None:
        parts = ((b"\x01" * 64, b"part zero"), (b"", b""), (b"\x02" * 32, bytes(range(256))))
    made = claim(4, part=inputs.part, inputs_sha256=inputs.sha256())
    return FraudProof(made, inputs, parts)


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def join(header: Any, tail: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + tail


def test_a_fraud_proof_round_trips() -> None:
    for proof in (fraud_proof(), fraud_proof(((b"", b""),) * 3)):
        data = proof.encode()
        back = FraudProof.decode(data)
        assert back == proof and back.encode() == data
        assert back.claim.signature_valid()
        assert back.inputs.sha256() == back.claim.inputs_sha256


def test_a_fraud_proof_without_inputs_round_trips() -> None:
    inputs = InputList(part=0, considered=(), dropped=())
    proof = FraudProof(claim(4, part=0, inputs_sha256=inputs.sha256()), inputs, ())
    assert FraudProof.decode(proof.encode()) == proof


def test_a_truncated_or_padded_fraud_proof_is_refused() -> None:
    data = fraud_proof().encode()
    for cut in (0, 1, 7):
        with refused("malformed", match="truncated"):
            FraudProof.decode(data[:cut])
    with refused("malformed", match="does not fit"):
        FraudProof.decode(data[:20])  # the header itself is cut
    for cut in (1, 100, 256):
        with refused("malformed", match="shorter than its sizes say"):
            FraudProof.decode(data[:-cut])
    for extra in (b"\x00", b"tail" * 10):
        with refused("malformed", match="trailing bytes"):
            FraudProof.decode(data + extra)


def test_an_oversized_fraud_proof_header_is_refused() -> None:
    data = fraud_proof().encode()
    (size,) = struct.unpack("<Q", data[:8])
    assert FraudProof.decode(data, max_header=size) == fraud_proof()
    with refused("malformed", match="does not fit"):
        FraudProof.decode(data, max_header=size - 1)
    for claimed in (len(data) - 7, 2**63, 2**64 - 1):
        with refused("malformed", match="does not fit"):
            FraudProof.decode(struct.pack("<Q", claimed) + data[8:])


@pytest.mark.parametrize(
    "sizes",
    [
        [[64, 9], [0, 0]],  # one entry short
        [[64, 9], [0, 0], [32, 256], [0, 0]],  # one entry too many
        "64,9",
        None,
    ],
)
def test_a_sizes_list_of_the_wrong_length_is_refused(sizes: Any) -> None:
    header, tail = split(fraud_proof().encode())
    with refused("malformed", match="one \\(proof, part\\) size per considered input"):
        FraudProof.decode(join(dict(header, sizes=sizes), tail))


@pytest.mark.parametrize(
    "entry", [[64], [64, 9, 0], [-1, 74], [64.0, 9], [True, 9], ["64", 9], {"proof": 64, "part": 9}, 73]
)
def test_a_sizes_entry_that_is_not_a_pair_of_counts_is_refused(entry: Any) -> None:
    header, tail = split(fraud_proof().encode())
    with refused("malformed", match="pairs of non-negative integers"):
        FraudProof.decode(join(dict(header, sizes=[entry, *header["sizes"][1:]]), tail))


def test_sizes_that_move_the_cut_between_parts_give_other_parts() -> None:
    """The sizes only cut the bytes: moved cuts decode, and check_fraud's Merkle check refuses them."""
    header, tail = split(fraud_proof().encode())
    moved = [[60, 13], *header["sizes"][1:]]
    back = FraudProof.decode(join(dict(header, sizes=moved), tail))
    assert (
        back.parts[0] == (b"\x01" * 60, b"\x01" * 4 + b"part zero")
        and back.parts[1:] == fraud_proof().parts[1:]
    )
    with refused("malformed", match="shorter than its sizes say"):
        FraudProof.decode(join(dict(header, sizes=[[2**62, 0], *header["sizes"][1:]]), tail))


@pytest.mark.parametrize(
    "header",
    [
        [],
        "claim",
        {"claim": {}, "inputs": {}},
        {"claim": {}, "inputs": {}, "sizes": [], "extra": 1},
    ],
)
def test_a_fraud_proof_header_of_another_shape_is_refused(header: Any) -> None:
    with refused("malformed"):
        FraudProof.decode(join(header, b""))


def test_a_fraud_proof_header_that_is_not_json_is_refused() -> None:
    raw = b"{not json"
    with refused("malformed", match="not JSON"):
        FraudProof.decode(struct.pack("<Q", len(raw)) + raw)
    raw = b"\xff\xfe"
    with refused("malformed", match="not UTF-8"):
        FraudProof.decode(struct.pack("<Q", len(raw)) + raw)


def test_a_fraud_proof_checks_its_claim_and_input_list() -> None:
    header, tail = split(fraud_proof().encode())
    with refused("malformed", match="fraud proof claim"):
        FraudProof.decode(join(dict(header, claim=dict(header["claim"], extra=1)), tail))
    unsorted = dict(header["inputs"], considered=list(reversed(header["inputs"]["considered"])))
    with refused("invalid", match="wallet order"):
        FraudProof.decode(join(dict(header, inputs=unsorted), tail))
