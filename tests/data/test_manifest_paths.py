"""Issue 19: every path and field a signed manifest names is checked before anything uses it.

A publisher's key signs the manifest, but a node must not trust it with its filesystem: the
tokenizer path "../../../../etc/passwd" was opened (and hashed) before the hash check refused
it. Each hostile manifest here is signed by the pinned key, so only the parser stands between
it and the disk."""

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from nacl.signing import SigningKey

import neuroshard.data.dataset as dataset_module
from neuroshard.data import ManifestError, open_dataset, read_manifest
from neuroshard.data.manifest import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    Manifest,
    check_relative_path,
    resolve_inside,
)


@pytest.fixture
def copy(published, tmp_path: Path) -> Path:
    target = tmp_path / "ds"
    shutil.copytree(published.directory, target)
    return target


def _write_signed(directory: Path, raw: bytes, key: SigningKey) -> None:
    (directory / MANIFEST_NAME).write_bytes(raw)
    (directory / SIGNATURE_NAME).write_bytes(key.sign(raw).signature.hex().encode())


def _doc(directory: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((directory / MANIFEST_NAME).read_bytes())
    return doc


def _resign(directory: Path, doc: Any, key: SigningKey) -> None:
    _write_signed(directory, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode(), key)


HOSTILE_PATHS = [
    "../../../../etc/passwd",
    "/etc/passwd",
    "tokenizers/../../outside.json",
    "..",
    ".",
    "",
    ".hidden.json",
    "tokenizers//x.json",
    "tokenizers/",
    "C:\\Windows\\win.ini",
    "..\\..\\outside.json",
    "%2e%2e/%2e%2e/etc/passwd",
    "tokenizer.json\x00.txt",
    "a/b/c/d/e.json",
    "x" * 200,
]


@pytest.mark.parametrize("path", HOSTILE_PATHS)
def test_hostile_tokenizer_path_is_refused_before_any_file_is_opened(
    copy: Path, published, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    doc = _doc(copy)
    doc["tokenizers"][-1]["file"] = path
    _resign(copy, doc, published.key)
    opened: list[Path] = []
    monkeypatch.setattr(dataset_module, "file_sha256", lambda p: opened.append(p) or "0" * 64)
    with pytest.raises(ManifestError, match="not a relative path of plain names"):
        open_dataset(copy, bytes(published.key.verify_key))
    assert opened == []


@pytest.mark.parametrize(
    "path", ["../shard_0.pt", "/tmp/shard_0.pt", "sub/shard_0.pt", ".shard_0.pt", "a\\b"]
)
def test_hostile_shard_names_are_refused(copy: Path, published, path: str) -> None:
    doc = _doc(copy)
    doc["shards"][0]["file"] = path
    _resign(copy, doc, published.key)
    with pytest.raises(ManifestError, match="plain"):
        read_manifest(copy, bytes(published.key.verify_key))


def test_a_symlink_out_of_the_data_set_is_not_followed(copy: Path, published, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    tokenizer_file = copy / _doc(copy)["tokenizers"][-1]["file"]
    shutil.move(tokenizer_file, outside / tokenizer_file.name)
    os.symlink(outside / tokenizer_file.name, tokenizer_file)
    with pytest.raises(ManifestError, match="leads outside"):
        open_dataset(copy, bytes(published.key.verify_key))


def test_the_published_layout_is_accepted(published) -> None:
    manifest = read_manifest(published.directory, bytes(published.key.verify_key))
    assert manifest.tokenizer.file.startswith("tokenizers/")
    path = resolve_inside(published.directory, manifest.tokenizer.file, "tokenizer file")
    assert path.is_file()
    assert check_relative_path("shard_12.pt", "shard") == "shard_12.pt"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["shards"][0].__setitem__("tokens", "20000"), "tokens must be an integer"),
        (lambda d: d["shards"][0].__setitem__("tokens", True), "tokens must be an integer"),
        (lambda d: d["shards"][0].__setitem__("tokens", 1.5), "tokens must be an integer"),
        (lambda d: d["shards"][0].__setitem__("sha256", "ZZ" * 32), "sha256 must be 64 lowercase hex"),
        (lambda d: d["tokenizers"][-1].__setitem__("sha256", "../x"), "sha256 must be 64 lowercase hex"),
        (lambda d: d["tokenizers"][-1].__setitem__("next_merge_id", [1]), "next_merge_id must be an integer"),
        (lambda d: d.__setitem__("version", 10**30), "version must be an integer"),
        (lambda d: d.__setitem__("shards", {"0": 1}), "shards must be a list"),
        (lambda d: d["shards"].__setitem__(0, "shard_0.pt"), r"shards\[0\] must be a JSON object"),
        (lambda d: d.pop("publisher"), "missing publisher"),
    ],
)
def test_wrongly_typed_fields_are_refused(copy: Path, published, mutate: Any, message: str) -> None:
    doc = _doc(copy)
    mutate(doc)
    _resign(copy, doc, published.key)
    with pytest.raises(ManifestError, match=message):
        read_manifest(copy, bytes(published.key.verify_key))


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"format":2,"format":2}', "duplicate JSON key 'format'"),
        (b"[1, 2, 3]", "must be a JSON object"),
        (b'{"format": NaN}', "JSON constant NaN"),
        (b"[" * 5000 + b"]" * 5000, "malformed"),
        (b'{"format": ' + b"9" * 5000 + b"}", "malformed"),
        (b"\xff\xfe", "malformed"),
    ],
)
def test_unparseable_signed_manifests_are_manifest_errors(
    copy: Path, published, raw: bytes, message: str
) -> None:
    _write_signed(copy, raw, published.key)
    with pytest.raises(ManifestError, match=message):
        read_manifest(copy, bytes(published.key.verify_key))


def test_canonical_bytes_round_trip(published) -> None:
    manifest = read_manifest(published.directory, bytes(published.key.verify_key))
    assert Manifest.from_bytes(manifest.to_bytes()) == manifest
