"""Property: every JSON decoder of the peer plane answers any input with its message or a
Refused (HTTP 400/422), nothing else. Inputs: raw bytes, arbitrary JSON, hostile JSON text
(deep nesting, 5,000-digit integers, 1e999, NaN, duplicate keys), each message's own field set
filled with plausible and random values, and valid messages with one field broken."""

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuroshard.node.p2p.auth import status_of
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.peer import ErrorReply, PeerList, PeerRecord, StateInfo
from neuroshard.protocol.pipeline import ActivationHeader, GradientReply, PipelineEnd
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.roster import MemberList, Roster, RosterStage
from neuroshard.protocol.round import (
    AggregateClaim,
    Dropped,
    Echo,
    EquivocationProof,
    InputList,
    RoundCommitment,
    RoundDigest,
)
from neuroshard.protocol.schema import Message, Signed, parse_json

EXAMPLES = 80
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
SIGNER = Wallet.from_token("fuzz-peer")

MESSAGES: list[type[Message]] = [
    PeerRecord,
    PeerList,
    StateInfo,
    ErrorReply,
    RoundCommitment,
    Dropped,
    InputList,
    AggregateClaim,
    Echo,
    RoundDigest,
    EquivocationProof,
    ActivationHeader,
    GradientReply,
    PipelineEnd,
    Roster,
    RosterStage,
    MemberList,
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=24)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
plausible = st.one_of(
    st.text("0123456789abcdef", min_size=64, max_size=64),
    st.text("0123456789abcdef", min_size=128, max_size=128),
    st.sampled_from(["", "fp16", "int8", "127.0.0.1:7001", "[::1]:7001", SIGNER.public_key_hex]),
    st.integers(min_value=-2, max_value=2**64),
    st.floats(min_value=-1.0, max_value=2.0**41, allow_nan=False),
    st.lists(st.integers(min_value=-1, max_value=5000), max_size=4),
    json_values,
)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


hostile_text = st.one_of(
    st.integers(min_value=500, max_value=20_000).map(_nested),
    st.integers(min_value=4_300, max_value=6_000).map(lambda n: '{"round": ' + "7" * n + "}"),
    st.sampled_from(
        ['{"round": 1e999}', '{"round": -1e999}', '{"x": NaN}', '{"x": Infinity}', '{"a":1,"a":1}']
    ),
)


def _decode(cls: type[Message], data: bytes) -> int:
    """The status a peer would answer `data` with; signatures of parsed messages checked too."""
    try:
        made = cls.from_json(data)
    except Refused as exc:
        return status_of(exc.code)
    if isinstance(made, Signed):
        assert made.signature_valid() in (True, False)
    return 200


def _record(tally: Any, cls: type[Message], data: bytes, label: str) -> None:
    try:
        status = _decode(cls, data)
    except Exception:
        tally.add(f"peer {cls.NAME} ({label})", 500)
        raise
    tally.add(f"peer {cls.NAME} ({label})", status)


def _with_duplicate(obj: dict[str, Any], key: str, value: Any) -> bytes:
    body = json.dumps(obj)
    return (body[:-1] + (", " if obj else "") + f"{json.dumps(key)}: {json.dumps(value)}}}").encode()


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.NAME)
def test_any_bytes_or_json_is_a_message_or_a_wire_error(cls: type[Message], tally: Any) -> None:
    @FUZZ
    @given(
        data=st.one_of(
            st.binary(max_size=300),
            json_values.map(lambda v: json.dumps(v).encode()),
            hostile_text.map(str.encode),
        )
    )
    def run(data: bytes) -> None:
        _record(tally, cls, data, "any input")

    run()


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.NAME)
def test_the_schema_filled_at_random_is_a_message_or_a_wire_error(cls: type[Message], tally: Any) -> None:
    @FUZZ
    @given(
        values=st.fixed_dictionaries({name: plausible for name in cls.fields_spec()}),
        drop=st.sampled_from([None, *cls.fields_spec()]),
        extra=st.none() | st.tuples(st.text(max_size=8), json_values),
        duplicate=st.none() | st.tuples(st.sampled_from(list(cls.fields_spec())), plausible),
    )
    def run(
        values: dict[str, Any],
        drop: str | None,
        extra: tuple[str, Any] | None,
        duplicate: tuple[str, Any] | None,
    ) -> None:
        if drop is not None:
            values.pop(drop)
        if extra is not None:
            values[extra[0]] = extra[1]
        data = _with_duplicate(values, *duplicate) if duplicate else json.dumps(values).encode()
        _record(tally, cls, data, "schema")

    run()


def _valid_messages() -> list[Message]:
    record = PeerRecord.create(SIGNER, address="127.0.0.1:7001", stage=0, last_seen=1.7e9)
    return [
        record,
        PeerList(peers=(record,)),
        StateInfo.create(SIGNER, stage=1, round=3, theta_hash="a" * 64, momentum_hash="", numel=1000),
        ErrorReply(error="bad", detail="a sentence"),
        PipelineEnd.create(SIGNER, stage=0, round=8, step=160),
        Roster.build(SIGNER, network="n", version=3, expires_at=2**40, stages={0: [SIGNER.public_key_hex]}),
        MemberList.create(
            SIGNER,
            network="n",
            expires_at=2**40,
            stage=0,
            epoch=4,
            effective_round=9,
            policy="probation",
            admitted=(SIGNER.public_key_hex,),
            probation=("ab" * 32,),
            admission_rounds=3,
        ),
    ]


@pytest.mark.parametrize("valid", _valid_messages(), ids=lambda m: m.NAME)
def test_a_valid_message_with_one_field_broken_is_refused(valid: Message, tally: Any) -> None:
    obj = valid.to_obj()
    assert type(valid).from_json(valid.to_json()) == valid

    @FUZZ
    @given(
        field=st.sampled_from(sorted(obj)),
        value=plausible | hostile_text.map(lambda text: {"raw": text}),
        how=st.sampled_from(["replace", "duplicate"]),
    )
    def run(field: str, value: Any, how: str) -> None:
        if how == "duplicate":
            data = _with_duplicate(obj, field, value)
        elif isinstance(value, dict) and set(value) == {"raw"}:
            data = (
                json.dumps({**obj, field: 0}).replace(f'"{field}": 0', f'"{field}": {value["raw"]}').encode()
            )
        else:
            data = json.dumps({**obj, field: value}).encode()
        try:
            status = _decode(type(valid), data)
        except Exception:
            tally.add(f"peer {valid.NAME} (one field broken)", 500)
            raise
        tally.add(f"peer {valid.NAME} (one field broken)", status)
        if how == "duplicate":
            assert status == 400  # refused whatever the value: the rule is the key, not the value

    run()


def test_parse_json_raises_only_malformed(tally: Any) -> None:
    @FUZZ
    @given(
        data=st.binary(max_size=200) | hostile_text.map(str.encode) | st.text(max_size=200).map(str.encode)
    )
    def run(data: bytes) -> None:
        try:
            parse_json(data, "body")
            tally.add("peer parse_json", 200)
        except Refused as exc:
            tally.add("peer parse_json", status_of(exc.code))
        except Exception:
            tally.add("peer parse_json", 500)
            raise

    run()
