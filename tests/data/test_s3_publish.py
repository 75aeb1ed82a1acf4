"""Publishing to a real S3-compatible HTTP endpoint (moto in server mode) on loopback.

Every request goes over HTTP to 127.0.0.1; a boto3 event hook records which objects were
PUT, in the order their uploads completed, and can make one upload fail.
"""

from __future__ import annotations

import hashlib
import io
import socket
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from botocore.exceptions import EndpointConnectionError
from tests_support import small_corpus

from neuroshard.cli.publish_shards import main as publish_shards_main
from neuroshard.cli.publish_tokenizer import main as publish_tokenizer_main
from neuroshard.data import ManifestError
from neuroshard.data.manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest, verify_manifest
from neuroshard.data.publish import TOKENIZER_NAME, PublishProgress, publish_shards
from neuroshard.data.storage import IMMUTABLE_CACHE, MUTABLE_CACHE, S3Store, StoreError, open_store, s3_client
from neuroshard.tokenizer import BPETokenizer

SHARD_TOKENS = 5_000


pytestmark = pytest.mark.usefixtures("aws_env")


@pytest.fixture
def bucket(endpoint: str) -> str:
    name = f"ns-{uuid.uuid4().hex[:12]}"
    store = open_store_unchecked(name, endpoint)
    store.client.create_bucket(Bucket=name)
    return name


def open_store_unchecked(bucket: str, endpoint: str) -> S3Store:
    """An S3Store for a bucket that may not exist yet (open_store checks it exists)."""
    return S3Store(bucket=bucket, prefix="ds", client=s3_client(endpoint), endpoint_url=endpoint)


class Puts:
    """Records completed PutObject keys (relative to the store prefix), in completion order;
    can make the PUT of one object fail as a dropped connection would."""

    def __init__(self, store: S3Store, fail_on: str | None = None) -> None:
        self.keys: list[str] = []
        self.fail_on = fail_on
        self._prefix = store.key("")
        events = store.client.meta.events
        events.register("before-parameter-build.s3.PutObject", self._before)
        events.register("after-call.s3.PutObject", self._after)

    def _before(self, params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        name = params["Key"].removeprefix(self._prefix)
        if name == self.fail_on:
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1 (injected)")
        context["neuroshard_name"] = name

    def _after(self, context: dict[str, Any], **_: Any) -> None:
        self.keys.append(context["neuroshard_name"])

    def shards(self) -> list[str]:
        return sorted(k for k in self.keys if k.startswith("shard_"))


@pytest.fixture
def store(bucket: str, endpoint: str, published) -> S3Store:
    """The bucket's ds/ prefix, holding the `published` data set's tokenizer.json."""
    opened = open_store(f"s3://{bucket}/ds", endpoint)
    assert isinstance(opened, S3Store)
    opened.put_bytes(TOKENIZER_NAME, (published.directory / TOKENIZER_NAME).read_bytes())
    return opened


def read_signed(store: S3Store, published) -> Manifest:
    raw, sig = store.get_bytes(MANIFEST_NAME), store.get_bytes(SIGNATURE_NAME)
    assert raw is not None and sig is not None
    return verify_manifest(raw, sig, bytes(published.key.verify_key), "test")


def object_keys(store: S3Store) -> set[str]:
    listing = store.client.list_objects_v2(Bucket=store.bucket, Prefix=store.key(""))
    return {o["Key"].removeprefix(store.key("")) for o in listing.get("Contents", [])}


def test_clis_publish_tokenizer_and_shards_to_s3(
    bucket: str, endpoint: str, published, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(small_corpus(80_000)), encoding="utf-8")
    key_file = tmp_path / "publisher.key"
    key_file.write_text(bytes(published.key).hex(), encoding="ascii")
    out = ["--out", f"s3://{bucket}/ds", "--endpoint-url", endpoint]
    assert publish_tokenizer_main(["--input", str(text), *out, "--vocab-size", "300"]) == 0
    assert publish_tokenizer_main(["--input", str(text), *out, "--extend", "20"]) == 0
    argv = ["--input", str(text), *out, "--key-file", str(key_file), "--shard-tokens", "5000"]
    assert publish_shards_main([*argv, "--workers", "3"]) == 0
    stdout, stderr = capsys.readouterr()
    assert "MB/s, ETA" in stderr  # the tqdm progress line
    assert f"wrote s3://{bucket}/ds/tokenizer.json: vocab_size=320" in stdout
    assert "published version 1:" in stdout and f"to s3://{bucket}/ds in" in stdout

    store = open_store_unchecked(bucket, endpoint)
    manifest = read_signed(store, published)
    assert manifest.version == 1 and manifest.tokenizer.next_merge_id == 320
    assert object_keys(store) == {
        TOKENIZER_NAME,
        MANIFEST_NAME,
        SIGNATURE_NAME,
        manifest.tokenizer.file,
        *(s.file for s in manifest.shards),
    }
    for info in manifest.shards:
        head = store.client.head_object(Bucket=bucket, Key=store.key(info.file))
        body = store.get_bytes(info.file)
        assert body is not None and hashlib.sha256(body).hexdigest() == info.sha256
        assert head["Metadata"]["sha256"] == info.sha256
        assert (head["ContentType"], head["CacheControl"]) == ("application/octet-stream", IMMUTABLE_CACHE)
        tokens = torch.load(io.BytesIO(body), weights_only=True)
        assert tokens.dtype == torch.int32 and tokens.shape == (info.tokens,)
    head = store.client.head_object(Bucket=bucket, Key=store.key(MANIFEST_NAME))
    assert (head["ContentType"], head["CacheControl"]) == ("application/json", MUTABLE_CACHE)
    head = store.client.head_object(Bucket=bucket, Key=store.key(manifest.tokenizer.file))
    assert head["CacheControl"] == IMMUTABLE_CACHE and head["Metadata"]["sha256"] == manifest.tokenizer.sha256
    assert BPETokenizer.from_bytes(store.get_bytes(manifest.tokenizer.file) or b"").vocab_size == 320


def test_manifest_is_the_last_object_written(store: S3Store, published) -> None:
    puts = Puts(store)
    progress: list[PublishProgress] = []
    manifest = publish_shards(
        small_corpus(60_000),
        out=store,
        key=published.key,
        shard_tokens=SHARD_TOKENS,
        on_progress=progress.append,
    )
    assert manifest.total_shards >= 4
    assert puts.keys[-2:] == [SIGNATURE_NAME, MANIFEST_NAME]
    assert puts.keys[0] == manifest.tokenizer.file
    assert puts.shards() == sorted(s.file for s in manifest.shards)
    assert progress[-1].shards_done == progress[-1].shards_total == manifest.total_shards
    assert progress[-1].bytes_uploaded > 4 * sum(s.tokens for s in manifest.shards)
    assert [p.shards_done for p in progress] == sorted(p.shards_done for p in progress)


def test_a_failed_upload_leaves_no_manifest_and_the_rerun_uploads_only_what_is_missing(
    store: S3Store, published
) -> None:
    docs = small_corpus(60_000)
    failing = Puts(store, fail_on="shard_2.pt")
    with pytest.raises(StoreError, match=r"cannot write s3://.*/ds/shard_2\.pt .*endpoint unreachable"):
        publish_shards(docs, out=store, key=published.key, shard_tokens=SHARD_TOKENS, workers=2)
    assert MANIFEST_NAME not in object_keys(store) and SIGNATURE_NAME not in object_keys(store)
    survivors = failing.shards()
    assert "shard_2.pt" not in survivors and "shard_0.pt" in survivors

    failing.fail_on = None
    rerun = Puts(store)
    progress: list[PublishProgress] = []
    manifest = publish_shards(
        docs, out=store, key=published.key, shard_tokens=SHARD_TOKENS, workers=2, on_progress=progress.append
    )
    uploaded = set(rerun.shards())
    assert uploaded == {s.file for s in manifest.shards} - set(survivors)
    assert progress[-1].shards_skipped == len(survivors)
    assert read_signed(store, published) == manifest and manifest.version == 1


def test_a_rerun_after_every_shard_was_stored_uploads_only_the_manifest(store: S3Store, published) -> None:
    docs = small_corpus(60_000)
    failing = Puts(store, fail_on=SIGNATURE_NAME)
    with pytest.raises(StoreError, match=r"manifest\.json\.sig"):
        publish_shards(docs, out=store, key=published.key, shard_tokens=SHARD_TOKENS)
    assert MANIFEST_NAME not in object_keys(store) and len(failing.shards()) >= 4
    failing.fail_on = None
    rerun = Puts(store)
    manifest = publish_shards(docs, out=store, key=published.key, shard_tokens=SHARD_TOKENS)
    assert rerun.keys == [SIGNATURE_NAME, MANIFEST_NAME]
    assert read_signed(store, published) == manifest


def test_append_publishes_version_2_and_leaves_old_shards_untouched(store: S3Store, published) -> None:
    first = publish_shards(small_corpus(40_000), out=store, key=published.key, shard_tokens=SHARD_TOKENS)
    etags = {
        s.file: store.client.head_object(Bucket=store.bucket, Key=store.key(s.file))["ETag"]
        for s in first.shards
    }
    puts = Puts(store)
    second = publish_shards(small_corpus(70_000)[5:], out=store, key=published.key, shard_tokens=SHARD_TOKENS)
    assert second.version == 2 and second.shards[: first.total_shards] == first.shards
    assert second.total_shards > first.total_shards
    assert set(puts.shards()) == {s.file for s in second.shards[first.total_shards :]}
    assert all(
        store.client.head_object(Bucket=store.bucket, Key=store.key(f))["ETag"] == etag
        for f, etag in etags.items()
    )
    assert read_signed(store, published) == second


def test_an_object_replaced_behind_our_back_is_uploaded_again(store: S3Store) -> None:
    store.put_bytes("shard_0.pt", b"original", immutable=True)
    assert store.sha256_of("shard_0.pt") == hashlib.sha256(b"original").hexdigest()
    # Another tool rewrites the bytes but copies our metadata: the ETag no longer matches the recorded MD5.
    head = store.client.head_object(Bucket=store.bucket, Key=store.key("shard_0.pt"))
    store.client.put_object(
        Bucket=store.bucket, Key=store.key("shard_0.pt"), Body=b"changed", Metadata=head["Metadata"]
    )
    assert store.sha256_of("shard_0.pt") is None
    assert store.sha256_of("shard_9.pt") is None and store.get_bytes("shard_9.pt") is None


def test_a_manifest_signed_by_another_key_is_refused(store: S3Store, published) -> None:
    from nacl.signing import SigningKey

    publish_shards(small_corpus(30_000), out=store, key=SigningKey(bytes(32)), shard_tokens=SHARD_TOKENS)
    with pytest.raises(ManifestError, match="does not verify against the pinned publisher key"):
        publish_shards(small_corpus(30_000), out=store, key=published.key, shard_tokens=SHARD_TOKENS)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("problem", ["missing bucket", "endpoint down", "no credentials"])
def test_storage_problems_are_one_line_and_exit_2(
    problem: str,
    endpoint: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("some text " * 100, encoding="utf-8")
    url = endpoint
    if problem == "endpoint down":
        url = f"http://127.0.0.1:{_closed_port()}"
    if problem == "no credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    out = ["--out", "s3://no-such-bucket/ds", "--endpoint-url", url]
    shards_argv = ["--input", str(text), *out, "--key-file", str(tmp_path / "k")]
    expected = {
        "missing bucket": "bucket 'no-such-bucket' does not exist",
        "endpoint down": "endpoint unreachable",
        "no credentials": "no AWS credentials found",
    }[problem]
    for main, argv in [
        (publish_shards_main, shards_argv),
        (publish_tokenizer_main, ["--input", str(text), *out]),
    ]:
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.err.count("\n") == 1 and expected in captured.err, captured.err
        assert "Traceback" not in captured.err and captured.out == ""
    assert not (tmp_path / "k").exists()  # the store is checked before a publisher key is created


def test_endpoint_url_needs_an_s3_destination(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="applies only to s3:// destinations"):
        open_store(str(tmp_path), "http://127.0.0.1:9")
