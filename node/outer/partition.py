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
"""

from __future__ import annotations

import hashlib
import random
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
