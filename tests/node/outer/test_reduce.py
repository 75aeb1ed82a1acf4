"""The pure maths of a partitioned round (node/outer/reduce.py): the Δ object and its parts, per-part
rules against the whole-vector rule, and fraud proofs (a correct owner is never accused, a wrong
aggregate always is, a bad proof never convicts)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from neuroshard.node.aggregation import aggregate, centered_clip, coordinate_median
from neuroshard.node.codec import decode_delta, encode_delta
from neuroshard.node.outer.partition import members_sha256, merkle_proofs, merkle_root, part_bounds
from neuroshard.node.outer.reduce import (
    AggregationRule,
    FraudCheck,
    check_fraud,
    decode_part,
    delta_object,
    encode_part,
    encoded_size,
    part_matches,
    part_spans,
    recompute,
    reduce_part,
    sha256_hex,
    split_slot,
)
from neuroshard.node.validation import ValidationConfig
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.round import AggregateClaim, Dropped, FraudProof, InputList, RoundCommitment

STAGE, ROUND = 2, 7
BASE = "cd" * 32


@functools.cache
def wallets(n: int, prefix: str = "outer-reduce") -> tuple[Wallet, ...]:
    """n wallets sorted by public key (the order of a round's member list)."""
    made = (Wallet.from_token(f"{prefix}-{i}") for i in range(n))
    return tuple(sorted(made, key=lambda w: w.public_key_hex))


def named(n: int) -> list[str]:
    """n sorted row names for reduce_part."""
    return [f"{i:02d}" for i in range(n)]


def rule_of(name: str, f: int = 0) -> AggregationRule:
    return lambda stack: aggregate(name, stack, f)


# --- the Δ object --------------------------------------------------------------------------------


def commitment_for(wallet: Wallet, root: str, numel: int, encoding: str, **over: object) -> RoundCommitment:
    fields: dict[str, object] = {
        "stage": STAGE,
        "round": ROUND,
        "base_hash": BASE,
        "members_sha256": "ee" * 32,
        "tokens": 100,
        "encoding": encoding,
        "numel": numel,
        "parts_root": root,
    }
    fields.update(over)
    return RoundCommitment.create(wallet, **fields)


@pytest.mark.parametrize("encoding", ["int8", "fp16"])
@pytest.mark.parametrize("d", [1, 255, 256, 257, 1000, 3000])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_every_span_of_the_delta_object_is_a_checkable_decodable_part(encoding: str, d: int, n: int) -> None:
    g = torch.Generator().manual_seed(d * 100 + n)
    delta = torch.randn(d, generator=g) * 0.02
    bounds = part_bounds(d, n)
    obj, root = delta_object(delta, bounds, encoding)
    commitment = commitment_for(wallets(1)[0], root, d, encoding)
    spans = part_spans(bounds, encoding)
    assert len(spans) == n and spans[0][0] == 0 and spans[-1][1] == len(obj)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end == start
    whole = decode_delta(encode_delta(delta, encoding), encoding, d)
    for j, ((a, b), (s, e)) in enumerate(zip(bounds, spans, strict=True)):
        proof, data = split_slot(obj[s:e], n)
        assert len(proof) == 32 * max(0, (n - 1).bit_length())
        assert len(data) == encoded_size(encoding, b - a)
        assert part_matches(commitment, j, n, proof, data), (j, a, b)
        k = (j + 1) % n
        if k != j and (bounds[k] != (a, b) or b > a):  # two empty parts: one leaf, either index
            assert not part_matches(commitment, k, n, proof, data), (j, k)
        got = decode_part(data, encoding, b - a)
        assert torch.equal(got, decode_part(encode_part(delta[a:b], encoding), encoding, b - a))
        # Parts start on int8 blocks, so a part's scales are those of the whole-vector encoding.
        assert torch.equal(got, whole[a:b]), (j, a, b)


def test_a_changed_byte_in_a_part_no_longer_matches_its_commitment() -> None:
    d, n = 1000, 4
    bounds = part_bounds(d, n)
    obj, root = delta_object(torch.randn(d), bounds, "int8")
    commitment = commitment_for(wallets(1)[0], root, d, "int8")
    for j, (s, e) in enumerate(part_spans(bounds, "int8")):
        for at in (s, (s + e) // 2, e - 1):  # in the proof slot, the header or the values
            raw = bytearray(obj[s:e])
            raw[at - s] ^= 0x10
            proof, data = split_slot(bytes(raw), n)
            assert not part_matches(commitment, j, n, proof, data), (j, at)


def test_empty_parts_are_empty_bytes() -> None:
    bounds = part_bounds(300, 4)  # 2 blocks, 4 members: two empty parts
    obj, root = delta_object(torch.ones(300), bounds, "int8")
    commitment = commitment_for(wallets(1)[0], root, 300, "int8")
    for j, ((a, b), (s, e)) in enumerate(zip(bounds, part_spans(bounds, "int8"), strict=True)):
        proof, data = split_slot(obj[s:e], 4)
        assert part_matches(commitment, j, 4, proof, data)
        assert (data == b"") == (a == b)
    assert torch.equal(decode_part(b"", "int8", 0), torch.zeros(0))
    with pytest.raises(Refused, match="empty part must be empty"):
        decode_part(b"\x00", "int8", 0)


def test_decode_part_refuses_a_part_of_another_length() -> None:
    values = torch.randn(300, generator=torch.Generator().manual_seed(8))
    fp16 = encode_part(values, "fp16")
    for numel in (299, 301, 512):
        with pytest.raises(Refused):
            decode_part(fp16, "fp16", numel)
    int8 = encode_part(values, "int8")
    for numel in (256, 299, 513):  # another block count, or a nonzero value where padding must be
        with pytest.raises(Refused):
            decode_part(int8, "int8", numel)
    for data, encoding in ((fp16, "fp16"), (int8, "int8")):
        with pytest.raises(Refused):
            decode_part(data[:-1], encoding, 300)


def test_an_int8_part_is_the_same_bytes_as_the_part_with_zeros_appended() -> None:
    """int8 codes are padded to whole blocks with zeros, so x and [x, 0] encode alike: no ambiguity."""
    values = torch.randn(300, generator=torch.Generator().manual_seed(8))
    int8 = encode_part(values, "int8")
    assert int8 == encode_part(torch.cat([values, torch.zeros(1)]), "int8")
    got = decode_part(int8, "int8", 301)
    assert torch.equal(got[:300], decode_part(int8, "int8", 300)) and got[300] == 0


@pytest.mark.parametrize("encoding", ["int8", "fp16"])
@pytest.mark.parametrize("numel", [0, 1, 255, 256, 257, 4096])
def test_encoded_size_does_not_depend_on_the_values(encoding: str, numel: int) -> None:
    g = torch.Generator().manual_seed(numel)
    for values in (torch.zeros(numel), torch.randn(numel, generator=g), torch.full((numel,), -3.5)):
        assert len(encode_part(values, encoding)) == encoded_size(encoding, numel)


# --- per-part rules against the whole-vector rule ------------------------------------------------


def per_part(stack: Tensor, bounds: list[tuple[int, int]], rule: AggregationRule) -> Tensor:
    """Each part reduced alone (as its owner does), concatenated: (n, d) -> (d,)."""
    names = named(stack.shape[0])
    pieces = []
    for a, b in bounds:
        rows = {w: stack[i, a:b].clone() for i, w in enumerate(names)}
        agg, refused = reduce_part(rows, rule, None)
        assert refused == {} and agg.dtype == torch.float32 and agg.shape == (b - a,)
        pieces.append(agg)
    return torch.cat(pieces)


def rows_for(n: int, d: int, seed: int) -> Tensor:
    """(n, d) float32 with ties and signed zeros, the cases an order-dependent reduction gets wrong."""
    g = torch.Generator().manual_seed(seed)
    stack = torch.randn(n, d, generator=g)
    stack[:, ::5] = torch.round(stack[:, ::5] * 2) / 2  # many exact ties
    stack[:, ::11] = 0.0
    stack[: n // 2, ::13] = -0.0
    return stack


COORDINATE_CASES = [
    (name, f, n)
    for name, f in [("median", 0), ("trimmed_mean", 1), ("trimmed_mean", 2)]
    for n in range(1, 10)
    if n > 2 * f  # the trimmed mean's bound
]


@pytest.mark.parametrize(("name", "f", "n"), COORDINATE_CASES)
def test_coordinate_wise_rules_decompose_bit_for_bit(name: str, f: int, n: int) -> None:
    rule = rule_of(name, f)
    for d in (1, 255, 256, 257, 700, 1800):
        stack = rows_for(n, d, seed=31 * n + d)
        whole = aggregate(name, stack, f)
        for k in sorted({1, 2, n, n + 3}):
            got = per_part(stack, part_bounds(d, k), rule)
            assert torch.equal(got, whole), (name, f, n, d, k, (got - whole).abs().max())


@pytest.mark.parametrize("n", [10, 11, 12, 16])
def test_the_median_decomposes_beyond_the_sorting_network(n: int) -> None:
    for d in (257, 513, 1800):
        stack = rows_for(n, d, seed=7 * n + d)
        whole = aggregate("median", stack)
        for k in (2, 3, n):
            assert torch.equal(per_part(stack, part_bounds(d, k), rule_of("median")), whole), (n, d, k)


def test_the_mean_decomposes_bit_for_bit() -> None:
    """Each column sums its own sorted values row by row: no order from the row bytes, no
    width-dependent reduction of torch's (a narrow last part used to differ by ~1e-7)."""
    for n in (*range(1, 10), 12, 17):
        for d in (1, 7, 257, 1000, 3000):
            stack = rows_for(n, d, seed=n * 1000 + d)
            whole = aggregate("mean", stack)
            for k in (1, 2, 3, n):
                got = per_part(stack, part_bounds(d, k), rule_of("mean"))
                assert torch.equal(got, whole), (n, d, k, (got - whole).abs().max())


def test_the_trimmed_mean_decomposes_bit_for_bit_above_eight_rows() -> None:
    """Above the sorting network's 8 rows: a per-column sort, then the same row-by-row sum."""
    for name, f in (("trimmed_mean", 1), ("trimmed_mean", 2)):
        for n in (12, 14, 16, 18, 20):
            for d in (257, 513):
                stack = torch.randn(n, d, generator=torch.Generator().manual_seed(n * 1000 + d))
                whole = aggregate(name, stack, f)
                for k in (2, 3, 5):
                    got = per_part(stack, part_bounds(d, k), rule_of(name, f))
                    assert torch.equal(got, whole), (name, f, n, d, k, (got - whole).abs().max())


def test_the_default_clips_each_part_around_that_parts_median() -> None:
    """The default (centered clipping, n ≥ 5) is a per-part variant: a row far away on one part
    only is clipped on that part and counts in full on the others."""
    n, d = 9, 600
    stack = rows_for(n, d, seed=5)
    stack[0, :200] += 1e4  # far on the first of three parts only
    bounds = part_bounds(d, 3)
    got = per_part(stack, bounds, rule_of("default"))
    for a, b in bounds:
        part = stack[:, a:b]
        assert torch.equal(got[a:b], centered_clip(part, coordinate_median(part)))
    first = stack[:, :200]
    tau = float((first - coordinate_median(first)).norm(dim=1).median())
    # Every pull is clipped to τ, so the part moves at most τ from its median (the mean: ~1e4/9 per coordinate).
    assert float((got[:200] - coordinate_median(first)).norm()) <= tau
    assert not torch.equal(got, aggregate("default", stack))  # not the whole-vector rule's columns


def test_per_part_krum_is_a_variant_that_picks_a_row_per_part() -> None:
    """Krum (Blanchard et al. 2017) is a whole-vector rule: per part it selects the most central row
    of that part, so the result is row-consistent within each part but may stitch different rows."""
    n, d, f = 5, 512, 1
    bounds = part_bounds(d, 2)  # [(0, 256), (256, 512)]
    g = torch.Generator().manual_seed(3)
    stack = torch.randn(n, d, generator=g)
    centre = stack[2:].mean(dim=0)
    stack[0, :256], stack[0, 256:] = centre[:256], 50.0  # central on part 0, an outlier on part 1
    stack[1, :256], stack[1, 256:] = 50.0, centre[256:]  # the reverse
    got = per_part(stack, bounds, rule_of("krum", f))
    assert torch.equal(got[:256], stack[0, :256])
    assert torch.equal(got[256:], stack[1, 256:])
    assert not any(torch.equal(got, stack[i]) for i in range(n))  # no whole row: a per-part variant
    whole = aggregate("krum", stack, f)
    assert any(torch.equal(whole, stack[i]) for i in range(n))
    assert not torch.equal(got, whole)


def test_reduce_part_depends_on_the_rows_not_their_order() -> None:
    stack = rows_for(6, 600, seed=5)
    names = named(6)
    forward = {w: stack[i] for i, w in enumerate(names)}
    backward = {w: stack[i] for i, w in reversed(list(enumerate(names)))}
    for name in ("mean", "median", "default"):
        a, _ = reduce_part(forward, rule_of(name), ValidationConfig())
        b, _ = reduce_part(backward, rule_of(name), ValidationConfig())
        assert torch.equal(a, b), name


# --- per-part screening ----------------------------------------------------------------------------


def honest_rows(n: int, d: int, seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(d, generator=g)
    return {w: common + 0.3 * torch.randn(d, generator=g) for w in named(n)}


def test_a_row_bad_on_one_part_is_refused_on_that_part_only() -> None:
    rows = honest_rows(5, 600, seed=1)
    bad = named(5)[4]
    rows[bad] = rows[bad].clone()
    rows[bad][256:] *= -4.0
    rule = rule_of("median")
    first, refused_first = reduce_part({w: r[:256] for w, r in rows.items()}, rule, ValidationConfig())
    second, refused_second = reduce_part({w: r[256:] for w, r in rows.items()}, rule, ValidationConfig())
    assert refused_first == {}
    assert set(refused_second) == {bad} and refused_second[bad]
    assert torch.equal(first, aggregate("median", torch.stack([r[:256] for r in rows.values()])))
    kept = torch.stack([rows[w][256:] for w in named(4)])
    assert torch.equal(second, aggregate("median", kept))


def test_fewer_than_three_rows_are_not_screened() -> None:
    rows = honest_rows(2, 300, seed=2)
    rows["01"] = -4.0 * rows["01"]
    agg, refused = reduce_part(rows, rule_of("mean"), ValidationConfig())
    assert refused == {}
    assert torch.equal(agg, aggregate("mean", torch.stack([rows["00"], rows["01"]])))


def test_an_all_zero_median_skips_screening() -> None:
    x = torch.randn(300, generator=torch.Generator().manual_seed(4))
    rows = {"00": torch.zeros(300), "01": torch.zeros(300), "02": x}
    agg, refused = reduce_part(rows, rule_of("mean"), ValidationConfig())
    assert refused == {}
    assert torch.equal(agg, aggregate("mean", torch.stack(list(rows.values()))))


def test_every_row_refused_gives_zeros() -> None:
    x = torch.randn(300, generator=torch.Generator().manual_seed(6))
    agg, refused = reduce_part(
        {"00": x, "01": x.clone(), "02": x.clone()}, rule_of("median"), ValidationConfig()
    )
    assert set(refused) == {"00", "01", "02"} and all(r.startswith("duplicate") for r in refused.values())
    assert torch.equal(agg, torch.zeros(300))


def test_no_rows_give_an_empty_aggregate() -> None:
    agg, refused = reduce_part({}, rule_of("median"), ValidationConfig())
    assert agg.shape == (0,) and refused == {}


# --- fraud proofs ----------------------------------------------------------------------------------


@dataclass
class Stage:
    """One round's members, their Δ objects and signed commitments."""

    wallets: tuple[Wallet, ...]
    members: tuple[str, ...]
    members_sha: str
    bounds: list[tuple[int, int]]
    commitments: dict[str, RoundCommitment]
    parts: dict[str, list[tuple[bytes, bytes]]]
    """wallet -> (Merkle proof, part bytes) per part, as an owner reads them."""

    @property
    def n(self) -> int:
        return len(self.members)


def make_stage(
    n: int, d: int, seed: int, encodings: tuple[str, ...] = ("int8",), undecodable: int | None = None
) -> Stage:
    """n members' Δ (a common direction plus noise) cut into n parts; member `undecodable` commits to
    parts that are not safetensors at all (they match its root, but do not decode)."""
    ws = wallets(n)
    members = tuple(w.public_key_hex for w in ws)
    msha = members_sha256(members)
    bounds = part_bounds(d, n)
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(d, generator=g) * 0.01
    commitments, parts = {}, {}
    for i, w in enumerate(ws):
        encoding = encodings[i % len(encodings)]
        delta = common + 0.003 * torch.randn(d, generator=g)
        if i == undecodable:
            garbage = [f"not safetensors {j}".encode() for j in range(n)]
            hashes = [sha256_hex(p) for p in garbage]
            root, read = merkle_root(hashes), list(zip(merkle_proofs(hashes), garbage, strict=True))
        else:
            obj, root = delta_object(delta, bounds, encoding)
            read = [split_slot(obj[s:e], n) for s, e in part_spans(bounds, encoding)]
        commitments[w.public_key_hex] = commitment_for(w, root, d, encoding, members_sha256=msha)
        parts[w.public_key_hex] = read
    return Stage(ws, members, msha, bounds, commitments, parts)


def inputs_of(stage: Stage, j: int, taken: list[str] | None = None) -> InputList:
    """The input list an honest owner of part j signs when it read the parts of `taken` (default all)."""
    taken = sorted(stage.members if taken is None else taken)
    return InputList(
        part=j,
        considered=tuple(stage.commitments[w] for w in taken),
        dropped=tuple(
            Dropped(wallet=w, reason="its part could not be read before the deadline")
            for w in stage.members
            if w not in taken
        ),
    )


def claim_for(
    owner: Wallet, stage: Stage, inputs: InputList, aggregate_bytes: bytes, accepted: int
) -> AggregateClaim:
    return AggregateClaim.create(
        owner,
        stage=STAGE,
        round=ROUND,
        base_hash=BASE,
        members_sha256=stage.members_sha,
        part=inputs.part,
        encoding="int8",
        replaces="",
        inputs_sha256=inputs.sha256(),
        accepted=accepted,
        aggregate_sha256=sha256_hex(aggregate_bytes),
    )


def proof_parts(stage: Stage, inputs: InputList) -> tuple[tuple[bytes, bytes], ...]:
    return tuple(stage.parts[c.wallet][inputs.part] for c in inputs.considered)


def honest(
    stage: Stage, j: int, rule: AggregationRule, validation: ValidationConfig | None, owner: int = 0
) -> tuple[FraudProof, bytes, int]:
    """A correct owner's claim of part j with its proof, the aggregate bytes and accepted count."""
    inputs = inputs_of(stage, j)
    a, b = stage.bounds[j]
    data = {c.wallet: stage.parts[c.wallet][j][1] for c in inputs.considered}
    agg, accepted, _ = recompute(inputs, data, b - a, "int8", rule, validation)
    claim = claim_for(stage.wallets[owner], stage, inputs, agg, accepted)
    return FraudProof(claim, inputs, proof_parts(stage, inputs)), agg, accepted


def verdict(
    stage: Stage,
    proof: FraudProof,
    rule: AggregationRule,
    validation: ValidationConfig | None,
    owner: str | None = None,
    round_: int = ROUND,
) -> FraudCheck:
    return check_fraud(
        proof,
        owner=proof.claim.wallet if owner is None else owner,
        members=stage.members,
        bounds=stage.bounds,
        stage=STAGE,
        round_=round_,
        base_hash=BASE,
        members_sha256=stage.members_sha,
        rule=rule,
        validation=validation,
    )


DEFAULT = rule_of("default")
SCREENINGS = [None, ValidationConfig()]


@pytest.mark.parametrize("validation", SCREENINGS, ids=["unscreened", "screened"])
def test_a_correct_owner_is_never_accused(validation: ValidationConfig | None) -> None:
    for seed in range(24):
        n = 1 + seed % 7
        stage = make_stage(n, 256 * n + 37 * seed + 1, seed, encodings=("int8", "fp16"))
        for j in range(n):
            proof, agg, _ = honest(stage, j, DEFAULT, validation, owner=seed % n)
            got = verdict(stage, proof, DEFAULT, validation)
            assert not got.fraud, (seed, j, got.reason)
            assert got.reason == "the claim is correct" and got.aggregate == agg
            assert FraudProof.decode(proof.encode()) == proof
            assert not verdict(stage, FraudProof.decode(proof.encode()), DEFAULT, validation).fraud


def test_recompute_counts_what_screening_refused() -> None:
    stage = make_stage(6, 1000, seed=9)
    j = 1
    liar = stage.members[3]
    a, b = stage.bounds[j]
    flipped = encode_part(-4.0 * decode_part(stage.parts[liar][j][1], "int8", b - a), "int8")
    data = {w: stage.parts[w][j][1] for w in stage.members} | {liar: flipped}
    agg, accepted, refused = recompute(inputs_of(stage, j), data, b - a, "int8", DEFAULT, ValidationConfig())
    assert set(refused) == {liar} and accepted == 5
    _, _, unscreened = recompute(inputs_of(stage, j), data, b - a, "int8", DEFAULT, None)
    assert unscreened == {}
    kept = torch.stack([decode_part(data[w], "int8", b - a) for w in stage.members if w != liar])
    assert agg == encode_part(aggregate("default", kept), "int8")


def test_an_empty_part_is_checkable() -> None:
    stage = make_stage(4, 300, seed=3)  # 2 blocks for 4 members: parts 0 and 2 are empty
    assert [b - a for a, b in stage.bounds] == [0, 256, 0, 44]
    for j in range(4):
        proof, agg, accepted = honest(stage, j, DEFAULT, ValidationConfig())
        assert accepted == 4 and (agg == b"") == (j in (0, 2))
        assert not verdict(stage, proof, DEFAULT, ValidationConfig()).fraud
        forged = claim_for(stage.wallets[0], stage, proof.inputs, b"\x00", accepted)
        assert verdict(stage, FraudProof(forged, proof.inputs, proof.parts), DEFAULT, None).fraud


def test_a_claim_over_no_inputs_is_checked_like_any_other() -> None:
    stage = make_stage(4, 1024, seed=3)
    inputs = inputs_of(stage, 1, taken=[])
    agg, accepted, refused = recompute(inputs, {}, 256, "int8", DEFAULT, None)
    assert accepted == 0 and refused == {}
    claim = claim_for(stage.wallets[1], stage, inputs, agg, accepted)
    assert not verdict(stage, FraudProof(claim, inputs, ()), DEFAULT, None).fraud
    forged = claim_for(stage.wallets[1], stage, inputs, encode_part(torch.ones(256), "int8"), accepted)
    assert verdict(stage, FraudProof(forged, inputs, ()), DEFAULT, None).fraud


def test_no_inputs_give_the_zero_aggregate_of_the_parts_length() -> None:
    stage = make_stage(4, 1024, seed=3)
    agg, _, _ = recompute(inputs_of(stage, 1, taken=[]), {}, 256, "int8", DEFAULT, None)
    assert agg == encode_part(torch.zeros(256), "int8")


def one_int8_step(data: bytes) -> bytes:
    """The same encoded aggregate with its first code moved by one step (±scale)."""
    tensors = st_load(data)
    q = tensors["q"].clone()
    q[0, 0] += 1 if int(q[0, 0]) < 127 else -1
    return st_save({"q": q, "scale": tensors["scale"]})


WRONG: dict[str, Callable[[bytes, bytes, int], tuple[bytes, int]]] = {
    "scaled": lambda agg, other, n: (encode_part(decode_part(agg, "int8", n) * 1.5, "int8"), -1),
    "one int8 step": lambda agg, other, n: (one_int8_step(agg), -1),
    "zeros": lambda agg, other, n: (encode_part(torch.zeros(n), "int8"), -1),
    "another part's aggregate": lambda agg, other, n: (other, -1),
    "accepted + 1": lambda agg, other, n: (agg, +1),
    "accepted - 1": lambda agg, other, n: (agg, -2),
}
"""name -> (honest aggregate, another part's aggregate, length) -> (claimed bytes, accepted: -1 means
the honest count, +1 one more, -2 one fewer)."""


@pytest.mark.parametrize("validation", SCREENINGS, ids=["unscreened", "screened"])
@pytest.mark.parametrize("wrong", list(WRONG))
def test_a_wrong_aggregate_is_always_convicted(wrong: str, validation: ValidationConfig | None) -> None:
    for seed in range(4):
        stage = make_stage(5, 1280, seed)  # five parts of one block each
        a, b = stage.bounds[2]
        _, other, _ = honest(stage, 3, DEFAULT, validation)
        proof, agg, accepted = honest(stage, 2, DEFAULT, validation)
        claimed, how = WRONG[wrong](agg, other, b - a)
        count = {-1: accepted, +1: accepted + 1, -2: accepted - 1}[how]
        assert (claimed, count) != (agg, accepted)
        if wrong == "one int8 step":
            diff = decode_part(claimed, "int8", b - a) - decode_part(agg, "int8", b - a)
            assert int((diff != 0).sum()) == 1
        claim = claim_for(stage.wallets[0], stage, proof.inputs, claimed, count)
        got = verdict(stage, FraudProof(claim, proof.inputs, proof.parts), DEFAULT, validation)
        assert got.fraud, (wrong, seed, got.reason)
        assert got.reason == "the signed aggregate is not what its signed inputs give"
        assert got.aggregate == agg  # what replaces the part


@pytest.mark.parametrize("validation", SCREENINGS, ids=["unscreened", "screened"])
def test_a_wrong_aggregate_is_convicted_on_every_part_with_mixed_encodings(
    validation: ValidationConfig | None,
) -> None:
    stage = make_stage(7, 2000, seed=11, encodings=("fp16", "int8", "int8"))
    for j in range(7):
        proof, agg, accepted = honest(stage, j, DEFAULT, validation, owner=j)
        a, b = stage.bounds[j]
        forged = encode_part(decode_part(agg, "int8", b - a) * -3.0, "int8")
        claim = claim_for(stage.wallets[j], stage, proof.inputs, forged, accepted)
        got = verdict(stage, FraudProof(claim, proof.inputs, proof.parts), DEFAULT, validation)
        assert got.fraud and got.aggregate == agg, (j, got.reason)


def bad_proofs(stage: Stage, proof: FraudProof) -> dict[str, tuple[FraudProof, dict[str, Any], str]]:
    """name -> (a proof a third party could forge from an honest claim, check_fraud overrides, the
    reason it must give). Each wrongs the owner: none may convict it."""
    claim, inputs, parts = proof.claim, proof.inputs, proof.parts
    j = claim.part
    other = stage.parts[stage.members[1]][(j + 1) % stage.n]
    flipped = bytearray(parts[0][1])
    flipped[-1] ^= 0x01
    d, first = stage.bounds[-1][1], inputs.considered[0]
    outsider = wallets(1, prefix="outsider")[0]
    stranger = commitment_for(outsider, first.parts_root, d, "int8", members_sha256=stage.members_sha)
    old = commitment_for(
        stage.wallets[0], first.parts_root, d, "int8", members_sha256=stage.members_sha, round=ROUND - 1
    )
    forged_claim = dataclasses.replace(claim, aggregate_sha256=sha256_hex(b"forged"))
    swapped = InputList(part=j, considered=(stranger, *inputs.considered[1:]), dropped=inputs.dropped)
    stale = InputList(
        part=j, considered=tuple(sorted((old, *inputs.considered[1:]), key=lambda c: c.wallet)), dropped=()
    )
    same = "the claim is not this round's claim of that owner"
    listed = "the input list is not the one the claim signs"
    return {
        "claim signature broken": (
            FraudProof(forged_claim, inputs, parts),
            {},
            "the claim's signature does not verify",
        ),
        "claim of another owner": (proof, {"owner": stage.members[1]}, same),
        "claim of another round": (proof, {"round_": ROUND + 1}, same),
        "an input left out": (
            FraudProof(claim, dataclasses.replace(inputs, considered=inputs.considered[1:]), parts[1:]),
            {},
            listed,
        ),
        "input list of another part": (
            FraudProof(claim, dataclasses.replace(inputs, part=j + 1), parts),
            {},
            listed,
        ),
        "a non-member's commitment swapped in": (FraudProof(claim, swapped, parts), {}, listed),
        "a commitment of another round swapped in": (FraudProof(claim, stale, parts), {}, listed),
        "a part missing": (
            FraudProof(claim, inputs, parts[:-1]),
            {},
            "the proof's parts do not match its input list",
        ),
        "a changed part": (
            FraudProof(claim, inputs, ((parts[0][0], bytes(flipped)), *parts[1:])),
            {},
            "part does not match its commitment",
        ),
        "another part in place of one": (
            FraudProof(claim, inputs, (other, *parts[1:])),
            {},
            "part does not match its commitment",
        ),
        "a tampered Merkle proof": (
            FraudProof(claim, inputs, ((bytes(32) + parts[0][0][32:], parts[0][1]), *parts[1:])),
            {},
            "part does not match its commitment",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "claim signature broken",
        "claim of another owner",
        "claim of another round",
        "an input left out",
        "input list of another part",
        "a non-member's commitment swapped in",
        "a commitment of another round swapped in",
        "a part missing",
        "a changed part",
        "another part in place of one",
        "a tampered Merkle proof",
    ],
)
def test_a_bad_proof_never_convicts(case: str) -> None:
    stage = make_stage(5, 1280, seed=21)
    proof, agg, _ = honest(stage, 2, DEFAULT, ValidationConfig())
    forged = encode_part(decode_part(agg, "int8", 256) * 2.0, "int8")
    # Against a correct claim and against a wrong one: a broken proof convicts neither.
    wrong_claim = claim_for(stage.wallets[0], stage, proof.inputs, forged, proof.claim.accepted)
    for base in (proof, FraudProof(wrong_claim, proof.inputs, proof.parts)):
        bad, overrides, reason = bad_proofs(stage, base)[case]
        got = verdict(stage, bad, DEFAULT, ValidationConfig(), **overrides)
        assert not got.fraud, (case, got.reason)
        assert reason in got.reason, (case, got.reason)
        assert got.aggregate is None


def junk_inputs(stage: Stage, j: int, kind: str) -> tuple[InputList, tuple[tuple[bytes, bytes], ...]]:
    """An input list an owner could sign with one input no correct owner takes, and its parts."""
    d = stage.bounds[-1][1]
    obj, root = delta_object(torch.full((d,), 0.5), stage.bounds, "int8")
    if kind == "non-member":  # signed by a throwaway key
        signer, round_ = wallets(1, prefix="outsider")[0], ROUND
    else:  # a member's commitment of the previous round
        signer, round_ = stage.wallets[0], ROUND - 1
    junk = commitment_for(signer, root, d, "int8", members_sha256=stage.members_sha, round=round_)
    spans = part_spans(stage.bounds, "int8")
    junk_part = split_slot(obj[spans[j][0] : spans[j][1]], stage.n)
    considered = sorted(
        (junk, *(c for c in inputs_of(stage, j).considered if c.wallet != junk.wallet)),
        key=lambda c: c.wallet,
    )
    parts = tuple(junk_part if c is junk else stage.parts[c.wallet][j] for c in considered)
    return InputList(part=j, considered=tuple(considered), dropped=()), parts


@pytest.mark.parametrize("kind", ["non-member", "another round"])
def test_an_input_no_correct_owner_takes_is_not_ruled_on_as_fraud(kind: str) -> None:
    """check_fraud as written: an owner-signed input list holding such an input gives fraud False."""
    stage = make_stage(5, 1280, seed=23)
    inputs, parts = junk_inputs(stage, 1, kind)
    data = {c.wallet: p[1] for c, p in zip(inputs.considered, parts, strict=True)}
    agg, accepted, _ = recompute(inputs, data, 256, "int8", DEFAULT, None)
    claim = claim_for(stage.wallets[2], stage, inputs, agg, accepted)
    got = verdict(stage, FraudProof(claim, inputs, parts), DEFAULT, None)
    expected = "not a member's signed commitment" if kind == "non-member" else "commitment of another round"
    assert expected in got.reason and got.aggregate is None


@pytest.mark.parametrize("kind", ["non-member", "another round"])
def test_an_owner_cannot_escape_conviction_by_signing_a_junk_input(kind: str) -> None:
    stage = make_stage(5, 1280, seed=23)
    inputs, parts = junk_inputs(stage, 1, kind)
    forged = encode_part(torch.full((256,), 9.0), "int8")
    claim = claim_for(stage.wallets[2], stage, inputs, forged, len(inputs.considered))
    got = verdict(stage, FraudProof(claim, inputs, parts), DEFAULT, None)
    assert got.fraud, got.reason


def test_an_input_that_matches_its_commitment_but_does_not_decode_is_the_owners_fault() -> None:
    """A correct owner drops an undecodable part (round._reduce); one that took it is convicted, with
    no replacement aggregate (which inputs to keep is the owner's call to make again)."""
    stage = make_stage(4, 1024, seed=5, undecodable=3)
    inputs = inputs_of(stage, 1)
    claim = claim_for(stage.wallets[0], stage, inputs, encode_part(torch.zeros(256), "int8"), 4)
    got = verdict(stage, FraudProof(claim, inputs, proof_parts(stage, inputs)), DEFAULT, None)
    assert got.fraud and "does not decode" in got.reason and got.aggregate is None
