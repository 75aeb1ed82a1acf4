"""Where publishers write: a local directory or an S3-compatible bucket, behind one small protocol.

Objects are named by plain relative names ("shard_3.pt", "tokenizers/<sha256>.json"). Every
store records each object's sha256 when it writes it, so a publisher that re-runs after a
crash can ask `sha256_of(name)` and skip what is already there.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError

from .files import atomic_write, file_sha256

IMMUTABLE_CACHE = "public, max-age=31536000, immutable"
"""For objects whose name never gets other bytes (shards, content-addressed tokenizers): a CDN keeps them."""
MUTABLE_CACHE = "no-cache"
"""For manifest.json(.sig) and tokenizer.json. A max-age would let a CDN serve a new signature with an
old manifest (or the reverse) for that long; no-cache makes it revalidate by ETag, which costs a 304."""
MAX_CONNECTIONS = 32
"""HTTP connections one S3 client keeps; publishers must not run more upload threads than this."""
_S3_CONFIG = Config(
    # Since boto3 1.36 every PutObject carries a CRC32 trailer by default, which several S3-compatible
    # stores reject; we send Content-MD5 ourselves, which all of them check.
    request_checksum_calculation="when_required",
    response_checksum_validation="when_required",
    retries={"mode": "standard", "max_attempts": 4},
    connect_timeout=5,
    read_timeout=60,
    max_pool_connections=MAX_CONNECTIONS,
)


class StoreError(RuntimeError):
    """Storage that cannot be used: no credentials, no bucket, endpoint down, request refused."""


class Store(Protocol):
    """A flat namespace of immutable-or-replaced-whole objects."""

    def get_bytes(self, name: str) -> bytes | None:
        """The object's bytes, or None when there is no such object."""
        ...

    def put_bytes(self, name: str, data: bytes, *, immutable: bool = False) -> None:
        """Write the object whole (readers never see part of it) with its sha256 recorded.

        `immutable` promises these bytes will never be replaced, so caches may keep them forever.
        """
        ...

    def sha256_of(self, name: str) -> str | None:
        """Hex sha256 of the stored object, or None when it is missing or its hash is not known."""
        ...

    def describe(self, name: str = "") -> str:
        """Where an object (or, without a name, the store) lives, for messages: a path or s3:// URL."""
        ...


class LocalStore:
    """A directory; each object is a file written atomically (temp file, fsync, rename)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def get_bytes(self, name: str) -> bytes | None:
        try:
            return (self.directory / name).read_bytes()
        except FileNotFoundError:
            return None

    def put_bytes(self, name: str, data: bytes, *, immutable: bool = False) -> None:
        atomic_write(self.directory / name, lambda p: p.write_bytes(data))

    def sha256_of(self, name: str) -> str | None:
        # Re-hashing a local file is cheap next to regenerating it, and cannot be fooled by a stale record.
        path = self.directory / name
        return file_sha256(path) if path.is_file() else None

    def describe(self, name: str = "") -> str:
        return str(self.directory / name) if name else str(self.directory)


class S3Store:
    """Objects under `prefix/` in an S3 bucket (AWS or any S3-compatible endpoint).

    Each object carries its sha256 and MD5 in user metadata (x-amz-meta-sha256, x-amz-meta-md5).
    The upload sends Content-MD5, so the server rejects a body damaged in transit; `sha256_of`
    is one HEAD request and trusts the recorded sha256 only while the object's ETag still equals
    the recorded MD5 (an object replaced by another tool has a different ETag).
    """

    def __init__(self, *, bucket: str, prefix: str, client: Any, endpoint_url: str | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.client = client
        self.endpoint_url = endpoint_url

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def describe(self, name: str = "") -> str:
        return f"s3://{self.bucket}/{self.key(name)}".rstrip("/")

    def check_bucket(self) -> None:
        """Fail now, with one clear line, if the bucket cannot be reached (before hours of tokenizing)."""
        with self._errors("open"):
            self.client.head_bucket(Bucket=self.bucket)

    def get_bytes(self, name: str) -> bytes | None:
        with self._errors("read", name):
            response = self._unless_missing(self.client.get_object, name)
            data: bytes | None = None if response is None else response["Body"].read()
            return data

    def put_bytes(self, name: str, data: bytes, *, immutable: bool = False) -> None:
        md5 = hashlib.md5(data, usedforsecurity=False)
        with self._errors("write", name):
            self.client.put_object(
                Bucket=self.bucket,
                Key=self.key(name),
                Body=data,
                ContentMD5=base64.b64encode(md5.digest()).decode("ascii"),
                ContentType=content_type(name),
                CacheControl=IMMUTABLE_CACHE if immutable else MUTABLE_CACHE,
                Metadata={"sha256": hashlib.sha256(data).hexdigest(), "md5": md5.hexdigest()},
            )

    def sha256_of(self, name: str) -> str | None:
        with self._errors("inspect", name):
            head = self._unless_missing(self.client.head_object, name)
        if head is None:
            return None
        metadata = head.get("Metadata", {})
        if head.get("ETag", "").strip('"') != metadata.get("md5"):
            return None
        sha256: str | None = metadata.get("sha256")
        return sha256

    def _unless_missing(self, request: Callable[..., Any], name: str) -> Any:
        """`request` (get_object, head_object) for the object `name`; None when it does not exist."""
        try:
            return request(Bucket=self.bucket, Key=self.key(name))
        except ClientError as exc:
            if _error_code(exc) in ("NoSuchKey", "404"):
                return None
            raise

    @contextmanager
    def _errors(self, action: str, name: str = "") -> Iterator[None]:
        """Turn boto's many exception types into one StoreError line that names the object."""
        where = self.describe(name) if name else f"s3://{self.bucket}"
        if self.endpoint_url:
            where += f" at {self.endpoint_url}"
        try:
            yield
        except NoCredentialsError:
            raise StoreError(
                f"cannot {action} {where}: no AWS credentials found "
                "(set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
            ) from None
        except EndpointConnectionError as exc:
            raise StoreError(f"cannot {action} {where}: endpoint unreachable ({exc})") from None
        except ClientError as exc:
            code = _error_code(exc)
            if code == "NoSuchBucket" or (code == "404" and not name):  # HEAD bucket has no error body
                raise StoreError(f"cannot {action} {where}: bucket {self.bucket!r} does not exist") from None
            message = exc.response.get("Error", {}).get("Message", "")
            raise StoreError(f"cannot {action} {where}: {code} {message}".rstrip()) from None
        except BotoCoreError as exc:
            raise StoreError(f"cannot {action} {where}: {exc}") from None


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def content_type(name: str) -> str:
    if name.endswith(".json"):
        return "application/json"
    if name.endswith(".sig"):
        return "text/plain; charset=us-ascii"  # a hex signature
    return "application/octet-stream"


def s3_client(endpoint_url: str | None = None, *, session: boto3.session.Session | None = None) -> Any:
    """A thread-safe S3 client configured for publishing (retries, timeouts, MAX_CONNECTIONS)."""
    return (session or boto3.session.Session()).client("s3", endpoint_url=endpoint_url, config=_S3_CONFIG)


def open_store(out: str, endpoint_url: str | None = None) -> Store:
    """A LocalStore for a path, an S3Store for s3://bucket/prefix (bucket checked now).

    Region and credentials come from boto3's usual resolution (environment, ~/.aws, instance role);
    `endpoint_url` points at any S3-compatible store instead of AWS.
    """
    if not out.startswith("s3://"):
        if endpoint_url is not None:
            raise StoreError(f"--endpoint-url {endpoint_url} applies only to s3:// destinations, not {out}")
        return LocalStore(Path(out))
    bucket, _, prefix = out.removeprefix("s3://").partition("/")
    if not bucket:
        raise StoreError(f"{out}: no bucket name (expected s3://BUCKET/PREFIX)")
    try:
        client = s3_client(endpoint_url)
    except (BotoCoreError, ValueError) as exc:  # a malformed endpoint URL or region
        raise StoreError(f"cannot open {out}: {exc}") from None
    store = S3Store(bucket=bucket, prefix=prefix, client=client, endpoint_url=endpoint_url)
    store.check_bucket()
    return store
