"""The S3 carrier of the outer round's port: every replica's objects under its prefix of one bucket.

Layout: ``s3://BUCKET/PREFIX/{author wallet}/{stage}/{round}/{kind}[/{part}]`` — the port's object
name (``neuroshard.node.outer.port.object_name``) under its author's wallet.

Why a bucket: a replica behind NAT accepts no connections, but it can make them. Here every replica
only PUTs its own objects and GETs (ranged) the others', so outbound HTTPS is all it needs. Any
S3-compatible store works: AWS S3, Cloudflare R2, MinIO, GCS through its S3 (XML) API.

Nothing read from the bucket is trusted. The round checks every byte against hashes its author
signed; an object that someone else with write access overwrote is refused like any bad object,
and its author is then treated as absent for that step. A bucket is a carrier, not an authority.

Operator set-up (once per stage, outside NeuroShard):

- one party (the stage's organiser) owns the bucket and pays for it;
- each wallet should get write credentials scoped to its own prefix — an IAM policy allowing
  ``s3:PutObject``/``s3:DeleteObject`` on ``arn:aws:s3:::BUCKET/PREFIX/{wallet}/*`` only, or an R2
  token limited the same way — so a replica cannot overwrite another's objects (it would only make
  them absent, see above, but scoped keys keep that from happening at all), plus ``PREFIX/_want/*``
  where readers ask a relay replica for its state (``relay.py``), ``PREFIX/_pipe/*/{wallet}/*``
  where a pipeline stage sends micro-batches to next-stage replicas behind NAT (``mailbox.py``),
  ``s3:DeleteObject`` on ``PREFIX/_pipe/{wallet}/*`` (its own inbox: requests whose sender left,
  or beyond a sender's share, are cleared by the replica they were sent to), and nothing under
  ``PREFIX/_check/*``, where the verifier alone writes its challenges;
- every replica gets read access to the stage: ``s3:GetObject`` on ``PREFIX/*`` and ``s3:ListBucket``
  on the bucket with that prefix (without ListBucket, S3 answers 403 rather than 404 for an object
  not yet published, and a reader cannot wait for it);
- ``replica_policy`` writes that policy for one wallet (IAM JSON);
- a lifecycle rule deleting round objects older than N days (``bucket_lifecycle_rule``), as the
  backstop for replicas that vanish without calling ``retire``. We never install it ourselves.

Credentials come from boto3's usual chain (environment, ~/.aws, instance role); they are never flags
of ours and never logged.
"""

from __future__ import annotations

import asyncio
import io
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, IncompleteReadError
from botocore.exceptions import ConnectionError as BotoConnectionError

from ..outer.port import Traffic, check_name, check_wallet

T = TypeVar("T")
BUCKET_PATTERN = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
PREFIX_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
ABSENT_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
"""Error codes meaning 'not published yet' (NoSuchBucket is a 404 too, but waiting will not fix it)."""
BUSY_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError"})
"""Error codes of a store that is busy or briefly failing (besides any 5xx status): worth waiting out."""
DELETE_BATCH = 1000
"""DeleteObjects takes at most 1000 keys per call (S3 API reference)."""
XML_SAFE = re.compile("[\x20-\x7e\u00a0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]*")
"""Key names DeleteObjects' XML body carries as they are (no control characters)."""


def transient(exc: BotoCoreError | ClientError) -> bool:
    """Whether a bucket error (after botocore's own retries) may pass if the caller waits: the
    connection (down, timed out, a body cut short) or the store (5xx, throttling). Not a refusal
    (403, no such bucket), a missing object, or this machine's set-up (no credentials)."""
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = str(exc.response.get("Error", {}).get("Code", ""))
        return (isinstance(status, int) and status >= 500) or code in BUSY_CODES
    return isinstance(exc, (BotoConnectionError, HTTPClientError, IncompleteReadError))


class RelayError(RuntimeError):
    """A publish that did not reach the bucket (after botocore's retries): no credentials, endpoint
    down, request refused. The message names the key and the reason, never a credential."""


@dataclass(kw_only=True)
class RelayConfig:
    """Where a stage's bucket is and how this replica talks to it (credentials: boto3's chain, not here)."""

    url: str
    """``s3://BUCKET/PREFIX`` holding the stage's objects (the prefix may be empty)."""
    endpoint_url: str | None = None
    """An S3-compatible endpoint instead of AWS (MinIO, R2's ``https://ACCOUNT.r2.cloudflarestorage.com``, moto)."""
    region: str | None = None
    """The bucket's region; None takes boto3's default (AWS_DEFAULT_REGION, ~/.aws/config)."""
    poll_interval_s: float = 0.5
    """Seconds before the first re-read of an object not published yet; each wait grows x1.5."""
    max_poll_s: float = 5.0
    """Cap on the wait between polls: a GET is cheap but billed (S3: $0.0004 per 1000)."""
    request_timeout_s: float = 10.0
    """Connect and read timeout of one HTTP request, seconds (per socket operation, not per body)."""
    multipart_bytes: int = 64 << 20
    """Objects larger than this are uploaded in parts of this size (a single PUT stops at 5 GB; a
    relay's answer to a segment challenge holds 28 bytes a parameter). S3's smallest part is 5 MiB."""
    max_workers: int = 16
    """Threads running boto3 calls (boto3 is synchronous); also the client's connection pool size."""
    bucket: str = field(init=False)
    """Parsed from `url`."""
    prefix: str = field(init=False)
    """Parsed from `url`, without slashes at its ends; may be empty."""

    def __post_init__(self) -> None:
        self.bucket, self.prefix = parse_url(self.url)
        if not 0 < self.poll_interval_s <= self.max_poll_s:
            raise ValueError(
                f"need 0 < poll_interval_s ({self.poll_interval_s}) <= max_poll_s ({self.max_poll_s})"
            )
        if self.multipart_bytes < 5 << 20:
            raise ValueError(
                f"multipart_bytes must be at least 5 MiB (S3's smallest part), got {self.multipart_bytes}"
            )
        if self.request_timeout_s <= 0 or self.max_workers < 1:
            raise ValueError(
                f"need request_timeout_s > 0 and max_workers >= 1, got {self.request_timeout_s}, {self.max_workers}"
            )


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at its ends) of ``s3://BUCKET/PREFIX``; ValueError saying why not."""
    if not url.startswith("s3://"):
        raise ValueError(f"relay URL {url!r} does not start with s3:// (expected s3://BUCKET/PREFIX)")
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    if not BUCKET_PATTERN.match(bucket):
        raise ValueError(f"relay URL {url!r}: bucket {bucket!r} is not 3-63 characters of [a-z0-9.-]")
    prefix = prefix.strip("/")
    if prefix and (not PREFIX_PATTERN.match(prefix) or any(s in (".", "..") for s in prefix.split("/"))):
        raise ValueError(
            f"relay URL {url!r}: prefix {prefix!r} is not /-separated segments of [A-Za-z0-9_.-]"
        )
    return bucket, prefix


def make_s3_client(config: RelayConfig) -> Any:
    """A thread-safe boto3 S3 client for `config` (credentials from boto3's usual chain)."""
    botocore_config = Config(
        retries={"max_attempts": 3, "mode": "standard"},
        connect_timeout=config.request_timeout_s,
        read_timeout=config.request_timeout_s,
        max_pool_connections=max(10, config.max_workers),
        # Since boto3 1.36 every PutObject carries a CRC32 trailer by default, which several
        # S3-compatible stores reject (as in neuroshard.data.storage); the round hashes bytes itself.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    session = boto3.session.Session()
    return session.client(
        "s3", endpoint_url=config.endpoint_url, region_name=config.region, config=botocore_config
    )


def bucket_lifecycle_rule(prefix: str, days: int) -> dict[str, Any]:
    """The ``LifecycleConfiguration`` for PutBucketLifecycleConfiguration expiring objects under
    `prefix` `days` after they were written. The operator installs it (a replica never needs to):
    ``client.put_bucket_lifecycle_configuration(Bucket=b, LifecycleConfiguration=rule)``."""
    if days < 1:
        raise ValueError(f"lifecycle days must be >= 1, got {days}")
    prefix = prefix.strip("/")
    return {
        "Rules": [
            {
                "ID": f"neuroshard-rounds-{prefix or 'all'}"[:255],
                "Filter": {"Prefix": f"{prefix}/" if prefix else ""},
                "Status": "Enabled",
                "Expiration": {"Days": days},
                # Parts of an upload whose process died (a relay's large answer) are billed and
                # listed nowhere until aborted.
                "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1},
            }
        ]
    }


def replica_policy(bucket: str, prefix: str, wallet: str) -> dict[str, Any]:
    """The IAM policy document (AWS's JSON, which R2 and MinIO read too) giving one wallet's
    credentials what a replica needs in the stage bucket and nothing else (module docstring):
    write and delete its own prefix, ask for states under ``_want/``, send pipeline requests as
    itself and clear its own pipeline inbox (``mailbox.py``), read and list the rest. Nothing
    under ``_check/``: only the verifier writes there. An IAM ``*`` matches ``/`` too, so
    ``_pipe/*/{wallet}/*`` also admits deeper names ending in the wallet's; the receivers read
    only ``{sender}/{token}`` names and delete the rest (``mailbox.MailboxServer``)."""
    wallet = check_wallet(wallet)
    root = f"arn:aws:s3:::{bucket}/" + (f"{prefix.strip('/')}/" if prefix.strip("/") else "")
    listed = f"{prefix.strip('/')}/*" if prefix.strip("/") else "*"
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "OwnObjectsAndRequests",
                "Effect": "Allow",
                "Action": ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
                "Resource": [f"{root}{wallet}/*", f"{root}_want/*", f"{root}_pipe/*/{wallet}/*"],
            },
            {
                "Sid": "OwnInbox",
                "Effect": "Allow",
                "Action": ["s3:DeleteObject"],
                "Resource": [f"{root}_pipe/{wallet}/*"],
            },
            {"Sid": "ReadTheStage", "Effect": "Allow", "Action": ["s3:GetObject"], "Resource": [f"{root}*"]},
            {
                "Sid": "ListTheStage",
                "Effect": "Allow",
                "Action": ["s3:ListBucket"],
                "Resource": [f"arn:aws:s3:::{bucket}"],
                "Condition": {"StringLike": {"s3:prefix": [listed]}},
            },
        ],
    }


class BucketStore:
    """`RoundStore` over an S3-compatible bucket: publish = PutObject under this wallet's prefix,
    fetch = (ranged) GetObject under the author's, polled until it appears."""

    def __init__(
        self,
        config: RelayConfig,
        wallet: str,
        *,
        client: Any = None,
        log: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.config = config
        self.wallet = check_wallet(wallet)
        self.client = client if client is not None else make_s3_client(config)
        self.traffic = Traffic()
        self.log = log
        self._pool = ThreadPoolExecutor(config.max_workers, thread_name_prefix="bucket")
        self._root = f"{config.prefix}/" if config.prefix else ""
        self._warned_forbidden = False

    def key(self, author: str, name: str) -> str:
        return f"{self._root}{check_wallet(author)}/{check_name(name)}"

    def close(self) -> None:
        """Stop the worker threads (requests in flight finish in the background)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _call(self, fn: Callable[..., T], **kwargs: Any) -> T:
        self.traffic.requests += 1
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(**kwargs))

    async def publish(self, name: str, data: bytes) -> None:
        key = self.key(self.wallet, name)
        body = bytes(data)
        try:
            if len(body) > self.config.multipart_bytes:
                await self._call(self._upload_in_parts, key=key, body=body)
            else:
                await self._call(self.client.put_object, Bucket=self.config.bucket, Key=key, Body=body)
        except (BotoCoreError, ClientError, S3UploadFailedError) as exc:
            raise RelayError(f"cannot publish s3://{self.config.bucket}/{key}: {exc}") from None
        self.traffic.bytes_sent += len(body)

    def _upload_in_parts(self, key: str, body: bytes) -> None:
        part = self.config.multipart_bytes
        transfer = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=4)
        self.client.upload_fileobj(io.BytesIO(body), self.config.bucket, key, Config=transfer)

    async def put_shared(self, path: str, data: bytes) -> None:
        """PUT `data` at PREFIX/`path`, outside any wallet's prefix (the relay's state requests,
        ``relay.py``); raises RelayError like `publish`."""
        key = f"{self._root}{path}"
        try:
            await self._call(self.client.put_object, Bucket=self.config.bucket, Key=key, Body=bytes(data))
        except (BotoCoreError, ClientError) as exc:
            raise RelayError(f"cannot write s3://{self.config.bucket}/{key}: {exc}") from None
        self.traffic.bytes_sent += len(data)

    async def get_shared(self, path: str, max_bytes: int) -> bytes | None:
        """The object at PREFIX/`path` (outside any wallet's prefix), or None if it is absent, over
        `max_bytes`, or unreadable (a relay's challenges, ``relay.py``)."""
        try:
            return await self._get(f"{self._root}{path}", max_bytes, None)
        except (BotoCoreError, ClientError):
            return None

    async def read_shared(self, path: str, max_bytes: int) -> bytes | None:
        """The object at PREFIX/`path`, or None if it is absent, over `max_bytes`, or refused; raises
        RelayError where waiting may cure the failure (`transient`), so the caller can read it again
        rather than take the object for unreadable (a relay replica's pipeline inbox, ``mailbox.py``)."""
        key = f"{self._root}{path}"
        try:
            return await self._get(key, max_bytes, None)
        except (BotoCoreError, ClientError) as exc:
            if transient(exc):
                raise RelayError(f"cannot read s3://{self.config.bucket}/{key} for now: {exc}") from None
            return None

    async def delete_shared(self, path: str) -> None:
        """Delete the object at PREFIX/`path` (outside any wallet's prefix: a pipeline request this
        wallet wrote, ``mailbox.py``); failures are logged, like `delete`."""
        key = f"{self._root}{path}"
        try:
            await self._call(self.client.delete_object, Bucket=self.config.bucket, Key=key)
        except (BotoCoreError, ClientError) as exc:
            self.log(f"bucket: cannot delete s3://{self.config.bucket}/{key}: {exc}")

    async def delete_shared_many(self, paths: list[str]) -> None:
        """Delete the objects at PREFIX/`paths` (a relay replica clearing its pipeline inbox,
        ``mailbox.py``), up to DELETE_BATCH a call; failures are logged, like `delete`.

        DeleteObjects names its keys in an XML body, and a name with a character XML 1.0 cannot
        carry (a control character: S3 names are any UTF-8) would make the whole call fail; such
        names are deleted one DeleteObject each (the name goes in the URL), and a batch that fails
        anyway is retried one name at a time, so that no name can keep the others."""
        keys = [f"{self._root}{path}" for path in paths]
        plain = [k for k in keys if XML_SAFE.fullmatch(k)]
        for key in (k for k in keys if not XML_SAFE.fullmatch(k)):
            await self._delete_key(key)
        for i in range(0, len(plain), DELETE_BATCH):
            batch = plain[i : i + DELETE_BATCH]
            try:
                response = await self._call(
                    self.client.delete_objects,
                    Bucket=self.config.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                )
            except (BotoCoreError, ClientError) as exc:
                self.log(f"bucket: deleting {len(batch)} objects at once failed ({exc}); one at a time")
                for key in batch:
                    await self._delete_key(key)
                continue
            if response.get("Errors"):
                self.log(f"bucket: {len(response['Errors'])} of {len(batch)} deletes refused")

    async def _delete_key(self, key: str) -> None:
        try:
            await self._call(self.client.delete_object, Bucket=self.config.bucket, Key=key)
        except (BotoCoreError, ClientError) as exc:
            self.log(f"bucket: cannot delete s3://{self.config.bucket}/{key!r}: {exc}")

    async def delete(self, name: str) -> None:
        """Delete this wallet's object `name`; failures are logged (it costs storage only, and the
        lifecycle rule removes it later)."""
        key = self.key(self.wallet, name)
        try:
            await self._call(self.client.delete_object, Bucket=self.config.bucket, Key=key)
        except (BotoCoreError, ClientError) as exc:
            self.log(f"bucket: cannot delete s3://{self.config.bucket}/{key}: {exc}")

    async def list_under(
        self, path: str, *, delimiter: str | None = None, max_keys: int = 1000, start_after: str = ""
    ) -> tuple[list[str], list[str]]:
        """One LIST page under PREFIX/`path` (of the names after `start_after`, relative, when
        given): (object keys, common prefixes), both relative to PREFIX/`path` and without trailing
        slashes, in name order; raises RelayError when the bucket refuses."""
        base = f"{self._root}{path}"
        kwargs: dict[str, Any] = {"Bucket": self.config.bucket, "Prefix": base, "MaxKeys": max_keys}
        if delimiter is not None:
            kwargs["Delimiter"] = delimiter
        if start_after:
            kwargs["StartAfter"] = base + start_after
        try:
            page = await self._call(self.client.list_objects_v2, **kwargs)
        except (BotoCoreError, ClientError) as exc:
            raise RelayError(f"cannot list s3://{self.config.bucket}/{base}: {exc}") from None
        keys = [str(o["Key"]).removeprefix(base) for o in page.get("Contents", [])]
        prefixes = [str(p["Prefix"]).removeprefix(base).rstrip("/") for p in page.get("CommonPrefixes", [])]
        return keys, prefixes

    async def fetch(
        self,
        author: str,
        name: str,
        *,
        max_bytes: int,
        span: tuple[int, int] | None = None,
        wait_s: float = 0.0,
        poll_s: tuple[float, float] | None = None,
    ) -> bytes | None:
        """`author`'s object `name` (a `span` of it), polled for up to `wait_s` until it appears; None
        if it did not, or is over `max_bytes`. `poll_s`: (first, largest) wait between polls, each
        wait x1.5, instead of the config's (a pipeline reply waits in tens of milliseconds)."""
        key = self.key(author, name)
        if span is not None:
            start, end = span
            if not 0 <= start <= end or end - start > max_bytes:
                return None
            if start == end:
                return b""
        deadline = time.monotonic() + wait_s
        interval, largest = poll_s or (self.config.poll_interval_s, self.config.max_poll_s)
        while True:
            try:
                return await self._get(key, max_bytes, span)
            except ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                if code in ("403", "AccessDenied") and not self._warned_forbidden:
                    self._warned_forbidden = True
                    self.log(
                        f"bucket: GET {key} forbidden ({code}); readers need s3:GetObject and s3:ListBucket"
                    )
                if code not in ABSENT_CODES and not transient(exc):
                    return None
            except BotoCoreError as exc:  # endpoint down, timeouts, a body cut short: polled again
                if not transient(exc):
                    return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            await asyncio.sleep(min(interval, remaining))
            interval = min(interval * 1.5, largest)

    async def _get(self, key: str, max_bytes: int, span: tuple[int, int] | None) -> bytes | None:
        """The object's bytes, None if too large or not the length asked for; raises botocore errors
        (IncompleteReadError for a body that ended early)."""
        kwargs: dict[str, Any] = {"Bucket": self.config.bucket, "Key": key}
        if span is not None:
            kwargs["Range"] = f"bytes={span[0]}-{span[1] - 1}"
        response = await self._call(self.client.get_object, **kwargs)
        body = response["Body"]
        try:
            length = int(response.get("ContentLength", -1))
            want = length if span is None else span[1] - span[0]
            if length > max_bytes or length != want:  # a span past the object's end comes back short
                return None
            loop = asyncio.get_running_loop()
            data: bytes = await loop.run_in_executor(self._pool, body.read, max_bytes + 1)
        finally:
            body.close()
        self.traffic.bytes_received += len(data)
        if len(data) < length:
            raise IncompleteReadError(actual_bytes=len(data), expected_bytes=length)
        return data if len(data) == length else None

    async def retire(self, stage: int, before_round: int) -> None:
        """Delete this wallet's objects of rounds < `before_round` of `stage`. Failures are logged, not
        raised: what is left behind costs storage only, and the lifecycle rule removes it later."""
        prefix = f"{self._root}{self.wallet}/{stage}/"
        try:
            old = await self._list_old(prefix, before_round)
            for i in range(0, len(old), DELETE_BATCH):
                batch = [{"Key": k} for k in old[i : i + DELETE_BATCH]]
                response = await self._call(
                    self.client.delete_objects,
                    Bucket=self.config.bucket,
                    Delete={"Objects": batch, "Quiet": True},
                )
                if response.get("Errors"):
                    self.log(
                        f"bucket: {len(response['Errors'])} of {len(batch)} deletes under {prefix} refused"
                    )
        except (BotoCoreError, ClientError) as exc:
            self.log(f"bucket: cannot retire rounds < {before_round} of stage {stage}: {exc}")

    async def _list_old(self, prefix: str, before_round: int) -> list[str]:
        old: list[str] = []
        kwargs: dict[str, Any] = {"Bucket": self.config.bucket, "Prefix": prefix}
        while True:
            page = await self._call(self.client.list_objects_v2, **kwargs)
            for obj in page.get("Contents", []):
                round_ = obj["Key"].removeprefix(prefix).split("/", 1)[0]
                if round_.isdigit() and int(round_) < before_round:
                    old.append(obj["Key"])
            if not page.get("IsTruncated"):
                return old
            kwargs["ContinuationToken"] = page["NextContinuationToken"]
