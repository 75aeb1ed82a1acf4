"""The HTTP shard client against a loopback aiohttp server that drops, corrupts and refuses on purpose."""

from __future__ import annotations

import asyncio
import hashlib
import random
import shutil
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from aiohttp import web
from nacl.signing import SigningKey

from neuroshard.data import Manifest, ManifestError, ShardError, ShardInfo, load_shard
from neuroshard.data.fetch import FetchConfig, HttpShardSource, fetch_manifest, fetch_tokenizer
from neuroshard.data.manifest import MANIFEST_NAME, SIGNATURE_NAME, sign_manifest

FAST = FetchConfig(
    retries=3, backoff_base_s=0.001, backoff_cap_s=0.005, connect_timeout_s=2.0, read_timeout_s=2.0
)
"""Tiny backoff so retry tests take milliseconds; 4 requests per file at most."""


@dataclass
class Faults:
    """What the server does wrong, per file name, and how many more times (-1: forever)."""

    drop_halfway: Counter[str] = field(default_factory=Counter)
    stall_halfway: Counter[str] = field(default_factory=Counter)
    refuse_range: Counter[str] = field(default_factory=Counter)
    corrupt: Counter[str] = field(default_factory=Counter)
    status: dict[str, tuple[int, int]] = field(default_factory=dict)
    ignore_range: bool = False
    html: bool = False
    gate: dict[str, threading.Event] = field(default_factory=dict)
    """Hold the response for a file until the event is set."""

    @staticmethod
    def take(counter: Counter[str], name: str) -> bool:
        if counter[name] == 0:
            return False
        if counter[name] > 0:
            counter[name] -= 1
        return True


class FileServer:
    """A data set directory served by aiohttp.web on 127.0.0.1 from a background thread."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.faults = Faults()
        self.overrides: dict[str, bytes] = {}
        self.requests: list[tuple[str, str | None]] = []  # (file, Range header)
        self.not_modified: list[str] = []  # files answered 304 to an If-None-Match
        self.requested: dict[str, threading.Event] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        app = web.Application()
        app.router.add_get("/{name:.+}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()

    async def _start(self) -> None:
        self._release = asyncio.Event()
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}/data"

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._release.set)
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def count(self, name: str) -> int:
        return sum(1 for file, _ in self.requests if file == name)

    def ranges(self, name: str) -> list[str | None]:
        return [rng for file, rng in self.requests if file == name]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"].removeprefix("data/")
        self.requests.append((name, request.headers.get("Range")))
        self.requested.setdefault(name, threading.Event()).set()
        if name in self.faults.gate:
            await asyncio.get_running_loop().run_in_executor(None, self.faults.gate[name].wait, 10)
        status, times = self.faults.status.get(name, (200, 0))
        if times:
            self.faults.status[name] = (status, times - 1)
            return web.Response(status=status, text="busy")
        if self.faults.html:
            return web.Response(text="<html>please log in to the hotel wifi</html>", content_type="text/html")
        body = self.overrides.get(name)
        if body is None:
            path = self.root / name
            if not path.is_file():
                return web.Response(status=404)
            body = path.read_bytes()
        etag = f'"{hashlib.sha256(body).hexdigest()[:32]}"'
        if request.headers.get("If-None-Match") == etag:
            self.not_modified.append(name)
            return web.Response(status=304, headers={"ETag": etag})
        if Faults.take(self.faults.corrupt, name):
            body = body[:1000] + bytes([body[1000] ^ 0xFF]) + body[1001:]
        start = _range_start(request.headers.get("Range"))
        if start is not None and Faults.take(self.faults.refuse_range, name):
            return web.Response(status=416)
        if start is None or self.faults.ignore_range:
            start, status = 0, 200
        else:
            status = 206
        response = web.StreamResponse(status=status)
        response.content_length = len(body) - start
        response.content_type = "application/octet-stream"
        response.headers["ETag"] = etag
        if status == 206:
            response.headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
        await response.prepare(request)
        if Faults.take(self.faults.stall_halfway, name):
            await response.write(body[start : (start + len(body)) // 2])
            await self._release.wait()  # until the test is over: far past any read timeout
            return response
        if Faults.take(self.faults.drop_halfway, name):
            await response.write(body[start : (start + len(body)) // 2])
            assert request.transport is not None
            request.transport.close()  # mid-body: the client sees a short read
            return response
        await response.write(body[start:])
        await response.write_eof()
        return response


def _range_start(header: str | None) -> int | None:
    if header is None:
        return None
    assert header.startswith("bytes=") and header.endswith("-"), header
    return int(header[len("bytes=") : -1])


@pytest.fixture
def server(published) -> Iterator[FileServer]:
    srv = FileServer(published.directory)
    yield srv
    srv.stop()


class Lines(list[str]):
    def __call__(self, line: str) -> None:
        self.append(line)

    def having(self, text: str) -> list[str]:
        return [line for line in self if text in line]


def _source(server: FileServer, published, cache: Path, log: Lines, **config: object) -> HttpShardSource:
    cfg = replace(FAST, **config)
    return HttpShardSource(server.url, cache, published.dataset.tokenizer.vocab_size, config=cfg, log=log)


def _local(published, info: ShardInfo) -> torch.Tensor:
    return load_shard(published.directory, info, published.dataset.tokenizer.vocab_size)


def test_fetched_shards_equal_the_local_ones_and_the_second_fetch_is_served_from_cache(
    published, server: FileServer, tmp_path: Path
) -> None:
    shards = published.dataset.manifest.shards[:3]
    with _source(server, published, tmp_path, Lines()) as source:
        for info in shards:
            assert torch.equal(source.fetch(info), _local(published, info))
        again = source.fetch(shards[0])
        assert torch.equal(again, _local(published, shards[0]))
        assert source.stats.cache_hits == 1 and source.stats.downloads == 3
    assert [server.count(info.file) for info in shards] == [1, 1, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(info.file for info in shards)


def test_dropped_connection_resumes_with_a_range_request(
    published, server: FileServer, tmp_path: Path
) -> None:
    info = published.dataset.manifest.shards[1]
    size = (published.directory / info.file).stat().st_size
    server.faults.drop_halfway[info.file] = 1
    log = Lines()
    with _source(server, published, tmp_path, log) as source:
        tokens = source.fetch(info)
        assert source.stats.resumed == 1
    assert torch.equal(tokens, _local(published, info))
    assert server.ranges(info.file) == [None, f"bytes={size // 2}-"]
    assert log.having(f"resuming at byte {size // 2:,}")


def test_stalled_body_times_out_and_resumes(published, server: FileServer, tmp_path: Path) -> None:
    info = published.dataset.manifest.shards[1]
    size = (published.directory / info.file).stat().st_size
    server.faults.stall_halfway[info.file] = 1
    log = Lines()
    with _source(server, published, tmp_path, log, read_timeout_s=0.3) as source:
        assert torch.equal(source.fetch(info), _local(published, info))
    assert server.ranges(info.file) == [None, f"bytes={size // 2}-"]
    assert log.having("Timeout") and log.having("retry 1/3")


def test_drops_that_make_progress_do_not_use_up_the_retry_budget(
    published, server: FileServer, tmp_path: Path
) -> None:
    info = published.dataset.manifest.shards[1]
    server.faults.drop_halfway[info.file] = 4  # each delivers half of what is left: 40 KB, 20 KB, 10 KB, 5 KB
    log = Lines()
    with _source(server, published, tmp_path, log, retries=1, progress_bytes=4000) as source:
        assert torch.equal(source.fetch(info), _local(published, info))
        assert source.stats.resumed == 4
    assert server.count(info.file) == 5
    assert len(log.having("free retry")) == 4


def test_range_refused_with_416_restarts_from_byte_zero(
    published, server: FileServer, tmp_path: Path
) -> None:
    info = published.dataset.manifest.shards[2]
    size = (published.directory / info.file).stat().st_size
    server.faults.drop_halfway[info.file] = 1
    server.faults.refuse_range[info.file] = 1
    with _source(server, published, tmp_path, Lines()) as source:
        assert torch.equal(source.fetch(info), _local(published, info))
        assert source.stats.rejected == 1
    assert server.ranges(info.file) == [None, f"bytes={size // 2}-", None]


def test_server_ignoring_range_restarts_from_byte_zero(published, server: FileServer, tmp_path: Path) -> None:
    info = published.dataset.manifest.shards[2]
    server.faults.drop_halfway[info.file] = 1
    server.faults.ignore_range = True
    with _source(server, published, tmp_path, Lines()) as source:
        assert torch.equal(source.fetch(info), _local(published, info))
    assert server.count(info.file) == 2 and server.ranges(info.file)[1] is not None


def test_corrupt_bytes_are_refetched_and_never_loaded(
    published, server: FileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = published.dataset.manifest.shards[0]
    loaded: list[str] = []
    real_load = torch.load

    def spy(path: Path, **kwargs: object) -> object:
        raw = Path(path).read_bytes()
        loaded.append(hashlib.sha256(raw).hexdigest())
        return real_load(path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "load", spy)
    server.faults.corrupt[info.file] = 2
    log = Lines()
    with _source(server, published, tmp_path, log) as source:
        assert torch.equal(source.fetch(info), _local(published, info))
        assert source.stats.rejected == 2
    assert server.count(info.file) == 3
    assert len(log.having("is not the manifest's")) == 2
    assert loaded and set(loaded) == {info.sha256}  # only the good bytes were ever unpickled
    assert not list(tmp_path.glob(".*"))  # no partial file left behind


def test_always_corrupt_gives_up_after_the_retry_budget(
    published, server: FileServer, tmp_path: Path
) -> None:
    info = published.dataset.manifest.shards[0]
    server.faults.corrupt[info.file] = -1
    with (
        _source(server, published, tmp_path, Lines()) as source,
        pytest.raises(
            ShardError, match=r"shard 0: not fetched, gave up after 4 requests.*is not the manifest's"
        ),
    ):
        source.fetch(info)
    assert server.count(info.file) == 1 + FAST.retries
    assert not list(tmp_path.iterdir())


def test_server_down_retries_with_backoff_then_raises(published, tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on: connection refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = Lines()
    info = published.dataset.manifest.shards[0]
    source = HttpShardSource(f"http://127.0.0.1:{port}", tmp_path, 512, config=FAST, log=log)
    with source, pytest.raises(ShardError, match=r"gave up after 4 requests.*Cannot connect"):
        source.fetch(info)
    assert [line.split("; ")[-1].split(" in ")[0] for line in log] == ["retry 1/3", "retry 2/3", "retry 3/3"]


def test_backoff_is_full_jitter_under_a_doubling_ceiling_and_honours_retry_after() -> None:
    config = FetchConfig(backoff_base_s=0.5, backoff_cap_s=4.0)
    rng = random.Random(0)
    for failures, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (9, 4.0)]:
        delays = [config.backoff(failures, rng) for _ in range(2000)]
        assert 0.0 <= min(delays) < 0.02 * ceiling and 0.98 * ceiling < max(delays) <= ceiling
        assert abs(sum(delays) / len(delays) - ceiling / 2) < 0.05 * ceiling  # uniform: mean is half
    assert config.backoff(1, rng, retry_after=3) == 3.0
    assert config.backoff(1, rng, retry_after=120) == 4.0  # a server cannot park us past the cap


def test_503_is_retried_and_404_is_not(published, server: FileServer, tmp_path: Path) -> None:
    ok, missing = published.dataset.manifest.shards[:2]
    server.faults.status[ok.file] = (503, 2)
    with _source(server, published, tmp_path, Lines()) as source:
        assert torch.equal(source.fetch(ok), _local(published, ok))
        with pytest.raises(ShardError, match="server returned 404"):
            source.fetch(replace(missing, file="shard_999.pt"))
    assert server.count(ok.file) == 3 and server.count("shard_999.pt") == 1


def test_html_and_oversized_bodies_are_rejected(published, server: FileServer, tmp_path: Path) -> None:
    info = published.dataset.manifest.shards[0]
    server.faults.html = True
    with _source(server, published, tmp_path, Lines(), shard_overhead_bytes=1000) as source:
        with pytest.raises(ShardError, match="HTML page"):
            source.fetch(info)
        server.faults.html = False
        # The manifest says 100 tokens: at most 4 * 100 + 1000 bytes, far less than the file.
        with pytest.raises(ShardError, match=r"announces 81,\d+ bytes, more than the 1,400-byte cap"):
            source.fetch(replace(info, tokens=100))
        assert source.stats.rejected == 2 * (1 + FAST.retries) and source.stats.bytes == 0
    assert not list(tmp_path.iterdir())


def test_lru_eviction_under_a_small_cap_keeps_the_recently_used(
    published, server: FileServer, tmp_path: Path
) -> None:
    s0, s1, s2 = published.dataset.manifest.shards[:3]
    size = (published.directory / s0.file).stat().st_size
    with _source(server, published, tmp_path, Lines(), cache_bytes=int(2.5 * size)) as source:
        source.fetch(s0)
        source.fetch(s1)
        source.fetch(s0)  # s0 is now more recent than s1
        source.fetch(s2)  # evicts s1, the least recently used
        assert source.cache.names() == [s0.file, s2.file]
        source.fetch(s0)
        source.fetch(s1)
    assert [server.count(s.file) for s in (s0, s1, s2)] == [1, 2, 1]


def test_the_current_shard_is_not_evicted_even_over_the_cap(
    published, server: FileServer, tmp_path: Path
) -> None:
    s0, s1 = published.dataset.manifest.shards[:2]
    log = Lines()
    with _source(server, published, tmp_path, log, cache_bytes=1000, prefetch=1) as source:
        source.fetch(s0)
        source.prefetch([s1])
        source.wait_prefetched()
        assert set(source.cache.names()) == {s0.file, s1.file}  # both pinned: current and prefetched
        source.fetch(s1)  # s0 is no longer in use
        source.fetch(s1)
        assert source.cache.names() == [s1.file]
    assert server.count(s1.file) == 1
    assert log.having("cannot be evicted")


def test_cache_survives_a_restart_and_is_reverified_on_use(
    published, server: FileServer, tmp_path: Path
) -> None:
    s0, s1 = published.dataset.manifest.shards[:2]
    with _source(server, published, tmp_path, Lines()) as source:
        source.fetch(s0)
        source.fetch(s1)
    raw = bytearray((tmp_path / s1.file).read_bytes())
    raw[-5] ^= 0xFF  # damage on disk while the node was down
    (tmp_path / s1.file).write_bytes(bytes(raw))
    log = Lines()
    with _source(server, published, tmp_path, log) as source:
        assert source.cache.names() == [s0.file, s1.file]
        assert torch.equal(source.fetch(s0), _local(published, s0))
        assert torch.equal(source.fetch(s1), _local(published, s1))
    assert [server.count(s.file) for s in (s0, s1)] == [1, 2]
    assert log.having("shard 1: the cached copy failed verification")


def _leave_partial(cache: Path, info: ShardInfo, body: bytes) -> Path:
    """What a node stopped half-way through downloading `info` leaves in its cache."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f".{info.file}.part"
    path.write_bytes(body)
    return path


def test_a_partial_download_left_by_an_earlier_run_is_resumed_with_a_range_request(
    published, server: FileServer, tmp_path: Path
) -> None:
    info = published.dataset.manifest.shards[1]
    body = (published.directory / info.file).read_bytes()
    partial = _leave_partial(tmp_path, info, body[: len(body) // 3])
    log = Lines()
    with _source(server, published, tmp_path, log) as source:
        assert torch.equal(source.fetch(info), _local(published, info))
        assert source.stats.rejected == 0
    assert server.ranges(info.file) == [f"bytes={len(body) // 3}-"]
    assert log.having(f"resuming the partial download an earlier run left ({len(body) // 3:,} bytes)")
    assert not partial.exists() and (tmp_path / info.file).read_bytes() == body


def test_a_torn_partial_from_an_earlier_run_fails_the_hash_and_is_fetched_whole(
    published, server: FileServer, tmp_path: Path
) -> None:
    info = published.dataset.manifest.shards[1]
    body = (published.directory / info.file).read_bytes()
    torn = bytearray(body[: len(body) // 2])
    torn[100:200] = bytes(100)  # a crash left zeros where data should be
    _leave_partial(tmp_path, info, bytes(torn))
    loaded: list[int] = []
    with _source(server, published, tmp_path, Lines()) as source:
        real_load = source._load

        def spy(shard: ShardInfo, trusted: bool) -> torch.Tensor:
            loaded.append(shard.id)
            return real_load(shard, trusted)

        source._load = spy  # type: ignore[method-assign]
        assert torch.equal(source.fetch(info), _local(published, info))
        assert source.stats.rejected == 1
    assert server.ranges(info.file) == [f"bytes={len(body) // 2}-", None]
    assert loaded == [info.id]  # loaded once, after the whole body verified


def test_a_download_that_gives_up_keeps_its_bytes_for_the_next_run(
    published, server: FileServer, tmp_path: Path
) -> None:
    info = published.dataset.manifest.shards[1]
    size = (published.directory / info.file).stat().st_size
    server.faults.drop_halfway[info.file] = 1
    with (
        _source(server, published, tmp_path, Lines(), retries=0, progress_bytes=1 << 40) as source,
        pytest.raises(ShardError, match="not fetched"),
    ):
        source.fetch(info)
    assert (tmp_path / f".{info.file}.part").stat().st_size == size // 2
    with _source(server, published, tmp_path, Lines()) as source:  # the node restarts
        assert torch.equal(source.fetch(info), _local(published, info))
    assert server.ranges(info.file) == [None, f"bytes={size // 2}-"]


def test_partials_an_earlier_run_left_are_evicted_first_when_the_cache_is_full(
    published, server: FileServer, tmp_path: Path
) -> None:
    s0, s1 = published.dataset.manifest.shards[:2]
    body = (published.directory / s1.file).read_bytes()
    partial = _leave_partial(tmp_path, s1, body[: len(body) // 2])
    cap = (published.directory / s0.file).stat().st_size + 10
    with _source(server, published, tmp_path, Lines(), cache_bytes=cap) as source:
        assert torch.equal(source.fetch(s0), _local(published, s0))
        assert source.cache.names() == [s0.file]
    assert not partial.exists()


def test_a_full_cache_keeps_the_partial_of_the_shard_it_is_about_to_download(
    published, server: FileServer, tmp_path: Path
) -> None:
    s0, s1 = published.dataset.manifest.shards[:2]
    with _source(server, published, tmp_path, Lines()) as source:
        source.fetch(s0)
    body = (published.directory / s1.file).read_bytes()
    _leave_partial(tmp_path, s1, body[: len(body) // 2])
    cap = (published.directory / s0.file).stat().st_size + len(body) // 2  # full before s1 arrives
    with _source(server, published, tmp_path, Lines(), cache_bytes=cap) as source:
        assert torch.equal(source.fetch(s1), _local(published, s1))
    assert server.ranges(s1.file) == [f"bytes={len(body) // 2}-"]


def test_a_cached_file_written_to_after_download_is_hashed_again(
    published, server: FileServer, tmp_path: Path
) -> None:
    s0 = published.dataset.manifest.shards[0]
    log = Lines()
    with _source(server, published, tmp_path, log) as source:
        source.fetch(s0)
        source.fetch(s0)  # hashed on the way in: served without hashing again
        with (tmp_path / s0.file).open("r+b") as f:  # same inode, same size, different bytes
            f.seek(2000)
            f.write(b"\x00\x01\x02\x03")
        assert torch.equal(source.fetch(s0), _local(published, s0))
    assert server.count(s0.file) == 2
    assert log.having("shard 0: the cached copy failed verification")


def test_prefetch_downloads_the_next_shard_before_it_is_asked_for(
    published, server: FileServer, tmp_path: Path
) -> None:
    s0, s1, s2 = published.dataset.manifest.shards[:3]
    with _source(server, published, tmp_path, Lines(), prefetch=1) as source:
        source.fetch(s0)
        source.prefetch([s1, s2])  # only one ahead, by config
        assert server.requested.setdefault(s1.file, threading.Event()).wait(5)
        source.wait_prefetched()
        assert s1.file in source.cache.names()
        requests_before = len(server.requests)
        assert torch.equal(source.fetch(s1), _local(published, s1))
        assert len(server.requests) == requests_before
    assert server.count(s1.file) == 1 and server.count(s2.file) == 0


def test_fetch_joins_a_prefetch_under_way_instead_of_downloading_twice(
    published, server: FileServer, tmp_path: Path
) -> None:
    s1 = published.dataset.manifest.shards[1]
    gate = server.faults.gate[s1.file] = threading.Event()
    with _source(server, published, tmp_path, Lines()) as source:
        source.prefetch([s1])
        assert server.requested.setdefault(s1.file, threading.Event()).wait(5)
        threading.Timer(0.05, gate.set).start()
        assert torch.equal(source.fetch(s1), _local(published, s1))
    assert server.count(s1.file) == 1


def _republish(published, directory: Path, manifest: Manifest, key: SigningKey) -> None:
    shutil.copytree(published.directory, directory, dirs_exist_ok=True)
    (directory / MANIFEST_NAME).write_bytes(manifest.to_bytes())
    (directory / SIGNATURE_NAME).write_bytes(sign_manifest(manifest, key))


def test_manifest_with_a_bad_signature_is_refused_and_a_newer_valid_one_accepted(
    published, server: FileServer, tmp_path: Path
) -> None:
    current = published.dataset.manifest
    key = bytes(published.key.verify_key)
    assert fetch_manifest(server.url, key, config=FAST) == current
    newer = replace(current, version=current.version + 1, shards=current.shards[:-1])
    log = Lines()
    with _source(server, published, tmp_path, log) as source:
        assert source.refresh_manifest(current) is None  # same version: nothing to do, nothing logged
        assert not log
        server.overrides[MANIFEST_NAME] = newer.to_bytes()
        server.overrides[SIGNATURE_NAME] = sign_manifest(current, published.key)  # signature of other bytes
        assert source.refresh_manifest(current) is None
        assert log.having("manifest refresh refused") and log.having(f"keeping version {current.version}")
        server.overrides[SIGNATURE_NAME] = sign_manifest(newer, SigningKey(bytes(32)))  # another publisher
        assert source.refresh_manifest(current) is None
        assert len(log.having("does not verify against the pinned publisher key")) == 2
        impostor = replace(newer, publisher=bytes(SigningKey(bytes(32)).verify_key).hex())
        server.overrides[MANIFEST_NAME] = impostor.to_bytes()  # signed by our key, names another publisher
        server.overrides[SIGNATURE_NAME] = sign_manifest(impostor, published.key)
        assert source.refresh_manifest(current) is None
        assert log.having("not the pinned key")
        server.overrides[MANIFEST_NAME] = newer.to_bytes()
        server.overrides[SIGNATURE_NAME] = sign_manifest(newer, published.key)
        assert source.refresh_manifest(current) == newer
        assert source.refresh_manifest(newer) is None
        assert source.refresh_manifest(replace(newer, version=newer.version + 1)) is None  # a rollback
        assert log.having(f"the server has version {newer.version}, ours is {newer.version + 1}")
    with pytest.raises(ManifestError, match="does not verify"):
        fetch_manifest(server.url, bytes(SigningKey(bytes(32)).verify_key), config=FAST)


def test_manifest_polls_are_conditional_and_a_304_is_judged_like_the_same_bytes(
    published, server: FileServer, tmp_path: Path
) -> None:
    current = published.dataset.manifest
    newer = replace(current, version=current.version + 1, shards=current.shards[:-1])
    log = Lines()
    with _source(server, published, tmp_path, log) as source:
        assert source.refresh_manifest(current) is None  # downloaded whole, verified, ETag kept
        assert source.refresh_manifest(current) is None  # 304: nothing downloaded
        assert server.not_modified == [MANIFEST_NAME] and source.stats.manifest_not_modified == 1
        server.overrides[MANIFEST_NAME] = newer.to_bytes()
        server.overrides[SIGNATURE_NAME] = sign_manifest(newer, published.key)
        assert source.refresh_manifest(current) == newer  # new bytes, new ETag: fetched whole
        # The caller has not switched yet: a 304 now still means "the server has `newer`".
        assert source.refresh_manifest(current) == newer
        assert source.refresh_manifest(newer) is None
        assert server.not_modified == [MANIFEST_NAME] * 3
        assert source.refresh_manifest(replace(newer, version=newer.version + 1)) is None  # rollback
        assert log.having(f"the server has version {newer.version}, ours is {newer.version + 1}")


def test_watcher_hands_over_a_newer_manifest(published, server: FileServer, tmp_path: Path) -> None:
    current = published.dataset.manifest
    newer = replace(current, version=current.version + 1)
    server.overrides[MANIFEST_NAME] = newer.to_bytes()
    server.overrides[SIGNATURE_NAME] = sign_manifest(newer, published.key)
    with _source(server, published, tmp_path, Lines(), manifest_refresh_s=0.01) as source:
        assert source.newer_manifest() is None
        source.watch_manifest(current)
        for _ in range(500):
            if (got := source.newer_manifest()) is not None:
                break
            threading.Event().wait(0.01)
        assert got == newer
        assert source.newer_manifest() is None  # handed over once


def test_tokenizer_is_fetched_verified_and_cached(published, server: FileServer, tmp_path: Path) -> None:
    info = published.dataset.manifest.tokenizer
    path = fetch_tokenizer(server.url, info, tmp_path, config=FAST)
    assert path == tmp_path / "tokenizers" / f"{info.sha256}.json"
    assert path.read_bytes() == (published.directory / info.file).read_bytes()
    assert fetch_tokenizer(server.url, info, tmp_path, config=FAST) == path
    assert server.count(info.file) == 1
    server.faults.corrupt[info.file] = -1
    with pytest.raises(ManifestError, match=r"could not be fetched.*is not the manifest's"):
        fetch_tokenizer(server.url, info, tmp_path / "other", config=FAST)
    assert not (tmp_path / "other" / "tokenizers" / f"{info.sha256}.json").exists()


def test_config_rejects_nonsense_with_the_value() -> None:
    with pytest.raises(ValueError, match=r"FetchConfig.read_timeout_s = 0 is out of range"):
        FetchConfig(read_timeout_s=0)
    with pytest.raises(ValueError, match=r"backoff_cap_s 0\.1 < backoff_base_s 1"):
        FetchConfig(backoff_base_s=1, backoff_cap_s=0.1)
    with pytest.raises(ValueError, match="not http"):
        HttpShardSource("ftp://x", Path("/nonexistent"), 512, config=FAST, log=print)
    info = ShardInfo(id=0, file="shard_0.pt", sha256="", tokens=10, tokenizer_sha256="")
    assert FetchConfig().max_shard_bytes(info) == 40 + (1 << 16)


def test_a_newer_manifest_whose_tokenizer_is_not_there_yet_is_taken_once_it_is(
    published, server: FileServer, tmp_path: Path
) -> None:
    """The watcher hands each version over once; the node keeps it until its tokenizer can be fetched."""
    from neuroshard.data.dataset import open_remote_dataset, remote_updates
    from neuroshard.data.manifest import TokenizerInfo
    from neuroshard.tokenizer import BPETokenizer

    current = published.dataset.manifest
    grown = published.dataset.tokenizer.extend(["the lazy dog jumps " * 50], 8)
    info = TokenizerInfo(
        file=f"tokenizers/{grown.sha256}.json", sha256=grown.sha256, next_merge_id=grown.next_merge_id
    )
    newer = replace(current, version=current.version + 1, tokenizers=(*current.tokenizers, info))
    log = Lines()
    dataset = open_remote_dataset(
        server.url,
        bytes(published.key.verify_key),
        tmp_path,
        config=replace(FAST, manifest_refresh_s=0.05),
        log=log,
    )
    try:
        poll = remote_updates(dataset, log)
        server.overrides[MANIFEST_NAME] = newer.to_bytes()
        server.overrides[SIGNATURE_NAME] = sign_manifest(newer, published.key)
        deadline = 0
        while not any("manifest version 2 accepted" in line for line in log) and deadline < 200:
            threading.Event().wait(0.05)
            deadline += 1
        assert poll() is None and any("not taken yet" in line for line in log)
        server.overrides[info.file] = grown.to_bytes()
        taken = poll()
        assert taken is not None and taken.manifest.version == 2
        assert isinstance(taken.tokenizer, BPETokenizer) and taken.tokenizer.vocab_size == grown.vocab_size
        assert poll() is None
    finally:
        dataset.source.close()
