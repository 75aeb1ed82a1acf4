import os
from pathlib import Path

import pytest

from neuroshard.node.wallet import Wallet
from neuroshard.testing.verifier import small_network
from neuroshard.verifier.network import (
    NetworkError,
    load_network,
    load_operator_key,
    parse_network,
    sign_network,
    verify_network,
)

TOML = """
name = "demo"

[model]
size = "tiny"
vocab_size = 4096

[stages]
count = 2

[diloco]
inner_steps = 100
betas = [0.9, 0.99]

[training]
batch_size = 8
seq_len = 128

[aggregation]
rule = "trimmed_mean"
f = 1

[data]
manifest_url = "https://cdn.example.org/ns/"
publisher_key = "%s"
""" % ("cd" * 32)


def test_load_network_toml(tmp_path: Path) -> None:
    path = tmp_path / "network.toml"
    path.write_text(TOML)
    net = load_network(path)
    assert net.name == "demo"
    assert net.model.dim == 128 and net.model.vocab_size == 4096
    assert net.num_stages == 2
    assert net.diloco.inner_steps == 100 and net.diloco.betas == (0.9, 0.99)
    assert (net.aggregation_rule, net.aggregation_f) == ("trimmed_mean", 1)
    assert net.evaluate_every_rounds == 5


def test_signed_document_round_trips() -> None:
    net = small_network()
    operator = Wallet.from_token("operator")
    body, signature = sign_network(net, operator)
    assert verify_network(body, signature, operator.public_key) == net
    with pytest.raises(NetworkError, match="not signed by the operator"):
        verify_network(body.replace(b'"test"', b'"evil"'), signature, operator.public_key)
    with pytest.raises(NetworkError, match="not signed by the operator"):
        verify_network(body, signature, Wallet.from_token("other").public_key)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"colour": {}}, "unknown top-level keys"),
        ({"model": {"size": "huge", "vocab_size": 10}}, "size 'huge'"),
        ({"model": {"size": "tiny", "vocab_size": 512, "n_heads": 3}}, "divisible"),
        ({"stages": {"count": 9}}, "count 9"),
        ({"diloco": {"inner_stepz": 3}}, "unknown keys"),
        ({"diloco": {"outer_lr": -1.0}}, "outer_lr"),
        ({"training": {"batch_size": 2, "seq_len": 100_000}}, "seq_len"),
        ({"aggregation": {"rule": "vibes"}}, "rule 'vibes'"),
        ({"data": {"manifest_url": "x", "publisher_key": "nothex"}}, "publisher_key"),
        ({"evaluation": {"every_rounds": 0}}, "every_rounds"),
    ],
)
def test_bad_definitions_say_what_and_where(patch: dict[str, object], message: str) -> None:
    doc: dict[str, object] = {
        "model": {"size": "tiny", "vocab_size": 512},
        "data": {"manifest_url": "x", "publisher_key": "ab" * 32},
    }
    doc.update(patch)
    with pytest.raises(NetworkError, match=message):
        parse_network(doc)


def test_unreadable_or_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(NetworkError, match="cannot read"):
        load_network(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = ")
    with pytest.raises(NetworkError, match="not valid TOML"):
        load_network(bad)


def test_operator_key_file(tmp_path: Path) -> None:
    path = tmp_path / "operator.key"
    with pytest.raises(NetworkError, match="does not exist"):
        load_operator_key(path)
    created = load_operator_key(path, create=True)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert load_operator_key(path).public_key_hex == created.public_key_hex
    path.chmod(0o644)
    with pytest.raises(NetworkError, match="readable by other users"):
        load_operator_key(path)
    path.write_text("not a key")
    path.chmod(0o600)
    with pytest.raises(NetworkError, match="64 hex"):
        load_operator_key(path)
