"""The whole data path with real processes: publish to S3, serve through a CDN, train on what arrived.

Publisher CLIs upload tokenizer and shards to a moto S3 endpoint on loopback; a plain
aiohttp server plays the CDN (pulling objects from the bucket on request, as an origin
pull would); `neuroshard-node --data-url` fetches, verifies, caches and trains.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from nacl.signing import SigningKey
from tests_support import small_corpus

from neuroshard.cli.publish_shards import main as publish_shards_main
from neuroshard.cli.publish_tokenizer import main as publish_tokenizer_main
from neuroshard.data import read_manifest
from neuroshard.data.storage import s3_client
from neuroshard.testing.ports import free_port

NODE = str(Path(sys.executable).parent / "neuroshard-node")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("aws_env")]


class Cdn:
    """GET /<path> -> the bucket's <prefix>/<path>; records every path asked for."""

    def __init__(self, endpoint: str, bucket: str, prefix: str) -> None:
        self.client = s3_client(endpoint)
        self.bucket, self.prefix = bucket, prefix
        self.requests: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.port = 0

    async def _get(self, request: web.Request) -> web.StreamResponse:
        path = request.match_info["path"]
        self.requests.append(path)
        try:
            obj = await asyncio.to_thread(
                self.client.get_object, Bucket=self.bucket, Key=f"{self.prefix}/{path}"
            )
        except self.client.exceptions.NoSuchKey:
            raise web.HTTPNotFound() from None
        return web.Response(body=obj["Body"].read(), content_type="application/octet-stream")

    def start(self) -> None:
        app = web.Application()
        app.router.add_get("/{path:.+}", self._get)
        runner = web.AppRunner(app)

        async def serve() -> None:
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = runner.addresses[0][1]

        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(serve(), self.loop).result(timeout=10)
        self._runner = runner

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def cdn(endpoint: str) -> Iterator[Cdn]:
    bucket = f"e2e-{uuid.uuid4().hex[:10]}"
    s3_client(endpoint).create_bucket(Bucket=bucket)
    server = Cdn(endpoint, bucket, "run1")
    server.start()
    yield server
    server.stop()


def test_publish_to_s3_fetch_through_a_cdn_and_train(cdn: Cdn, endpoint: str, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, doc in enumerate(small_corpus(300_000)):
        (corpus / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    target = f"s3://{cdn.bucket}/run1"
    key_file = tmp_path / "publisher.key"
    assert publish_tokenizer_main(["--input", str(corpus), "--out", target, "--endpoint-url", endpoint,
                                   "--vocab-size", "512"]) == 0  # fmt: skip
    assert publish_shards_main(["--input", str(corpus), "--out", target, "--endpoint-url", endpoint,
                                "--key-file", str(key_file), "--shard-tokens", "20000"]) == 0  # fmt: skip
    local = tmp_path / "mirror"
    local.mkdir()
    for name in ("manifest.json", "manifest.json.sig"):
        obj = cdn.client.get_object(Bucket=cdn.bucket, Key=f"run1/{name}")
        (local / name).write_bytes(obj["Body"].read())
    publisher = bytes(SigningKey(bytes.fromhex(key_file.read_text().strip())).verify_key)
    manifest = read_manifest(local, publisher)

    home = tmp_path / "home"
    args = [NODE, "--home", str(home), "--data-url", f"http://127.0.0.1:{cdn.port}/",
            "--publisher-key", publisher.hex(), "--max-steps", "60", "--inner-steps", "20",
            "--batch-size", "4", "--seq-len", "64", "--threads", "1", "--verifier-port", str(free_port())]  # fmt: skip
    out = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NEUROSHARD_TOKEN": "e2e-token"},
    )
    assert out.returncode == 0, out.stderr + out.stdout
    losses = [float(x) for x in re.findall(r"loss=([0-9.]+)", out.stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert "manifest.json" in cdn.requests and "manifest.json.sig" in cdn.requests
    assert f"tokenizers/{manifest.tokenizer.sha256}.json" in cdn.requests
    fetched = [p for p in cdn.requests if p.startswith("shard_")]
    assert fetched and set(fetched) <= {s.file for s in manifest.shards}
    cached = {p.name for p in (home / "cache").rglob("shard_*.pt")}
    assert cached and cached <= {s.file for s in manifest.shards}
