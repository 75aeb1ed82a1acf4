"""Publishing throughput to a loopback S3 endpoint, next to a plain sequential put_object of the same bytes.

The endpoint is moto in server mode, started as its own process on 127.0.0.1 so it does not
share our interpreter's GIL. Lines, all in MB of shard bytes per second:

- ours, to S3: the whole `publish_shards` into a fresh prefix (tokenize, serialize, hash,
  parallel uploads with sha256 metadata and Content-MD5, then the signed manifest);
- ours, to a store that discards every write: the same run minus all I/O, i.e. what
  tokenizing costs; uploads overlap tokenizing, so the S3 run should come close to it;
- ours, resumed: a re-run after a crash just before the manifest (every shard skipped by HEAD);
- ours, upload stage: `store_shard` (sha256, HEAD, PUT) on the worker pool over ready-made shards;
- bare: the same shard bytes with one `put_object` each, one after another, nothing else.

Repeats alternate in order and reverse order so drift in machine speed hits every side alike.

    .venv/bin/python bench/bench_publish.py [--copies 3] [--repeats 5] [--workers 8] [--shard-tokens 250000]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
from common import BENCH_KEY, DEFAULT_TEXT, parse_with_quick, quick_text

from neuroshard.data.files import file_sha256
from neuroshard.data.manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest
from neuroshard.data.publish import DEFAULT_WORKERS, TOKENIZER_NAME, publish_shards, store_shard
from neuroshard.data.storage import S3Store, Store, s3_client
from neuroshard.testing.ports import free_port
from neuroshard.tokenizer import BPETokenizer

BUCKET = "bench"
CACHE_DIR = Path("/tmp/neuroshard-bench")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="UTF-8 text to publish")
    p.add_argument("--copies", type=int, default=3, help="publish the text this many times over per run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each side")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS)
    p.add_argument("--shard-tokens", type=int, default=250_000, help="tokens per shard (4 bytes each)")
    p.add_argument(
        "--vocab-size", type=int, default=4096, help="vocabulary of the tokenizer the text is published with"
    )
    return parse_with_quick(p, text=quick_text(), copies=1, repeats=1, shard_tokens=20_000, vocab_size=512)


def cached_tokenizer(text_path: Path, vocab_size: int = 4096) -> bytes:
    """tokenizer.json trained on the first 1.5 MB of the text (as bench/common.py does), cached in /tmp."""
    path = CACHE_DIR / f"publish-tokenizer-{file_sha256(text_path)[:12]}-v{vocab_size}.json"
    if not path.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        text = text_path.read_text(encoding="utf-8")
        BPETokenizer.train([text[:1_500_000]], vocab_size).save(path)
    return path.read_bytes()


@contextmanager
def moto_server() -> Iterator[str]:
    """`python -m moto.server` on a free loopback port; yields its URL."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"moto server on port {port} did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


class DiscardStore:
    """Holds tokenizer.json and throws every write away: publish_shards minus all I/O."""

    def __init__(self, tokenizer_json: bytes) -> None:
        self._tokenizer_json = tokenizer_json

    def get_bytes(self, name: str) -> bytes | None:
        return self._tokenizer_json if name == TOKENIZER_NAME else None

    def put_bytes(self, name: str, data: bytes, *, immutable: bool = False) -> None:
        return None

    def sha256_of(self, name: str) -> str | None:
        return None

    def describe(self, name: str = "") -> str:
        return f"discard/{name}"


def fresh_store(client: Any, side: str) -> S3Store:
    return S3Store(bucket=BUCKET, prefix=f"{side}-{uuid.uuid4().hex[:8]}", client=client)


def publish(store: Store, documents: list[str], args: argparse.Namespace) -> None:
    publish_shards(documents, out=store, key=BENCH_KEY, shard_tokens=args.shard_tokens, workers=args.workers)


def upload_stage(client: Any, shards: list[bytes], workers: int) -> None:
    """Our per-shard upload (sha256, HEAD, PUT with metadata and Content-MD5) on `workers` threads."""
    store = fresh_store(client, "stage")
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda item: store_shard(store, f"shard_{item[0]}.pt", item[1]), enumerate(shards)))


def bare_upload(client: Any, shards: list[bytes]) -> None:
    prefix = f"bare-{uuid.uuid4().hex[:8]}"
    for i, data in enumerate(shards):
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/shard_{i}.pt", Body=data)


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> int:
    args = parse_args()
    tokenizer_json = cached_tokenizer(args.text, args.vocab_size)
    # One document per paragraph, so EOS marks real boundaries (as bench/common.py does).
    documents = args.text.read_text(encoding="utf-8").split("\n\n") * args.copies
    session = boto3.session.Session(
        aws_access_key_id="bench", aws_secret_access_key="bench", region_name="us-east-1"
    )
    with moto_server() as endpoint:
        client = s3_client(endpoint, session=session)
        client.create_bucket(Bucket=BUCKET)
        warm = fresh_store(client, "ours")
        warm.put_bytes(TOKENIZER_NAME, tokenizer_json)
        publish(warm, documents, args)  # warms up, and gives the other sides the shard bytes
        manifest = Manifest.from_bytes(warm.get_bytes(MANIFEST_NAME) or b"")
        shards = [warm.get_bytes(s.file) or b"" for s in manifest.shards]
        megabytes = sum(map(len, shards)) / 1e6

        def ours() -> None:
            store = fresh_store(client, "ours")
            store.put_bytes(TOKENIZER_NAME, tokenizer_json)
            publish(store, documents, args)

        sides: dict[str, Callable[[], object]] = {
            "ours": ours,
            "discard": lambda: publish(DiscardStore(tokenizer_json), documents, args),
            "stage": lambda: upload_stage(client, shards, args.workers),
            "bare": lambda: bare_upload(client, shards),
        }
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        for i in range(args.repeats):
            for name in list(sides) if i % 2 == 0 else reversed(sides):
                seconds[name].append(timed(sides[name]))
        # Resume: drop the manifest as a crash just before it would have; every shard is skipped by a HEAD.
        client.delete_objects(
            Bucket=BUCKET,
            Delete={"Objects": [{"Key": warm.key(MANIFEST_NAME)}, {"Key": warm.key(SIGNATURE_NAME)}]},
        )
        resumed = timed(lambda: publish(warm, documents, args))

    print(
        f"{len(shards)} shards, {megabytes:.1f} MB of shards from {args.copies} x {args.text.name}, "
        f"{args.workers} workers, {args.repeats} repeats, moto server on loopback (own process)"
    )
    print(f"{'':<56} {'median MB/s':>12} {'best MB/s':>10}")
    rows = [
        ("ours: publish_shards to S3 (tokenize+upload+manifest)", seconds["ours"]),
        ("ours: publish_shards to a discard store (no I/O)", seconds["discard"]),
        ("ours, resumed: every shard already stored (HEAD only)", [resumed]),
        ("ours, upload stage only: store_shard on the pool", seconds["stage"]),
        ("bare: sequential put_object of the same bytes", seconds["bare"]),
    ]
    for label, times in rows:
        print(f"{label:<56} {megabytes / statistics.median(times):>12.2f} {megabytes / min(times):>10.2f}")
    median = {name: statistics.median(times) for name, times in seconds.items()}
    print(f"ratio upload stage / bare put_object = {median['bare'] / median['stage']:.2f} (median)")
    print(f"ratio publish to S3 / publish with no I/O = {median['discard'] / median['ours']:.2f} (median)")
    print(f"ratio publish to S3 / bare put_object = {median['bare'] / median['ours']:.2f} (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
