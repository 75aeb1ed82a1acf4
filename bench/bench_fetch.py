"""Fetch+verify throughput: our HTTP shard client vs a plain aiohttp download of the same bytes.

A loopback aiohttp static server (its own process, so it does not share our GIL) serves
two data sets: the shards `bench_dataset` builds from austen.txt (a few MB), and a
synthetic set of larger shards for stable numbers. With `--link-mbps R` the server also
paces its sends to R megabits per second (a token bucket over 64 KiB writes) and both
clients are measured again behind that link: unpaced, loopback is limited only by the
client's CPU, which is where sha256 costs; a node's real link to a CDN is not.

Ours is `HttpShardSource.fetch` from
a cold cache, one shard after another: streaming download with sha256 on the fly, fsync
and atomic rename into the cache, then `load_shard` (which hashes the file again before
`torch.load`) — everything a node pays before training on a shard. The baseline streams
each file into a file with aiohttp and checks nothing. Runs alternate (ours, plain, …)
and medians are reported, so drift in machine speed hits both alike.

    .venv/bin/python bench/bench_fetch.py [--repeats 7] [--synthetic-shards 8] [--synthetic-tokens 4000000]
        [--link-mbps 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import aiohttp
import torch
from aiohttp import web
from common import DEFAULT_TEXT, bench_dataset, parse_with_quick, quick_dataset

from neuroshard.data import ShardInfo
from neuroshard.data.fetch import FetchConfig, HttpShardSource
from neuroshard.data.files import file_sha256


@dataclass(frozen=True)
class ShardSet:
    name: str
    directory: Path
    shards: tuple[ShardInfo, ...]
    vocab_size: int

    @property
    def total_bytes(self) -> int:
        return sum((self.directory / s.file).stat().st_size for s in self.shards)


def synthetic_set(shards: int, tokens: int, vocab_size: int = 4096) -> ShardSet:
    """Random token shards under /tmp, built once; only the hash and length checks care what is in them."""
    directory = Path("/tmp/neuroshard-bench") / f"synthetic-{shards}x{tokens}-v{vocab_size}"
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    infos = []
    for shard_id in range(shards):
        path = directory / f"shard_{shard_id}.pt"
        if not path.exists():
            torch.save(torch.randint(0, vocab_size, (tokens,), dtype=torch.int32, generator=generator), path)
        infos.append(
            ShardInfo(
                id=shard_id, file=path.name, sha256=file_sha256(path), tokens=tokens, tokenizer_sha256=""
            )
        )
    return ShardSet("synthetic", directory, tuple(infos), vocab_size)


PACE_CHUNK = 1 << 16
"""Bytes per paced write: small enough that the rate is smooth at the measured time scales."""


def paced_handler(root: Path, bytes_per_s: float) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Serve files under `root` no faster than `bytes_per_s` (a token bucket per response)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        path = (root / request.match_info["name"]).resolve()
        if path.parent != root.resolve() or not path.is_file():
            raise web.HTTPNotFound()
        response = web.StreamResponse(headers={"Content-Length": str(path.stat().st_size)})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        start, sent = loop.time(), 0
        with path.open("rb") as f:
            while chunk := f.read(PACE_CHUNK):
                await response.write(chunk)
                sent += len(chunk)
                ahead = sent / bytes_per_s - (loop.time() - start)
                if ahead > 0:
                    await asyncio.sleep(ahead)
        await response.write_eof()
        return response

    return handle


def serve(root: str, link_mbps: float | None, conn: Connection) -> None:
    """The static server process: sends its URL down `conn`, then serves until killed."""

    async def run() -> None:
        app = web.Application()
        if link_mbps is None:
            app.router.add_static("/", root)
        else:
            app.router.add_get("/{name}", paced_handler(Path(root), link_mbps * 1e6 / 8))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        conn.send(f"http://{host}:{port}")
        await asyncio.Event().wait()

    asyncio.run(run())


@dataclass(frozen=True)
class Run:
    seconds: float
    cpu_seconds: float
    """CPU time of this process (all threads: caller, event loop, hashing) during the run."""


def timed(work: Callable[[], None]) -> Run:
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return Run(time.perf_counter() - wall, time.process_time() - cpu)


def ours(url: str, shard_set: ShardSet, config: FetchConfig, *, load: bool) -> Run:
    """HttpShardSource from a cold cache, one shard after another.

    `load`: `fetch()` each shard (download, verify, load the tensor: what a node waits for);
    otherwise only download and verify into the cache (`prefetch` + `wait_prefetched`).
    """
    with (
        tempfile.TemporaryDirectory(dir="/tmp") as cache,
        HttpShardSource(url, Path(cache), shard_set.vocab_size, config=config, log=print) as source,
    ):

        def work() -> None:
            for info in shard_set.shards:
                if load:
                    assert source.fetch(info).numel() == info.tokens
                else:
                    source.prefetch([info])
                    source.wait_prefetched()

        run = timed(work)
        assert source.stats.downloads == len(shard_set.shards) and source.stats.rejected == 0
    return run


def plain(url: str, shard_set: ShardSet, config: FetchConfig) -> Run:
    """A bare aiohttp loop streaming the same files to disk with the same read size, checking nothing."""

    async def download(out: Path) -> None:
        async with aiohttp.ClientSession(read_bufsize=config.chunk_bytes) as session:
            for info in shard_set.shards:
                async with session.get(f"{url}/{info.file}") as resp:
                    resp.raise_for_status()
                    with (out / info.file).open("wb") as f:
                        async for chunk in resp.content.iter_chunked(config.chunk_bytes):
                            f.write(chunk)

    with tempfile.TemporaryDirectory(dir="/tmp") as out:
        return timed(lambda: asyncio.run(download(Path(out))))


RUNNERS: dict[str, Callable[[str, ShardSet, FetchConfig], Run]] = {
    "ours fetch": lambda url, s, c: ours(url, s, c, load=True),
    "ours to cache": lambda url, s, c: ours(url, s, c, load=False),
    "plain": plain,
}


def measure(
    shard_set: ShardSet, repeats: int, config: FetchConfig, link_mbps: float | None = None
) -> dict[str, list[Run]]:
    """`repeats` runs of each runner against one server process, interleaved."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    server = context.Process(target=serve, args=(str(shard_set.directory), link_mbps, sender), daemon=True)
    server.start()
    try:
        url = receiver.recv()
        plain(url, shard_set, config)  # warm the server, the connection path and the page cache
        runs: dict[str, list[Run]] = {name: [] for name in RUNNERS}
        for _ in range(repeats):
            for name, runner in RUNNERS.items():
                runs[name].append(runner(url, shard_set, config))
        return runs
    finally:
        server.kill()
        server.join()


def report(shard_set: ShardSet, runs: dict[str, list[Run]], link_mbps: float | None = None) -> None:
    megabytes = shard_set.total_bytes / 1e6
    link = "unpaced loopback" if link_mbps is None else f"loopback paced to {link_mbps:g} Mbit/s"
    print(f"\n{shard_set.name}: {len(shard_set.shards)} shards, {megabytes:.1f} MB, {link}")
    print(f"  {'':<14} {'median MB/s':>11} {'CPU ns/byte':>11}   MB/s of each repeat")
    for name, series in runs.items():
        rates = [megabytes / r.seconds for r in series]
        cpu = statistics.median(r.cpu_seconds / shard_set.total_bytes * 1e9 for r in series)
        print(
            f"  {name:<14} {statistics.median(rates):>11.0f} {cpu:>11.2f}   {' '.join(f'{x:.0f}' for x in rates)}"
        )
    base = statistics.median(megabytes / r.seconds for r in runs["plain"])
    for name in ("ours fetch", "ours to cache"):
        ours_median = statistics.median(megabytes / r.seconds for r in runs[name])
        paired = statistics.median(
            p.seconds / o.seconds for o, p in zip(runs[name], runs["plain"], strict=True)
        )
        print(f"  ratio {name} / plain: {ours_median / base:.3f} (median of paired repeats {paired:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary of the austen data set")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--synthetic-shards", type=int, default=8)
    parser.add_argument("--synthetic-tokens", type=int, default=4_000_000, help="tokens per synthetic shard")
    parser.add_argument(
        "--link-mbps",
        type=float,
        default=1000.0,
        help="also measure behind a server paced to this many Mbit/s (0: skip); 1000 = a fast home fibre link",
    )
    args = parse_with_quick(parser, repeats=1, synthetic_shards=2, synthetic_tokens=200_000, link_mbps=0.0)

    dataset = quick_dataset() if args.quick else bench_dataset(args.text, vocab_size=args.vocab)
    print(f"text: {dataset.location} built from {'the quick text' if args.quick else args.text}")
    sets = [
        ShardSet("austen", Path(dataset.location), dataset.manifest.shards, dataset.tokenizer.vocab_size),
        synthetic_set(args.synthetic_shards, args.synthetic_tokens),
    ]
    # Other processes on a 2-core machine change the picture (hashing needs a spare core to hide).
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")
    for shard_set in sets:
        report(shard_set, measure(shard_set, args.repeats, FetchConfig()))
    if args.link_mbps > 0:
        paced = sets[-1]
        report(paced, measure(paced, args.repeats, FetchConfig(), args.link_mbps), args.link_mbps)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
