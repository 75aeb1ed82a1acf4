"""Who owns which coordinates of a round: part boundaries, owners, backups, and part hashes.

Every function here is a pure function of public, agreed values — d, the round's sorted member
list, and the θ hash h_r every member starts the round from — so every replica derives the same
map without a message.

- Parts (`part_bounds`): the encoded Δ of d values is cut into n contiguous coordinate ranges, one
  per member, at multiples of the encoding's block (256 values for int8: a part decodes on its own,
  and its int8 scales are those of the whole-vector encoding). Sizes differ by at most one block.
  With fewer blocks than members, some parts are empty (their owners reduce nothing).
- Owners (`owners`): part j belongs to members[π(j)], π a permutation seeded by
  sha256(stage, round, h_r, members). h_r is fixed by the previous round's gather — after every
  contributor of that round committed — so no replica can pick its part by choosing what it
  commits; the issue's alternative, a seed from this round's commitments, would need every honest
  replica to hold the same commitments before it could even scatter, and one member withholding its
  commitment from some replicas would split their ownership maps.
- Backups (`backup_chain`): if part j's owner withholds its aggregate or is proven to have lied,
  the next members along π take it over, in order, deterministically.
- Part hashes (`merkle_root`, `merkle_proofs`, `merkle_verify`): a commitment carries one Merkle
  root over its n part hashes, not n hashes — O(1) bytes however large the stage — and each part
  travels with its ⌈log2 n⌉ sibling hashes (32 bytes each) just before it in the Δ object, so
  one ranged read fetches a part and its proof.
- Anchored part hashes (`sum_tree_root`, `sum_tree_proofs`, `sum_tree_verify`): in a round with an
  anchor (``reduce.AnchorCheck``) the tree is a Merkle *sum* tree. Each leaf also carries two float64
  numbers of its part (the part's dot product with the anchor's part, and its squared norm), each
  inner node the sums of its children's, bound by its hash; the root's sums are the whole Δ's and
  the commitment states them. Whoever verifies one part's path recomputes every sum on it, so if
  each leaf is checked against its part's bytes by someone, the stated totals are the parts' —
  a contributor cannot state a whole-Δ cosine its parts do not have without a leaf or an inner
  sum on some part's path being false. A proof is the leaf's own sums (16 bytes) then ⌈log2 n⌉
  siblings of 48 bytes (hash and sums).
"""

from __future__ import annotations

import functools
import hashlib
import random
import struct
from collections.abc import Sequence

from ..codec import INT8_BLOCK

ALIGN = {"int8": INT8_BLOCK, "fp16": INT8_BLOCK}
"""Coordinates per alignment unit, by encoding. fp16 needs none, but one alignment for both keeps
the part map independent of the encoding a replica picked."""


def part_bounds(numel: int, n: int, align: int = INT8_BLOCK) -> list[tuple[int, int]]:
    """The n contiguous [start, end) coordinate ranges of a d = `numel` vector: part j holds blocks
    [⌊j·B/n⌋, ⌊(j+1)·B/n⌋) of the B = ⌈d / align⌉ blocks, the last block clipped at d."""
    if numel < 1 or n < 1 or align < 1:
        raise ValueError(f"part_bounds needs numel >= 1, n >= 1 and align >= 1; got {numel}, {n}, {align}")
    blocks = -(-numel // align)
    cuts = [min(numel, (j * blocks // n) * align) for j in range(n + 1)]
    return [(cuts[j], cuts[j + 1]) for j in range(n)]


def round_seed(stage: int, round_: int, base_hash: str, members: Sequence[str]) -> bytes:
    """sha256 over the round's identity and its sorted member list."""
    text = "\n".join(["neuroshard/partition/v1", str(stage), str(round_), base_hash, *members])
    return hashlib.sha256(text.encode()).digest()


def members_sha256(members: Sequence[str]) -> str:
    """sha256 of the sorted member list, as commitments and claims carry it."""
    return hashlib.sha256("\n".join(members).encode()).hexdigest()


def owners(stage: int, round_: int, base_hash: str, members: Sequence[str]) -> list[str]:
    """owners[j] = the wallet that reduces part j: a seeded permutation of the sorted `members`.

    `random.Random` seeded with bytes is specified (sha512 of the seed) and its `shuffle` is stable
    across CPython versions since 3.2 for the same seed; tests pin a known permutation."""
    if list(members) != sorted(set(members)):
        raise ValueError("members must be sorted and without repeats")
    order = list(members)
    random.Random(round_seed(stage, round_, base_hash, members)).shuffle(order)
    return order


def backup_chain(owner_list: Sequence[str], part: int, depth: int) -> list[str]:
    """Part `part`'s owner followed by its first `depth` backups: the next members along the
    owner permutation (`owner_list[(part + k) mod n]`)."""
    n = len(owner_list)
    return [owner_list[(part + k) % n] for k in range(min(depth, n - 1) + 1)]


EMPTY_LEAF = hashlib.sha256(b"\x02neuroshard/empty-part").digest()
"""Pads the leaves to a power of two, so every proof has exactly ⌈log2 n⌉ siblings and fits a
fixed slot in the Δ object. Its own domain byte keeps it distinct from every real leaf."""


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def leaf_hash(part_sha256: str) -> bytes:
    """Domain-separated leaf (0x00 prefix) so a leaf can never pass as an inner node (0x01)."""
    return hashlib.sha256(b"\x00" + bytes.fromhex(part_sha256)).digest()


def proof_depth(count: int) -> int:
    """Siblings in every proof of a tree over `count` leaves: ⌈log2 count⌉."""
    return max(0, (count - 1).bit_length())


def _levels(part_hashes: Sequence[str]) -> list[list[bytes]]:
    if not part_hashes:
        raise ValueError("a Merkle tree needs at least one leaf")
    width = 1 << proof_depth(len(part_hashes))
    level = [leaf_hash(h) for h in part_hashes] + [EMPTY_LEAF] * (width - len(part_hashes))
    levels = [level]
    while len(level) > 1:
        level = [_node(level[i], level[i + 1]) for i in range(0, len(level), 2)]
        levels.append(level)
    return levels


def merkle_root(part_hashes: Sequence[str]) -> str:
    """Root over the parts' sha256 hex digests, in part order."""
    return _levels(part_hashes)[-1][0].hex()


def merkle_proofs(part_hashes: Sequence[str]) -> list[bytes]:
    """Every leaf's proof: its ⌈log2 n⌉ sibling hashes from the leaf up, concatenated (32 bytes each)."""
    levels = _levels(part_hashes)[:-1]
    proofs = []
    for index in range(len(part_hashes)):
        siblings = []
        for depth, level in enumerate(levels):
            siblings.append(level[(index >> depth) ^ 1])
        proofs.append(b"".join(siblings))
    return proofs


def merkle_verify(root: str, part_sha256: str, index: int, count: int, proof: bytes) -> bool:
    """Whether `part_sha256` is leaf `index` of `count` leaves under `root`, given its proof bytes."""
    depth = proof_depth(count)
    if not 0 <= index < count or len(proof) != 32 * depth:
        return False
    node = leaf_hash(part_sha256)
    for level in range(depth):
        sibling = proof[32 * level : 32 * (level + 1)]
        node = _node(node, sibling) if (index >> level) % 2 == 0 else _node(sibling, node)
    return node.hex() == root


Sums = tuple[float, float]
"""(dot product with the anchor, squared norm) of a part, or of everything under a node."""
SUMS_BYTES = 16
SUM_SIBLING_BYTES = 32 + SUMS_BYTES
EMPTY_SUMS: Sums = (0.0, 0.0)


def pack_sums(sums: Sums) -> bytes:
    return struct.pack("<2d", *sums)


def unpack_sums(raw: bytes) -> Sums:
    dot, sq = struct.unpack("<2d", raw)
    return dot, sq


def _sum_leaf(part_sha256: str, sums: Sums) -> bytes:
    """A leaf of the sum tree (domain byte 0x03): the part's hash and its two numbers."""
    return hashlib.sha256(b"\x03" + bytes.fromhex(part_sha256) + pack_sums(sums)).digest()


def _sum_node(left: tuple[bytes, Sums], right: tuple[bytes, Sums]) -> tuple[bytes, Sums]:
    """An inner node (domain byte 0x04): the hash binds both children's hashes and sums; its sums
    are theirs added (float64 addition is exact to repeat: every verifier gets the same bits)."""
    (lh, ls), (rh, rs) = left, right
    digest = hashlib.sha256(b"\x04" + lh + pack_sums(ls) + rh + pack_sums(rs)).digest()
    return digest, (ls[0] + rs[0], ls[1] + rs[1])


def _sum_levels(part_hashes: Sequence[str], sums: Sequence[Sums]) -> list[list[tuple[bytes, Sums]]]:
    if not part_hashes or len(sums) != len(part_hashes):
        raise ValueError("a sum tree needs at least one leaf and one pair of sums per leaf")
    width = 1 << proof_depth(len(part_hashes))
    level = [(_sum_leaf(h, s), s) for h, s in zip(part_hashes, sums, strict=True)]
    level += [(EMPTY_LEAF, EMPTY_SUMS)] * (width - len(part_hashes))
    levels = [level]
    while len(level) > 1:
        level = [_sum_node(level[i], level[i + 1]) for i in range(0, len(level), 2)]
        levels.append(level)
    return levels


def sum_tree_root(part_hashes: Sequence[str], sums: Sequence[Sums]) -> tuple[str, Sums]:
    """The root hash (hex) and the total sums of the tree over the parts, in part order."""
    digest, total = _sum_levels(part_hashes, sums)[-1][0]
    return digest.hex(), total


def sum_tree_proofs(part_hashes: Sequence[str], sums: Sequence[Sums]) -> list[bytes]:
    """Every leaf's proof: its own sums, then its ⌈log2 n⌉ siblings (hash and sums) from the leaf up."""
    levels = _sum_levels(part_hashes, sums)[:-1]
    proofs = []
    for index in range(len(part_hashes)):
        chunks = [pack_sums(sums[index])]
        for depth, level in enumerate(levels):
            sibling_hash, sibling_sums = level[(index >> depth) ^ 1]
            chunks.append(sibling_hash + pack_sums(sibling_sums))
        proofs.append(b"".join(chunks))
    return proofs


@functools.cache
def _empty_subtrees(depth: int) -> tuple[tuple[bytes, Sums], ...]:
    """The label of a subtree of 2^level padding leaves, for level 0..depth−1: what a proof must
    show for a sibling that covers padding only (else a contributor could hang sums there that
    no owner ever reads)."""
    labels = [(EMPTY_LEAF, EMPTY_SUMS)]
    while len(labels) < depth:
        labels.append(_sum_node(labels[-1], labels[-1]))
    return tuple(labels[:depth])


def sum_proof_bytes(count: int) -> int:
    """Bytes of one sum-tree proof over `count` leaves."""
    return SUMS_BYTES + SUM_SIBLING_BYTES * proof_depth(count)


def sum_tree_verify(
    root: str, total: Sums, part_sha256: str, index: int, count: int, proof: bytes, *, padding: bool = True
) -> Sums | None:
    """The part's own sums if `part_sha256` with them is leaf `index` of `count` leaves under `root`,
    the path's sums add up to `total` exactly and every sibling over padding only is the empty
    subtree; else None. With ``padding=False`` the last condition is not checked (`padding_lie`)."""
    depth = proof_depth(count)
    if not 0 <= index < count or len(proof) != sum_proof_bytes(count):
        return None
    own = unpack_sums(proof[:SUMS_BYTES])
    node = (_sum_leaf(part_sha256, own), own)
    empty = _empty_subtrees(depth)
    for level in range(depth):
        at = SUMS_BYTES + SUM_SIBLING_BYTES * level
        sibling = (proof[at : at + 32], unpack_sums(proof[at + 32 : at + SUM_SIBLING_BYTES]))
        if padding and ((index >> level) ^ 1) << level >= count and sibling != empty[level]:
            return None  # a sibling over padding only must be the empty subtree, sums (0, 0)
        node = _sum_node(node, sibling) if (index >> level) % 2 == 0 else _sum_node(sibling, node)
    digest, sums = node
    return own if digest.hex() == root and sums == total else None


def padding_lie(root: str, total: Sums, part_sha256: str, index: int, count: int, proof: bytes) -> bool:
    """Whether this proof reaches the signed root and totals only through sums hung on padding
    leaves: the author's own signed lie (the root binds them), not a part damaged in transit."""
    return sum_tree_verify(root, total, part_sha256, index, count, proof, padding=False) is not None and (
        sum_tree_verify(root, total, part_sha256, index, count, proof) is None
    )
