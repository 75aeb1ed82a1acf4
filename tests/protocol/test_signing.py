"""Signed requests (protocol/signing.py): one signing and one check for peers and the verifier."""

import hashlib

import pytest
from tests_support import refused

from neuroshard.node.wallet import Wallet
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.signing import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WALLET_HEADER,
    NonceCache,
    request_signing_bytes,
    sign_request,
    verify_request,
)

NOW = 1_700_000_000.0
WALLET = Wallet.from_token("auth-test")
BODY = b'{"a":1}'


def signed(body: bytes = BODY) -> dict[str, str]:
    return sign_request(WALLET, "POST", "/api/receipts", body, now=NOW)


def test_message_is_the_peer_planes_request_bytes() -> None:
    message = request_signing_bytes(
        "post", "/api/x", hashlib.sha256(b"hello").hexdigest(), "12000", "ab" * 16
    )
    expected = "\n".join(["POST", "/api/x", hashlib.sha256(b"hello").hexdigest(), "12000", "ab" * 16])
    assert message == b"neuroshard/request/v1\n" + expected.encode()


def test_a_request_signed_by_the_node_client_verifies() -> None:
    headers = sign_request(WALLET, "POST", "/api/receipts", BODY, NOW)
    who = verify_request(headers, "POST", "/api/receipts", BODY, now=NOW + 5)
    assert who.public_key_hex == WALLET.public_key_hex
    assert who.wallet_id == WALLET.wallet_id
    assert who.timestamp == NOW
    assert headers[TIMESTAMP_HEADER] == str(int(NOW * 1000))


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [("PUT", "/api/receipts", BODY), ("POST", "/api/register", BODY), ("POST", "/api/receipts", b'{"a":2}')],
)
def test_any_change_to_method_path_or_body_breaks_the_signature(method: str, path: str, body: bytes) -> None:
    with pytest.raises(Refused, match="bad signature") as err:
        verify_request(signed(), method, path, body, now=NOW)
    assert err.value.code == "bad_signature"


def test_swapping_in_another_wallet_key_is_forgery() -> None:
    headers = signed()
    headers[WALLET_HEADER] = Wallet.from_token("someone else").public_key_hex
    with pytest.raises(Refused, match="bad signature"):
        verify_request(headers, "POST", "/api/receipts", BODY, now=NOW)


def test_changing_the_timestamp_or_nonce_breaks_the_signature() -> None:
    for header, value in ((TIMESTAMP_HEADER, str(int(NOW * 1000) + 1)), (NONCE_HEADER, "00" * 16)):
        headers = signed()
        headers[header] = value
        with pytest.raises(Refused, match="bad signature"):
            verify_request(headers, "POST", "/api/receipts", BODY, now=NOW)


@pytest.mark.parametrize("skew", [-61, 61, 10_000])
def test_stale_or_future_timestamps_are_refused(skew: int) -> None:
    with refused("stale", match="stale request"):
        verify_request(signed(), "POST", "/api/receipts", BODY, now=NOW + skew, window_s=60)


def test_edge_of_the_window_is_accepted() -> None:
    verify_request(signed(), "POST", "/api/receipts", BODY, now=NOW + 60, window_s=60)


@pytest.mark.parametrize("missing", [WALLET_HEADER, TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER])
def test_each_header_is_required(missing: str) -> None:
    headers = signed()
    del headers[missing]
    with refused("unsigned", match=rf"missing auth header\(s\) {missing}"):
        verify_request(headers, "POST", "/api/receipts", BODY, now=NOW)


@pytest.mark.parametrize(
    ("header", "value"),
    [
        (WALLET_HEADER, "zz" * 32),
        (WALLET_HEADER, "AB" * 32),
        (TIMESTAMP_HEADER, "-5"),
        (TIMESTAMP_HEADER, "1e9"),
        (NONCE_HEADER, "abc"),
        (NONCE_HEADER, "ab" * 24),
        (NONCE_HEADER, "g" * 32),
        (SIGNATURE_HEADER, "00" * 10),
    ],
)
def test_malformed_headers_are_refused_before_any_crypto(header: str, value: str) -> None:
    headers = signed()
    headers[header] = value
    with refused("bad_auth", match=f"{header} must be"):
        verify_request(headers, "POST", "/api/receipts", BODY, now=NOW)


def test_fresh_nonce_per_request() -> None:
    assert signed()[NONCE_HEADER] != signed()[NONCE_HEADER]


def test_nonce_cache_refuses_a_replay_and_says_busy_when_full() -> None:
    cache = NonceCache(window_s=60.0, max_entries=1)
    assert cache.add("w", "n1", NOW, NOW)
    assert not cache.add("w", "n1", NOW, NOW + 1)
    with refused("busy"):
        cache.add("w", "n2", NOW, NOW + 1)
    assert cache.add("w", "n2", NOW, NOW + 61)  # n1 expired at NOW + 60: room again


def test_a_signed_message_built_from_an_int_for_a_number_field_verifies() -> None:
    """`Signed.create` signs the values as the wire carries them: an int loss becomes the float
    1.0 in the JSON, and the signature must be over that, not over 1."""
    from neuroshard.node.wallet import Wallet
    from neuroshard.protocol.pipeline import GradientReply

    wallet = Wallet.from_token("schema-int-number")
    reply = GradientReply.create(
        wallet, to="ab" * 32, micro_batch="cd" * 16, stage=1, round=0, loss=1, codec="int8",
        payload_sha256="ef" * 32,
    )  # fmt: skip
    assert reply.signature_valid()
    assert GradientReply.from_json(reply.to_json()).signature_valid()
