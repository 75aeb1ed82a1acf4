"""Reading shards: verify the sha256 first, then load with `weights_only=True`, then batch.

A shard is `shard_{id}.pt`: a flat int32 tensor of token ids written by `torch.save`.
Nothing is unpickled before its hash matches the signed manifest, and even then only
the restricted `weights_only` loader runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from .files import file_sha256
from .manifest import Manifest, ShardInfo


class ShardError(ValueError):
    """A shard that is missing, does not match its manifest entry, or is not a token tensor."""


def load_shard(directory: Path, info: ShardInfo, vocab_size: int) -> torch.Tensor:
    """The verified token tensor of one shard (1-D int32, `info.tokens` long, ids < vocab_size)."""
    path = directory / info.file
    if not path.is_file():
        raise ShardError(f"shard {info.id}: {path} is missing")
    actual = file_sha256(path)
    if actual != info.sha256:
        raise ShardError(
            f"shard {info.id}: sha256 {actual[:16]}… does not match the manifest's {info.sha256[:16]}…"
        )
    return read_tokens(path, info, vocab_size)


def read_tokens(path: Path, info: ShardInfo, vocab_size: int) -> torch.Tensor:
    """Load a shard file whose sha256 already matched, with the restricted loader, and check its shape.

    Callers must have verified the hash first (`load_shard` does; the HTTP cache hashes
    bytes as they arrive).
    """
    try:
        tokens = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # the restricted unpickler raises many types
        raise ShardError(f"shard {info.id}: {path} is not a tensor file ({type(exc).__name__})") from None
    if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.int32 or tokens.dim() != 1:
        raise ShardError(f"shard {info.id}: expected a flat int32 tensor")
    if tokens.numel() != info.tokens:
        raise ShardError(f"shard {info.id}: {tokens.numel()} tokens, the manifest says {info.tokens}")
    ids = tokens.numpy()  # a view: numpy's single-threaded min/max took 0.02 ms on 250k ids where
    # torch's took 13 ms, its OpenMP threads contending with training on a busy 2-core machine
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ShardError(f"shard {info.id}: token ids outside [0, {vocab_size})")
    return tokens


class ShardSource(Protocol):
    """Where a node's shards come from: a local directory, or an HTTP/CDN client with a disk cache."""

    def fetch(self, info: ShardInfo) -> torch.Tensor:
        """The verified token tensor of a shard (blocking). Raises ShardError when it cannot be had."""
        ...

    def prefetch(self, infos: Sequence[ShardInfo]) -> None:
        """Start getting these shards in the background; a no-op where that makes no sense."""
        ...

    def close(self) -> None:
        """Stop background work and release connections."""
        ...


class LocalShardSource:
    """Shards in a local directory, verified on every load."""

    def __init__(self, directory: Path, vocab_size: int) -> None:
        self._directory = directory
        self._vocab_size = vocab_size

    def fetch(self, info: ShardInfo) -> torch.Tensor:
        return load_shard(self._directory, info, self._vocab_size)

    def prefetch(self, infos: Sequence[ShardInfo]) -> None:
        return None

    def close(self) -> None:
        return None


@dataclass(kw_only=True)
class DataPosition:
    """Where a node is in its data; saved in checkpoints so a restart reads the same next batch."""

    order_index: int = 0
    """Index into the node's shard order (not the shard id)."""
    offset: int = 0
    """Sequences already read from the current shard (an index into its window permutation)."""

    @classmethod
    def of_shard(cls, order: list[int], shard_id: int, offset: int) -> DataPosition:
        """The position of `shard_id` at `offset` in `order`, or the order's start if the shard left it.

        Positions are saved by shard id, not order index: a newer manifest (more shards)
        gives the node a different order, and the index would then name another shard.
        """
        if shard_id in order:
            return cls(order_index=order.index(shard_id), offset=offset)
        return cls()


def window_order(seed: str, shard_id: int, num_windows: int) -> torch.Tensor:
    """The order in which a node reads one shard's windows: a permutation seeded by (seed, shard id).

    Reading windows in file order would fill each batch from one source file and make
    the loss swing with whatever file the shard happens to be in; a fixed permutation
    mixes them while staying a pure function the verifier can recompute.
    """
    digest = hashlib.sha256(f"{seed}:{shard_id}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.randperm(num_windows, generator=generator)


class BatchStream:
    """(input_ids, labels) batches walking the node's shards in order.

    A shard of N tokens holds (N - 1) // seq_len windows of `seq_len + 1` tokens at stride
    `seq_len`; labels are the inputs shifted by one. Each batch takes the next
    `batch_size` windows of the shard's permutation (`window_order`). The stream moves to
    the next shard in the order (wrapping around after the last) when the shard has fewer
    than `batch_size` windows left, when `rotate()` is called (the trainer's plateau test),
    or when a shard cannot be had — made with a tokenizer outside the manifest's lineage,
    or unavailable after the source's retries — which `on_skip` is told about.
    """

    def __init__(
        self,
        *,
        source: ShardSource,
        manifest: Manifest,
        order: list[int],
        seed: str,
        batch_size: int,
        seq_len: int,
        position: DataPosition | None = None,
        prefetch: int = 1,
        on_skip: Callable[[int, str], None] = lambda shard_id, reason: None,
    ) -> None:
        if not order:
            raise ValueError("empty shard order")
        largest = max(s.tokens for s in manifest.shards)
        if (largest - 1) // seq_len < batch_size:
            raise ValueError(
                f"a batch of {batch_size}x{seq_len} needs {batch_size * seq_len + 1} tokens "
                f"but the largest shard has {largest}"
            )
        self._source = source
        self._manifest = manifest
        self._order = order
        self._seed = seed
        self._batch_size = batch_size
        self._seq_len = seq_len
        self._prefetch = prefetch
        self._on_skip = on_skip
        self.position = position or DataPosition()
        self._loaded: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (order_index, tokens, windows)

    @property
    def tokens_per_batch(self) -> int:
        return self._batch_size * self._seq_len

    @property
    def shard_id(self) -> int:
        return self._order[self.position.order_index % len(self._order)]

    def saved_position(self) -> dict[str, int]:
        """What a checkpoint keeps: the current shard's id and the offset in it."""
        return {"shard_id": self.shard_id, "offset": self.position.offset}

    def update(self, source: ShardSource, manifest: Manifest, order: list[int]) -> None:
        """Switch to a newer manifest, staying on the current shard at the same offset."""
        current = self.shard_id
        self._source, self._manifest, self._order = source, manifest, order
        self.position = DataPosition.of_shard(order, current, self.position.offset)
        if self._loaded is not None and current in order:
            self._loaded = (self.position.order_index, self._loaded[1], self._loaded[2])
        else:
            self._loaded = None

    def rotate(self) -> None:
        """Move on to the next shard in the order now."""
        self._advance()

    def _advance(self) -> None:
        self.position = DataPosition(order_index=(self.position.order_index + 1) % len(self._order))

    def _current(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The current shard's tokens and window order, skipping shards that cannot be used."""
        for _ in range(len(self._order)):
            if self._loaded is not None and self._loaded[0] == self.position.order_index:
                return self._loaded[1], self._loaded[2]
            info = self._manifest.shard(self.shard_id)
            try:
                tokens = self._load(info)
            except ShardError as exc:
                self._on_skip(info.id, str(exc))
                self._advance()
                continue
            windows = window_order(self._seed, info.id, (tokens.numel() - 1) // self._seq_len)
            if windows.numel() < self._batch_size:
                self._on_skip(info.id, f"{info.tokens} tokens is too short for one batch")
                self._advance()
                continue
            self._loaded = (self.position.order_index, tokens, windows)
            return tokens, windows
        raise ShardError(f"none of the {len(self._order)} shards in this node's order can be used")

    def _load(self, info: ShardInfo) -> torch.Tensor:
        if not self._manifest.made_with_lineage(info):
            raise ShardError(
                f"shard {info.id} was made with tokenizer {info.tokenizer_sha256[:16]}…, "
                f"not one of this manifest's ({self._manifest.tokenizer.sha256[:16]}… and its ancestors)"
            )
        tokens = self._source.fetch(info)
        upcoming = [
            self._manifest.shard(self._order[(self.position.order_index + k) % len(self._order)])
            for k in range(1, self._prefetch + 1)
        ]
        self._source.prefetch(upcoming)
        return tokens

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), both (B, T) int64: views of `next_rows()`."""
        rows = self.next_rows()
        # labels[b, t] is the token after inputs[b, t]
        return rows[:, :-1], rows[:, 1:]

    def next_rows(self) -> torch.Tensor:
        """The next batch as one (B, T + 1) int64 tensor, inputs `[:, :-1]` and labels `[:, 1:]`:
        a trainer on an accelerator copies it in one transfer and takes both views there."""
        tokens, windows = self._current()
        if self.position.offset + self._batch_size > windows.numel():
            self._advance()
            tokens, windows = self._current()
        start = self.position.offset
        starts = windows[start : start + self._batch_size] * self._seq_len  # (B,)
        index = starts[:, None] + torch.arange(self._seq_len + 1)  # (B, T+1)
        rows = tokens[index].long()
        self.position = DataPosition(order_index=self.position.order_index, offset=start + self._batch_size)
        return rows

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()
