"""The node's shard cache: downloaded files on disk under a byte cap, least recently used evicted first.

Only whole, hash-checked downloads enter the cache (`commit` renames a finished
`PartialFile` into place). A file this process hashed on the way in is trusted while its
(inode, size, mtime) stay as committed (`verified`); any other file — one an earlier run
left, or one written to since — is hashed again by `load_shard` before it is unpickled,
and the caller deletes one that fails. That lazy check is also why fsync is optional: a
file torn by a power cut is caught on first use like any other bad file. Recency is the file's
mtime (bumped on every use), so the LRU order survives restarts; atime is useless for
this on `noatime`/`relatime` mounts.

`ShardCache` is not thread-safe: the HTTP client calls it only from its event-loop thread.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

PARTIAL_SUFFIX = ".part"
SHARD_SUFFIX = ".pt"
RESUME_READ_BYTES = 1 << 20


class PartialFile:
    """A download in progress: a temporary file plus the running sha256 of exactly its bytes.

    It outlives a dropped connection, so the retry asks for `Range: bytes={size}-` and
    carries on hashing where it stopped instead of reading the file back. It also outlives
    the process: `resume=True` picks up what an earlier run left at `path`, hashing those
    bytes once (~7 ms for a 10 MB shard) so a node on a slow link that was stopped half-way
    through a shard asks only for the rest. Bytes torn by a crash are caught by the final
    sha256 check, which restarts the file from byte 0. The hash runs
    inline on the event-loop thread: handing chunks to a hashing thread cost 15% more CPU
    per byte and was slower when the cores are busy (0.55 vs 0.65 of a plain download,
    A/B on bench_fetch.py's synthetic set at load average 4 on 2 cores), and a training
    node's cores are busy.
    """

    def __init__(self, path: Path, *, resume: bool = False) -> None:
        self.path = path
        self._hash = hashlib.sha256()
        self.size = 0
        self._file: BinaryIO
        if resume and path.is_file():
            self._file = path.open("r+b")
            while block := self._file.read(RESUME_READ_BYTES):
                self._hash.update(block)
                self.size += len(block)
        else:
            self._file = path.open("wb")

    def write(self, chunk: bytes) -> None:
        self._file.write(chunk)
        self._hash.update(chunk)
        self.size += len(chunk)

    def reset(self) -> None:
        """Start over from byte 0 (corrupt body, or the server ignored our Range)."""
        self._file.seek(0)
        self._file.truncate()
        self._hash = hashlib.sha256()
        self.size = 0

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def finish(self, *, fsync: bool) -> None:
        """Flush (and fsync, so a rename that follows cannot expose a file with holes after a crash)."""
        self._file.flush()
        if fsync:
            os.fsync(self._file.fileno())
        self._file.close()

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


class ShardCache:
    """Shard files in `directory`, at most `cap_bytes` of them unless pinned files alone exceed it."""

    def __init__(self, directory: Path, cap_bytes: int, log: Callable[[str], None], *, fsync: bool) -> None:
        if cap_bytes <= 0:
            raise ValueError(f"cache cap must be positive, got {cap_bytes} bytes")
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._cap = cap_bytes
        self._log = log
        self._fsync = fsync
        self._verified: dict[str, tuple[int, int, int]] = {}  # name -> _identity when committed
        self._sizes, self._leftovers = _index(directory)
        """name -> bytes, least recently used first; and partial downloads an earlier run left."""
        self._pins: Counter[str] = Counter()
        self._warned_full = False

    @property
    def total_bytes(self) -> int:
        return sum(self._sizes.values())

    def names(self) -> list[str]:
        """Cached file names, least recently used first."""
        return list(self._sizes)

    def __contains__(self, name: str) -> bool:
        return name in self._sizes

    def touch(self, name: str) -> bool:
        """Record a use (most recently used now, in memory and on disk); False if the file has vanished."""
        still_verified = self.verified(name)  # checked before utime changes the mtime it compares
        try:
            _stamp(self.directory / name)
        except FileNotFoundError:
            self._sizes.pop(name, None)
            return False
        if still_verified:
            self._verified[name] = _identity(self.directory / name)
        else:
            self._verified.pop(name, None)
        self._sizes.move_to_end(name)
        return True

    def pin(self, name: str) -> None:
        """Protect `name` from eviction (in use, or being downloaded/prefetched); pins nest."""
        self._pins[name] += 1

    def unpin(self, name: str) -> None:
        if self._pins[name] <= 0:
            raise RuntimeError(f"unpin of {name} which is not pinned")
        self._pins[name] -= 1
        if not self._pins[name]:
            del self._pins[name]

    def partial(self, name: str) -> PartialFile:
        """The download file for `name`, continuing what an earlier run of this cache left."""
        path = self.directory / f".{name}{PARTIAL_SUFFIX}"
        resumed = self._leftovers.pop(path.name, None) is not None
        if resumed:
            self._log(
                f"{name}: resuming the partial download an earlier run left ({path.stat().st_size:,} bytes)"
            )
        return PartialFile(path, resume=resumed)

    def keep(self, partial: PartialFile) -> None:
        """Set an unfinished download aside for a later `partial` call to continue (an empty one
        is deleted). Counted against the cap and evicted first."""
        partial.finish(fsync=False)
        if partial.size == 0:
            partial.path.unlink(missing_ok=True)
        else:
            self._leftovers[partial.path.name] = partial.size

    def commit(self, partial: PartialFile, name: str) -> Path:
        """Make a verified download visible under `name` and evict what no longer fits."""
        path = self.directory / name
        commit_partial(partial, path, fsync=self._fsync)
        _stamp(path)
        self._verified[name] = _identity(path)
        self._sizes[name] = partial.size
        self._sizes.move_to_end(name)
        self.make_room(0)
        return path

    def verified(self, name: str) -> bool:
        """True if this process hashed `name` while downloading it and the file is still that file."""
        try:
            return self._verified.get(name) == _identity(self.directory / name)
        except FileNotFoundError:
            return False

    def discard(self, name: str) -> None:
        """Delete a cached file (evicted, or failed verification)."""
        (self.directory / name).unlink(missing_ok=True)
        self._sizes.pop(name, None)
        self._verified.pop(name, None)

    def make_room(self, incoming: int) -> None:
        """Evict least recently used unpinned files until `incoming` more bytes fit under the cap.
        Partial downloads an earlier run left (for shards not asked for yet) go first."""
        excess = self.total_bytes + sum(self._leftovers.values()) + incoming - self._cap
        for name in list(self._leftovers):
            if excess <= 0:
                break
            if self._pins[name[1 : -len(PARTIAL_SUFFIX)]]:
                continue  # the shard about to be downloaded: its leftover is the head start
            excess -= self._leftovers.pop(name)
            (self.directory / name).unlink(missing_ok=True)
        for name in list(self._sizes):
            if excess <= 0:
                break
            if self._pins[name]:
                continue
            excess -= self._sizes[name]
            self.discard(name)
        if excess > 0 and not self._warned_full:
            # Pinned files are the current shard and the prefetched ones: a cap smaller than
            # (1 + prefetch) shards cannot be honoured, so say so once rather than thrash.
            self._warned_full = True
            self._log(
                f"shard cache {self.directory}: {self.total_bytes + incoming:,} bytes wanted, cap is "
                f"{self._cap:,}; {len(self._pins)} files in use or on their way cannot be evicted"
            )


def _index(directory: Path) -> tuple[OrderedDict[str, int], OrderedDict[str, int]]:
    """What an earlier run left: shard files by mtime (oldest first), and partial downloads
    (oldest first), each name -> bytes."""
    found: list[tuple[float, str, int]] = []
    partials: list[tuple[float, str, int]] = []
    for entry in os.scandir(directory):
        if not entry.is_file():
            continue
        stat = entry.stat()
        if entry.name.startswith(".") and entry.name.endswith(SHARD_SUFFIX + PARTIAL_SUFFIX):
            partials.append((stat.st_mtime, entry.name, stat.st_size))
        elif not entry.name.startswith(".") and entry.name.endswith(SHARD_SUFFIX):
            found.append((stat.st_mtime, entry.name, stat.st_size))
    found.sort()
    partials.sort()
    return (
        OrderedDict((name, size) for _, name, size in found),
        OrderedDict((name, size) for _, name, size in partials),
    )


def commit_partial(partial: PartialFile, path: Path, *, fsync: bool) -> None:
    """Rename the finished download onto `path` atomically (with `fsync`: file and directory synced).

    Readers in this process see no file or the whole verified one. Without fsync, a power
    cut can leave a torn file under the final name, which the next run's hash check rejects.
    """
    partial.finish(fsync=fsync)
    os.replace(partial.path, path)
    if fsync:
        _fsync_directory(path.parent)


def _stamp(path: Path) -> None:
    """Set the mtime to now from the fine clock. Kernels before 6.13 stamp writes from a coarse
    clock (one value per timer tick); a write in the same tick as our stamp still changes it."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _identity(path: Path) -> tuple[int, int, int]:
    """Changes when the file is replaced or written to (unless a writer forges the mtime too)."""
    stat = path.stat()
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
