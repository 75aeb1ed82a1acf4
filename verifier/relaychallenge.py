"""Challenges of relay replicas through their stage bucket.

The replay checker GETs a challenged replica's segments, round logs or replay material from its
port (verifier.replaycheck). A relay replica (``neuroshard-node --relay s3://…`` with no
``--port``) opens none, so the checker asks through the stage's bucket instead; the layout and the
holder's side are node.p2p.relay's (its module docstring):

1. `get` reads the answer at ``PREFIX/{holder}/check/{route}`` (`look` only looks for answers,
   one HEAD each). Absent: it (re)writes the challenge
   ``PREFIX/_check/{holder}/{route}``, the operator's signed headers for
   ``GET /p2p/relay-check/{holder}/{route}`` (a path no port serves), fresh on every try since a node accepts a signature within
   ±60 s, and raises `NotAnswered`.
   The checker tries again later, within the same answer window as over HTTP, and a holder that
   never answers fails the same way.
2. Once read, the challenge is deleted (`release`), and the holder then deletes its answer. A check
   that ends before reading everything it asked for releases the rest, and a verifier that
   restarts deletes every challenge its last run left (`clear`).

What is read is judged exactly like an answer over HTTP: against the holder's signed receipt, the
bucket is a carrier only. The holder is named by its wallet's public key from the verifier's own
records (`BucketHolder`), never by the address string it registered, so a wallet that registered
another's relay address is still asked under its own prefix.

The verifier needs, on the bucket: ``s3:GetObject`` on ``PREFIX/*``, ``s3:ListBucket`` on the
prefix, and ``s3:PutObject`` / ``s3:DeleteObject`` on ``PREFIX/_check/*``, which no replica may
write (node.p2p.relay); credentials from boto3's usual chain.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from neuroshard.node.p2p.bucket import ABSENT_CODES, DELETE_BATCH, RelayConfig, make_s3_client
from neuroshard.node.p2p.relay import (
    CHALLENGE_PREFIX,
    answer_name,
    challenge_key,
    challenge_name,
    challenge_request,
)
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.signing import sign_request

from .background import BodyTooLarge


@dataclass(frozen=True)
class BucketHolder:
    """A challenged replica reached through the bucket: its wallet's public key (hex)."""

    public_key: str


class BucketUnavailable(Exception):
    """The verifier could not read or write the bucket itself (credentials, permissions, an
    outage): its own failure, which must not count against the holder (replaycheck._fetch)."""


UNREADABLE_CODES = frozenset({"InvalidObjectState", "InvalidRequest", "400"})
"""Errors reading an answer that its holder chose (archived to a storage class GetObject cannot read,
encrypted with a key of its own): the answer is as good as absent, never the verifier's failure
(which would restart the window for ever)."""


@dataclass(frozen=True)
class Looked:
    """What `RelayChallenges.look` found."""

    missing: list[str]
    """The paths with no readable answer (asked again)."""
    oldest: float | None
    """When the oldest answer found was written (the bucket's clock), None when none was."""


class NotAnswered(Exception):
    """The holder has not uploaded its answer yet; the challenge is (re)written. Try again later."""


class RelayChallenges:
    """The verifier's side of challenges through one stage bucket (module docstring)."""

    def __init__(
        self,
        config: RelayConfig,
        operator: Wallet,
        clock: Callable[[], float],
        log: Callable[[str], None],
        *,
        client: Any = None,
    ) -> None:
        self.config = config
        self.operator = operator
        self.clock = clock
        self.log = log
        self.client = client if client is not None else make_s3_client(config)
        self._root = f"{config.prefix}/" if config.prefix else ""
        self._warned_forbidden = False

    def get(self, holder: str, path: str, max_bytes: int) -> bytes:
        """The holder's answer to GET `path`. NotAnswered when it is not there yet (the challenge is
        written again first), BodyTooLarge past `max_bytes`, BucketUnavailable when the verifier cannot
        read or write the bucket."""
        name = challenge_name(path)
        key = f"{self._root}{holder}/{answer_name(name)}"
        try:
            reply = self.client.get_object(Bucket=self.config.bucket, Key=key)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("403", "AccessDenied") and not self._warned_forbidden:
                # Without s3:ListBucket, S3 answers 403 for an object that is not there yet.
                self._warned_forbidden = True
                self.log(f"replay check: GET {key} forbidden ({code}); the verifier needs s3:ListBucket")
            if code in UNREADABLE_CODES:
                self._ask(holder, path, name)
                raise NotAnswered(f"the answer to {path} cannot be read ({code})") from None
            if code not in ABSENT_CODES and code not in ("403", "AccessDenied"):
                raise BucketUnavailable(f"cannot read s3://{self.config.bucket}/{key}: {exc}") from None
            self._ask(holder, path, name)
            raise NotAnswered(f"no answer to {path} in the bucket yet") from None
        except BotoCoreError as exc:
            raise BucketUnavailable(f"cannot read s3://{self.config.bucket}/{key}: {exc}") from None
        stream = reply["Body"]
        try:
            length = int(reply.get("ContentLength", -1))
            if length > max_bytes:
                self.release(holder, [path])
                raise BodyTooLarge(f"an answer of {length} bytes, over {max_bytes}")
            body: bytes = stream.read(max_bytes + 1)
        except BotoCoreError as exc:
            raise BucketUnavailable(f"reading s3://{self.config.bucket}/{key} failed: {exc}") from None
        finally:
            stream.close()
        self.release(holder, [path])
        if len(body) > max_bytes:
            raise BodyTooLarge(f"a body over {max_bytes} bytes")
        return body

    def look(self, holder: str, paths: Sequence[str]) -> Looked:
        """Which of `paths` the holder has not answered readably in the bucket yet, each asked
        again, and when the oldest answer there was written; reads no answer, one HEAD a path
        (a check looks before it downloads, so a holder that answers all but one piece makes the
        verifier hold nothing: replaycheck). An answer the verifier could not read (archived to
        another storage class, or encrypted with the holder's own key) counts as not there.
        Raises BucketUnavailable when the verifier cannot read or write the bucket."""
        absent, written = [], []
        for path in paths:
            key = f"{self._root}{holder}/{answer_name(challenge_name(path))}"
            try:
                head = self.client.head_object(Bucket=self.config.bucket, Key=key)
            except ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                if code not in ABSENT_CODES | UNREADABLE_CODES and code not in ("403", "AccessDenied"):
                    raise BucketUnavailable(
                        f"cannot look at s3://{self.config.bucket}/{key}: {exc}"
                    ) from None
                absent.append(path)
                continue
            except BotoCoreError as exc:
                raise BucketUnavailable(f"cannot look at s3://{self.config.bucket}/{key}: {exc}") from None
            if head.get("StorageClass", "STANDARD") != "STANDARD":
                absent.append(path)
                continue
            modified = head.get("LastModified")
            written.append(modified.timestamp() if modified is not None else self.clock())
        for path in absent:
            self._ask(holder, path, challenge_name(path))
        return Looked(absent, min(written, default=None))

    def _ask(self, holder: str, path: str, name: str) -> None:
        headers = sign_request(self.operator, "GET", challenge_request(name, holder), b"", self.clock())
        key = f"{self._root}{challenge_key(holder, name)}"
        body = json.dumps(headers, sort_keys=True).encode()
        try:
            self.client.put_object(Bucket=self.config.bucket, Key=key, Body=body)
        except (BotoCoreError, ClientError) as exc:
            raise BucketUnavailable(
                f"cannot write the challenge s3://{self.config.bucket}/{key}: {exc}"
            ) from None

    def release(self, holder: str, paths: Iterable[str]) -> None:
        """Delete the challenges of `paths` to `holder` (read, or no longer needed; deleting one
        never written costs a request and changes nothing), so that the holder deletes its answers.
        Failures are logged: a challenge left behind makes the holder keep its answer until the
        bucket's lifecycle rule removes both."""
        for name in sorted({challenge_name(p) for p in paths}):
            key = f"{self._root}{challenge_key(holder, name)}"
            try:
                self.client.delete_object(Bucket=self.config.bucket, Key=key)
            except (BotoCoreError, ClientError) as exc:
                self.log(f"replay check: cannot delete the challenge s3://{self.config.bucket}/{key}: {exc}")

    def clear(self) -> int:
        """Delete every challenge in the bucket (those a previous run of the verifier left: its
        queue did not survive it), so that their holders delete their answers; how many."""
        kwargs: dict[str, Any] = {"Bucket": self.config.bucket, "Prefix": f"{self._root}{CHALLENGE_PREFIX}/"}
        cleared = 0
        try:
            while True:
                page = self.client.list_objects_v2(**kwargs)
                found = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                for i in range(0, len(found), DELETE_BATCH):
                    batch = found[i : i + DELETE_BATCH]
                    self.client.delete_objects(
                        Bucket=self.config.bucket, Delete={"Objects": batch, "Quiet": True}
                    )
                cleared += len(found)
                if not page.get("IsTruncated"):
                    return cleared
                kwargs["ContinuationToken"] = page["NextContinuationToken"]
        except (BotoCoreError, ClientError) as exc:
            self.log(f"replay check: cannot clear the challenges a previous run left: {exc}")
            return cleared
