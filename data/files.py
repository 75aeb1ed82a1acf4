"""File primitives shared by publishers and nodes: atomic writes and streaming sha256."""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch

_HASH_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Run `write(tmp)`, fsync, rename onto `path`, fsync the directory.

    Readers see the old file or the new one, whole; a crash at any point never leaves a
    half-written `path` (a stray temp file at worst, which is removed on error).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """fsync `directory`, so that a file created or renamed in it survives a power cut (POSIX)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_torch_save_lock = threading.Lock()


def torch_save(obj: object, f: str | Path | IO[bytes], *, crc32: bool) -> None:
    """torch.save, writing its zip records' CRC-32s or not.

    torch.load never checks them (a byte flipped in a record loads silently), so checkpoints skip
    them: 0.8 s of the 2 s a 1.5 GB checkpoint took on an H100's host (bench/RESULTS.md, issue 14).
    Shards keep them, so the same tokens give the bytes they always gave. torch's switch is
    process-wide (torch ≥ 2.6; older versions always write them): it is set and restored under
    a lock held for the save, so saves made through here never see each other's setting (the
    codebase makes none elsewhere), at the price of running one at a time.
    """
    setter = getattr(torch.serialization, "set_crc32_options", None)
    with _torch_save_lock:
        if setter is None:
            torch.save(obj, f)
            return
        before = torch.serialization.get_crc32_options()
        setter(crc32)
        try:
            torch.save(obj, f)
        finally:
            setter(before)
