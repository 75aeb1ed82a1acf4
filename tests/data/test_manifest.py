"""The manifest is trusted only when the pinned publisher signed exactly its bytes."""

import json
import shutil
from pathlib import Path

import pytest
from nacl.signing import SigningKey

from neuroshard.data import ManifestError, open_dataset, read_manifest
from neuroshard.data.manifest import MANIFEST_NAME, SIGNATURE_NAME


@pytest.fixture
def copy(published, tmp_path: Path) -> Path:
    target = tmp_path / "ds"
    shutil.copytree(published.directory, target)
    return target


def test_good_manifest_verifies_and_lists_shards(published) -> None:
    manifest = read_manifest(published.directory, bytes(published.key.verify_key))
    assert manifest.total_shards >= 3
    assert [s.id for s in manifest.shards] == list(range(manifest.total_shards))
    assert manifest.tokenizer.next_merge_id == published.dataset.tokenizer.next_merge_id == 512
    assert manifest.publisher == published.public_key_hex


def test_wrong_publisher_key_is_refused(published) -> None:
    stranger = bytes(SigningKey(bytes(32)).verify_key)
    with pytest.raises(ManifestError, match="does not verify against the pinned publisher key"):
        read_manifest(published.directory, stranger)


def test_tampered_manifest_is_refused(copy: Path, published) -> None:
    doc = json.loads((copy / MANIFEST_NAME).read_bytes())
    doc["shards"][0]["sha256"] = "0" * 64
    (copy / MANIFEST_NAME).write_bytes(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    with pytest.raises(ManifestError, match="does not verify"):
        read_manifest(copy, bytes(published.key.verify_key))


def test_manifest_resigned_by_another_key_is_refused(copy: Path, published) -> None:
    attacker = SigningKey(bytes([7] * 32))
    raw = (copy / MANIFEST_NAME).read_bytes()
    (copy / SIGNATURE_NAME).write_bytes(attacker.sign(raw).signature.hex().encode())
    with pytest.raises(ManifestError, match="does not verify"):
        read_manifest(copy, bytes(published.key.verify_key))


def test_missing_signature_and_garbage_signature(copy: Path, published) -> None:
    (copy / SIGNATURE_NAME).write_bytes(b"not hex at all")
    with pytest.raises(ManifestError, match="not hex"):
        read_manifest(copy, bytes(published.key.verify_key))
    (copy / SIGNATURE_NAME).unlink()
    with pytest.raises(ManifestError, match=r"manifest\.json\.sig is missing"):
        read_manifest(copy, bytes(published.key.verify_key))


def test_tokenizer_that_does_not_match_the_manifest_is_refused(copy: Path, published) -> None:
    tok = copy / published.dataset.manifest.tokenizer.file
    tok.write_bytes(tok.read_bytes().replace(b"}", b" }", 1))
    with pytest.raises(ManifestError, match="different tokenizer"):
        open_dataset(copy, bytes(published.key.verify_key))
