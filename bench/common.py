"""Shared set-up for benchmarks: a published data set from the shared English text, cached on disk."""

from __future__ import annotations

import hashlib
import socket
import time
from pathlib import Path

from nacl.signing import SigningKey

from neuroshard.data import Dataset, open_dataset
from neuroshard.data.files import file_sha256
from neuroshard.data.manifest import MANIFEST_FORMAT, MANIFEST_NAME
from neuroshard.data.publish import TOKENIZER_NAME, publish_shards
from neuroshard.tokenizer import BPETokenizer

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "austen.txt"
BENCH_KEY = SigningKey(hashlib.sha256(b"neuroshard bench publisher").digest())
"""A fixed, public key: benchmark data sets are throwaway and need no secret."""


def bench_dataset(text_path: Path, vocab_size: int = 4096, shard_tokens: int = 250_000) -> Dataset:
    """Tokenizer + shards for `text_path` under /tmp, built once and reused by later runs."""
    tag = f"{file_sha256(text_path)[:12]}-m{MANIFEST_FORMAT}-v{vocab_size}-s{shard_tokens}"
    directory = Path("/tmp/neuroshard-bench") / tag
    if not (directory / MANIFEST_NAME).exists():
        directory.mkdir(parents=True, exist_ok=True)
        text = text_path.read_text(encoding="utf-8")
        start = time.perf_counter()
        tokenizer = BPETokenizer.train([text[:1_500_000]], vocab_size)
        tokenizer.save(directory / TOKENIZER_NAME)
        # One document per paragraph, so EOS marks real boundaries.
        publish_shards(text.split("\n\n"), out=directory, key=BENCH_KEY, shard_tokens=shard_tokens)
        print(f"(built bench data set {directory} in {time.perf_counter() - start:.1f}s)")
    return open_dataset(directory, bytes(BENCH_KEY.verify_key))


def free_ports(count: int) -> int:
    """A base port with base .. base + count − 1 free on 127.0.0.1: a swarm started by a benchmark
    must not collide with another one on the same machine (default ports 7420+ and 8000)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no run of {count} free ports found")
