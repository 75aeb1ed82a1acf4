"""The part map of a partitioned round: part boundaries, seeded owners, backup chains, and the Merkle
tree a commitment signs over its parts (node/outer/partition.py)."""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter

import pytest

from neuroshard.node.outer.partition import (
    backup_chain,
    members_sha256,
    merkle_proofs,
    merkle_root,
    merkle_verify,
    owners,
    part_bounds,
    proof_depth,
)

BLOCK = 256
BASE = "ab" * 32


def member_list(n: int) -> list[str]:
    """n sorted, distinct 64-hex wallets."""
    return [f"{i + 1:064x}" for i in range(n)]


def part_hashes(n: int, salt: str = "") -> list[str]:
    return [hashlib.sha256(f"part {i}{salt}".encode()).hexdigest() for i in range(n)]


# --- part_bounds -------------------------------------------------------------------------------

# Every 7th d up to 1100, plus each multiple of 256 and its neighbours.
DIMS = sorted(
    {d for d in range(1, 1101, 7)}
    | {k * BLOCK + e for k in range(5) for e in (-1, 0, 1) if k * BLOCK + e >= 1}
)


@pytest.mark.parametrize("n", range(1, 41))
def test_part_bounds_tile_the_vector_in_block_aligned_near_equal_parts(n: int) -> None:
    for d in DIMS:
        bounds = part_bounds(d, n)
        blocks = -(-d // BLOCK)
        assert len(bounds) == n, (d, n)
        assert bounds[0][0] == 0 and bounds[-1][1] == d, (d, n, bounds)
        for (_, end), (start, _) in itertools.pairwise(bounds):
            assert end == start, (d, n, bounds)  # contiguous: no gap, no overlap
        for a, b in bounds:
            assert 0 <= a <= b <= d, (d, n, bounds)
            assert a % BLOCK == 0, (d, n, bounds)  # a part decodes on its own
            assert b % BLOCK == 0 or b == d, (d, n, bounds)
        part_blocks = [-(-(b - a) // BLOCK) for a, b in bounds]
        assert sum(part_blocks) == blocks
        assert max(part_blocks) - min(part_blocks) <= 1, (d, n, bounds)
        # In values: the unclipped parts differ by at most one block.
        unclipped = [b - a for a, b in bounds if b != d]
        if unclipped:
            assert max(unclipped) - min(unclipped) <= BLOCK, (d, n, bounds)
        empty = sum(1 for a, b in bounds if a == b)
        assert empty == max(0, n - blocks), (d, n, bounds)  # empty parts only when blocks < n


def test_part_bounds_by_hand() -> None:
    assert part_bounds(1, 1) == [(0, 1)]
    assert part_bounds(1000, 1) == [(0, 1000)]
    assert part_bounds(1000, 2) == [(0, 512), (512, 1000)]
    assert part_bounds(1024, 4) == [(0, 256), (256, 512), (512, 768), (768, 1024)]
    assert part_bounds(300, 3) == [(0, 0), (0, 256), (256, 300)]
    assert part_bounds(10, 4, align=1) == [(0, 2), (2, 5), (5, 7), (7, 10)]


@pytest.mark.parametrize(("numel", "n", "align"), [(0, 1, 256), (1, 0, 256), (1, 1, 0), (-5, 2, 256)])
def test_part_bounds_refuses_empty_vectors_and_zero_members(numel: int, n: int, align: int) -> None:
    with pytest.raises(ValueError, match="part_bounds needs"):
        part_bounds(numel, n, align)


# --- owners and backups ------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 7, 40])
def test_owners_are_a_deterministic_permutation_of_the_members(n: int) -> None:
    members = member_list(n)
    got = owners(3, 11, BASE, members)
    assert sorted(got) == members and len(set(got)) == n
    assert owners(3, 11, BASE, members) == got
    assert owners(3, 11, BASE, tuple(members)) == got


def test_owners_pin_a_known_permutation() -> None:
    """random.Random(bytes).shuffle is stable across CPython versions; every replica must agree."""
    members = member_list(5)
    assert owners(0, 1, BASE, members) == [members[i] for i in (0, 2, 3, 1, 4)]


def test_owners_change_with_round_base_hash_stage_and_members() -> None:
    members = member_list(8)  # 8! = 40320 permutations: a fixed seed colliding by chance is negligible
    first = owners(0, 1, BASE, members)
    for round_ in range(2, 22):
        assert owners(0, round_, BASE, members) != first, round_
    for k in range(20):
        base = hashlib.sha256(f"theta {k}".encode()).hexdigest()
        assert owners(0, 1, base, members) != first, base
    assert owners(1, 1, BASE, members) != first
    # Another member list of the same size: the seed covers the list itself.
    others = member_list(9)[1:]
    assert [others.index(w) for w in owners(0, 1, BASE, others)] != [members.index(w) for w in first]


def test_each_member_owns_part_zero_about_equally_often() -> None:
    members = member_list(4)
    counts = Counter(owners(0, r, BASE, members)[0] for r in range(4000))
    assert set(counts) == set(members)
    for member in members:  # 1000 expected, sd ≈ 27
        assert 850 <= counts[member] <= 1150, counts


@pytest.mark.parametrize(
    "members",
    [
        [f"{2:064x}", f"{1:064x}"],  # unsorted
        [f"{1:064x}", f"{1:064x}", f"{2:064x}"],  # repeated
        [f"{3:064x}", f"{1:064x}", f"{2:064x}"],
    ],
)
def test_owners_refuse_unsorted_or_repeated_members(members: list[str]) -> None:
    with pytest.raises(ValueError, match="sorted and without repeats"):
        owners(0, 1, BASE, members)


def test_backup_chain_follows_the_owner_order_and_wraps_around() -> None:
    order = ["e", "c", "a", "d", "b"]
    assert backup_chain(order, 0, 0) == ["e"]
    assert backup_chain(order, 1, 2) == ["c", "a", "d"]
    assert backup_chain(order, 3, 2) == ["d", "b", "e"]
    assert backup_chain(order, 4, 3) == ["b", "e", "c", "a"]


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_backup_chain_depth_is_capped_at_the_other_members(n: int) -> None:
    order = owners(0, 4, BASE, member_list(n))
    for part in range(n):
        for depth in range(0, n + 3):
            chain = backup_chain(order, part, depth)
            assert len(chain) == min(depth, n - 1) + 1
            assert len(set(chain)) == len(chain)  # never the same member twice
            assert chain[0] == order[part]
            assert chain == [order[(part + k) % n] for k in range(len(chain))]
        assert sorted(backup_chain(order, part, 10 * n)) == sorted(order)


def test_members_sha256_depends_on_every_member_and_the_order() -> None:
    members = member_list(4)
    digest = members_sha256(members)
    assert digest == hashlib.sha256("\n".join(members).encode()).hexdigest()
    assert members_sha256(members[:3]) != digest
    assert members_sha256(list(reversed(members))) != digest


# --- Merkle tree -------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 8, 9, 70, 4096])
def test_proof_depth_is_ceil_log2(count: int) -> None:
    depth = proof_depth(count)
    assert 2**depth >= count and (depth == 0 or 2 ** (depth - 1) < count)


def test_every_proof_verifies_at_its_index_and_nowhere_else() -> None:
    for n in range(1, 71):
        hashes = part_hashes(n)
        root = merkle_root(hashes)
        proofs = merkle_proofs(hashes)
        assert len(proofs) == n
        others = range(n) if n <= 24 else sorted({0, 1, n // 2, n - 2, n - 1})
        for i, proof in enumerate(proofs):
            assert len(proof) == 32 * proof_depth(n), (n, i)
            assert merkle_verify(root, hashes[i], i, n, proof), (n, i)
            for j in others:
                if j != i:
                    assert not merkle_verify(root, hashes[i], j, n, proof), (n, i, j)
                    assert not merkle_verify(root, hashes[j], i, n, proof), (n, i, j)
            assert not merkle_verify(root, hashes[i], -1, n, proof)
            assert not merkle_verify(root, hashes[i], n, n, proof)


def test_a_tampered_part_sibling_root_or_proof_length_fails() -> None:
    for n in range(1, 71):
        hashes = part_hashes(n)
        root = merkle_root(hashes)
        for i, proof in enumerate(merkle_proofs(hashes)):
            forged = hashlib.sha256(f"forged {i}".encode()).hexdigest()
            assert not merkle_verify(root, forged, i, n, proof), (n, i)
            for level in range(len(proof) // 32):  # flip one bit in each sibling in turn
                bad = bytearray(proof)
                bad[32 * level + (i % 32)] ^= 0x01
                assert not merkle_verify(root, hashes[i], i, n, bytes(bad)), (n, i, level)
            wrong_root = merkle_root(part_hashes(n, salt="x"))
            assert not merkle_verify(wrong_root, hashes[i], i, n, proof), (n, i)
            assert not merkle_verify(root, hashes[i], i, n, proof + b"\x00" * 32), (n, i)
            assert not merkle_verify(root, hashes[i], i, n, proof + b"\x00"), (n, i)
            if proof:
                assert not merkle_verify(root, hashes[i], i, n, proof[:-1]), (n, i)
                assert not merkle_verify(root, hashes[i], i, n, proof[:-32]), (n, i)


def test_a_count_of_another_depth_fails() -> None:
    for n in range(1, 71):
        hashes = part_hashes(n)
        root = merkle_root(hashes)
        depth = proof_depth(n)
        for i, proof in enumerate(merkle_proofs(hashes)):
            for count in (2 ** (depth - 1) if depth else 0, 2**depth + 1, 2 * n + 1):
                if proof_depth(count) != depth and i < count:
                    assert not merkle_verify(root, hashes[i], i, count, proof), (n, i, count)


def test_the_count_is_agreed_not_bound_by_the_root() -> None:
    """The root binds the parts, not their number: a count with the same ⌈log2⌉ verifies too. Every
    caller passes len(members), which the commitment binds through members_sha256."""
    hashes = part_hashes(5)
    root, proofs = merkle_root(hashes), merkle_proofs(hashes)
    assert all(merkle_verify(root, hashes[i], i, count, proofs[i]) for i in range(5) for count in (6, 7, 8))


def test_roots_differ_for_different_part_lists() -> None:
    roots = set()
    for n in range(1, 71):
        hashes = part_hashes(n)
        root = merkle_root(hashes)
        roots.add(root)
        # CVE-2012-2459: a tree that pads by duplicating the last leaf gives [a, b, c] and
        # [a, b, c, c] one root. Padding with a distinct empty leaf keeps them apart.
        assert merkle_root([*hashes, hashes[-1]]) != root, n
        if n > 1:
            assert merkle_root(hashes[:-1]) != root, n
            assert merkle_root(list(reversed(hashes))) != root, n
            assert merkle_root([hashes[1], hashes[0], *hashes[2:]]) != root, n
        changed = [*hashes[:-1], hashlib.sha256(b"other").hexdigest()]
        assert merkle_root(changed) != root, n
    assert len(roots) == 70  # every prefix length gives its own root


def test_the_empty_part_hash_is_an_ordinary_leaf() -> None:
    """An empty part (blocks < members) hashes b"": its leaf differs from the padding leaf."""
    empty = hashlib.sha256(b"").hexdigest()
    assert merkle_root([empty] * 3) != merkle_root([empty] * 3 + [empty])
    assert merkle_root([empty] * 3) != merkle_root([empty] * 4)


def test_an_inner_node_cannot_pass_as_a_leaf() -> None:
    """Second preimage: without the leaf/node domain bytes, root([a, b, c, d]) would also be the root
    of the two "leaves" (root([a, b]), root([c, d]))."""
    a, b, c, d = part_hashes(4)
    root = merkle_root([a, b, c, d])
    left, right = merkle_root([a, b]), merkle_root([c, d])
    assert not merkle_verify(root, left, 0, 2, bytes.fromhex(right))
    assert not merkle_verify(root, right, 1, 2, bytes.fromhex(left))


def test_a_single_part_tree_has_an_empty_proof() -> None:
    (h,) = part_hashes(1)
    root = merkle_root([h])
    assert merkle_proofs([h]) == [b""]
    assert merkle_verify(root, h, 0, 1, b"")
    assert root == hashlib.sha256(b"\x00" + bytes.fromhex(h)).hexdigest()  # the domain-separated leaf


def test_a_tree_needs_a_leaf() -> None:
    with pytest.raises(ValueError, match="at least one leaf"):
        merkle_root([])
    with pytest.raises(ValueError, match="at least one leaf"):
        merkle_proofs([])
