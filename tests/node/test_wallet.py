"""Token -> Ed25519 wallet: deterministic, signs and verifies, never holds or shows the token."""

import os
from pathlib import Path

import pytest

from neuroshard.node.wallet import TOKEN_ENV, TokenError, Wallet, resolve_token
from neuroshard.protocol.identity import verify, wallet_id_of

TOKEN = "correct horse battery staple 7f3a"


def test_same_token_same_wallet_different_token_different_wallet() -> None:
    a, b = Wallet.from_token(TOKEN), Wallet.from_token(TOKEN)
    assert a.public_key == b.public_key and a.wallet_id == b.wallet_id
    assert Wallet.from_token(TOKEN + "!").public_key != a.public_key
    assert len(a.wallet_id) == 20 and a.wallet_id == wallet_id_of(a.public_key)


def test_sign_and_verify() -> None:
    w = Wallet.from_token(TOKEN)
    sig = w.sign(b"round 3")
    assert verify(w.public_key, b"round 3", sig)
    assert not verify(w.public_key, b"round 4", sig)
    assert not verify(Wallet.from_token("other").public_key, b"round 3", sig)
    assert not verify(w.public_key, b"round 3", sig[:-1])


def test_wallet_never_exposes_the_token() -> None:
    w = Wallet.from_token(TOKEN)
    shown = repr(w) + str(w) + str(vars(w) if hasattr(w, "__dict__") else "")
    assert TOKEN not in shown and w.wallet_id in repr(w)
    assert TOKEN.encode() not in w.public_key


def test_token_sources_in_order(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("from-file\n")
    os.chmod(f, 0o600)
    assert resolve_token("from-flag", f, {TOKEN_ENV: "from-env"}) == "from-flag"
    assert resolve_token(None, f, {TOKEN_ENV: "from-env"}) == "from-file"
    assert resolve_token(None, None, {TOKEN_ENV: "from-env"}) == "from-env"
    with pytest.raises(TokenError, match="no token"):
        resolve_token(None, None, {})


def test_token_file_readable_by_others_is_refused_without_echoing_it(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(TOKEN)
    os.chmod(f, 0o644)
    with pytest.raises(TokenError, match="chmod 600") as err:
        resolve_token(None, f, {})
    assert TOKEN not in str(err.value)


def test_empty_token_is_refused() -> None:
    with pytest.raises(TokenError, match="empty"):
        Wallet.from_token("")
