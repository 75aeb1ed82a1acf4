"""Shard assignment is a pure function of node id and manifest, identical in every process."""

import hashlib
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from neuroshard.data import assign_shards


def _manifest_with(published, n: int):
    template = published.dataset.manifest.shards[0]
    return replace(
        published.dataset.manifest,
        shards=tuple(replace(template, id=i, file=f"shard_{i}.pt") for i in range(n)),
    )


def test_order_is_a_permutation_starting_at_sha256_mod_n(published) -> None:
    manifest = _manifest_with(published, 97)
    for node in ("a1b2c3", "wallet-x", "0" * 20):
        order = assign_shards(node, manifest)
        assert sorted(order) == list(range(97))
        assert order[0] == int(hashlib.sha256(node.encode()).hexdigest(), 16) % 97


def test_different_nodes_get_different_orders(published) -> None:
    manifest = _manifest_with(published, 50)
    orders = {tuple(assign_shards(f"node-{i}", manifest)) for i in range(20)}
    assert len(orders) == 20
    firsts = [assign_shards(f"node-{i}", manifest)[0] for i in range(200)]
    assert len(set(firsts)) > 35  # spread over the data set, not piled on a few shards


def test_assignment_is_identical_across_processes(published) -> None:
    """Python's hash() is salted per process; a fresh interpreter must still agree."""
    manifest = _manifest_with(published, 31)
    code = (
        "import json,sys\n"
        "from neuroshard.data import Manifest, assign_shards\n"
        "m = Manifest.from_bytes(sys.stdin.buffer.read())\n"
        "print(json.dumps([assign_shards(f'node-{i}', m) for i in range(10)]))\n"
    )
    outputs = [
        subprocess.run(
            [sys.executable, "-c", code],
            input=manifest.to_bytes(),
            capture_output=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout
        for seed in ("1", "2")
    ]
    here = [assign_shards(f"node-{i}", manifest) for i in range(10)]
    assert json.loads(outputs[0]) == json.loads(outputs[1]) == here


def test_held_out_shards_are_never_assigned(published) -> None:
    manifest = _manifest_with(published, 9)
    firsts = set()
    for i in range(60):
        order = assign_shards(f"node-{i}", manifest, exclude={0})
        assert sorted(order) == list(range(1, 9))
        firsts.add(order[0])
    assert firsts == set(range(1, 9))  # the remaining shards still spread evenly as first shards
    # Excluding a shard the manifest does not have changes nothing.
    assert assign_shards("n", manifest, exclude={42}) == assign_shards("n", manifest)
    with pytest.raises(ValueError, match="nothing to train on"):
        assign_shards("n", _manifest_with(published, 1), exclude={0})
