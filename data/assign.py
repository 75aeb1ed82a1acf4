"""Deterministic shard assignment: a node's shard order is a pure function of its id and the manifest.

Every process on every machine computes the same order for the same node, so the
verifier can re-derive which data a node claims to have trained on. Python's `hash()`
is salted per process and must never be used here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection

from .manifest import Manifest


def _digest_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest(), "big")


def assign_shards(node_id: str, manifest: Manifest, *, exclude: Collection[int] = ()) -> list[int]:
    """The node's shard order: every shard id not in `exclude` exactly once.

    The first shard is `sha256(node_id) mod total_shards`, spreading nodes evenly over
    the data set; the rest follow in a permutation seeded by the node id (sorted by
    sha256 of node id and shard id), so two nodes that start on the same shard diverge.
    `exclude` holds the verifier's held-out shard(s): data no node may train on. With
    exclusions the first shard is taken mod the number of remaining shards.
    """
    total = manifest.total_shards
    if total == 0:
        raise ValueError("the manifest lists no shards")
    allowed = [shard_id for shard_id in range(total) if shard_id not in exclude]
    if not allowed:
        raise ValueError(
            f"all {total} shards are excluded (held out: {sorted(exclude)}); nothing to train on"
        )
    first = allowed[_digest_int(node_id) % len(allowed)] if exclude else _digest_int(node_id) % total
    rest = sorted(
        (shard_id for shard_id in allowed if shard_id != first),
        key=lambda shard_id: hashlib.sha256(f"{node_id}:{shard_id}".encode()).digest(),
    )
    return [first, *rest]
