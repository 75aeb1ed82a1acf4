"""One partitioned outer round of one stage, step by step, over a `RoundStore`.

The algorithm (BTARD's butterfly all-reduce with a robust rule per part, Gorbunov et al., ICML
2022), for n sorted members, d values and this replica's Δ:

1. COMMIT   cut Δ into n parts (``partition.part_bounds``), encode each, sign one
            ``RoundCommitment`` over their Merkle root, publish it, and read every member's.
2. SCATTER  publish the Δ object (each part behind its Merkle proof). Only now: a member that
            has not committed can no longer commit to a copy of what it reads.
3. REDUCE   for each part this replica owns (``partition.owners``): read that part of every
            committed member's Δ (one ranged read each), check it against the member's root,
            screen and aggregate it (``reduce.reduce_part``), publish the input list, the encoded
            aggregate and a signed ``AggregateClaim`` over both hashes.
4. GATHER   the witnesses of each part (``partition.backup_chain``: the members after its owner)
            read its claim and aggregate from the owner, or from another witness's echo if that
            comes first, and check the hash; past the deadline the next member of the chain
            reduces the part as a backup. Each witness publishes a signed ``Echo`` (the claim it
            holds, or none) and a copy of the aggregate. Nobody else reads owners' claims.
5. ECHO     every replica decides every part from its witnesses' echoes, which an honest witness
            shows alike to all: the earliest chain position with a claim decides; two claims
            there are equivocation (the part is zero this round, the signer reported, an
            ``EquivocationProof`` published); one claim is taken, its aggregate read by hash.
6. CHECK    recompute parts chosen by a seed fixed only after the echoes and known to this
            replica alone (a hash of its signature over every claim it holds), each with
            `check_probability`, from their signed inputs. A difference
            is a ``FraudProof``: published, the part replaced by its correct aggregate, the owner
            reported for a ban.
7. AGREE    publish a ``RoundDigest`` (one hash over the claims decided, the parts it holds fraud
            and equivocation proofs for) and read every member's; check the fraud proofs others
            name and apply those that convict the claim this replica decided, so one honest
            checker's proof settles a part alike everywhere (equivocation proofs are evidence only:
            the echoes already decided every part alike).
8. DONE     the (d,) aggregate to step with, and who was refused, banned, silent and why.

Probationers (``RoundInput.probationers``, issue #19; ``neuroshard.node.membership``) take part in
COMMIT and SCATTER only: each owner reads and screens their parts beside its round, after its
claim is out, and records the verdicts (``RoundResult.probation``); they are in no input list,
aggregate, chain, check or digest quorum, so the members compute exactly what they would
without them.

The module knows no carrier: HTTP, S3 and the simulator each implement ``port.RoundStore``.
It knows no DiLoCo either: the caller steps its engine with the result (``neuroshard.node.p2p.
plane``; the simulator). Per replica and round it moves about 2·d encoded bytes — its parts out
to their owners, every aggregated part in — plus ≈ 1.6–1.9·d for the checks (each re-reads one
part's n inputs) and O(n) small signed objects (n commitments, ~``backups``·n echoes, n
digests): nothing grows with n but the small objects.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import torch

from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.round import (
    AggregateClaim,
    Dropped,
    Echo,
    EquivocationProof,
    FraudProof,
    InputList,
    RoundCommitment,
    RoundDigest,
    SumLie,
    claims_sha256,
    sha256_hex,
)

from ..validation import ValidationConfig
from ..wallet import Wallet
from .partition import backup_chain, members_sha256, owners, part_bounds
from .port import RoundStore, object_name
from .reduce import (
    AggregationRule,
    AnchorCheck,
    FraudCheck,
    anchored_delta_object,
    check_fraud,
    check_sum_lie,
    decode_part,
    delta_object,
    encode_part,
    encoded_size,
    padding_problem,
    part_matches,
    part_spans,
    recompute,
    share_problem,
    split_slot,
)
from .state import Held, Phase, RoundConfig, RoundInput, RoundResult, check_probability

_RoundSigned = TypeVar("_RoundSigned", Echo, RoundDigest)
"""The small signed objects a replica reads by `OuterRound._read_signed`."""

SMALL_OBJECT_BYTES = 64 << 10
"""Cap on a commitment, claim or digest read (each is < 2 KB)."""
LIST_BYTES_PER_MEMBER = 2048
LIE_READS = 2
"""Finders whose evidence a replica reads per liar named in digests (one that convicts is enough;
a second covers a finder that does not serve it)."""
"""Cap per member on an input list read (an entry is < 1 KB)."""

Taken = tuple[AggregateClaim, bytes]
"""A claim with the encoded aggregate it names, both checked: what a gather read returns."""


RoundFactory = Callable[
    [RoundStore, Wallet, AggregationRule, "RoundConfig | None", Callable[[str], None]], "OuterRound"
]
"""Builds a replica's round from its carrier, wallet, rule, config and log: ``OuterRound`` itself
for an honest node; ``neuroshard.adversary`` passes its cheating subclasses."""


class OuterRound:
    """Runs rounds for one replica: `await OuterRound(store, wallet, rule, config).run(inp)`."""

    def __init__(
        self,
        store: RoundStore,
        wallet: Wallet,
        rule: AggregationRule,
        config: RoundConfig | None = None,
        log: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.store = store
        self.wallet = wallet
        self.me = wallet.public_key_hex
        self.rule = rule
        self.config = config or RoundConfig()
        self.log = log
        self.phase = Phase.DONE

    # --- the steps ---------------------------------------------------------------------------

    async def run(self, inp: RoundInput) -> RoundResult:
        """One round. A member runs every phase; a probationer (in ``inp.probationers``) commits and
        scatters its Δ, then reads the decided aggregates like a member, and owns, witnesses and
        checks nothing. A replica in neither list (a probationer the cap leaves out of this round)
        observes: it publishes nothing and steps with the stage's aggregate, so it stays on the
        stage's θ while it waits for a slot."""
        if not inp.members or list(inp.members) != sorted(set(inp.members)):
            raise ValueError("RoundInput.members must be non-empty, sorted and without repeats")
        if list(inp.probationers) != sorted(set(inp.probationers)) or set(inp.members) & set(
            inp.probationers
        ):
            raise ValueError("RoundInput.probationers must be sorted, without repeats, and not members")
        held = await self._commit(inp)
        clock = time.monotonic()
        held.result = RoundResult(aggregate=torch.zeros(inp.delta.numel()))
        steps = ((Phase.COMMIT, self._read_commitments), (Phase.SCATTER, self._scatter),
                 (Phase.REDUCE, self._reduce_owned), (Phase.GATHER, self._gather),
                 (Phase.ECHO, self._echo), (Phase.CHECK, self._check),
                 (Phase.AGREE, self._agree))  # fmt: skip
        for phase, step in steps:
            self.phase = phase
            await step(held)
            now = time.monotonic()
            held.result.seconds[phase.value] = now - clock
            clock = now
        self.phase = Phase.DONE
        await self._settle_probation(held)
        return self._finish(held)

    async def _commit(self, inp: RoundInput) -> Held:
        self.phase = Phase.COMMIT
        n, d = len(inp.members), inp.delta.numel()
        bounds = part_bounds(d, n)
        anchor, totals = None, {}
        if inp.anchor is not None:
            if inp.anchor.shape != inp.delta.shape:
                raise ValueError(
                    f"RoundInput.anchor has shape {tuple(inp.anchor.shape)}, Δ {tuple(inp.delta.shape)}"
                )
            anchor = AnchorCheck.of(inp.anchor, self.config.anchor_floor)
            delta_bytes, root, (dot, sq) = await asyncio.to_thread(
                anchored_delta_object, inp.delta, bounds, self.config.encoding, inp.anchor
            )
            totals = {"anchor_dot": dot, "sq_norm": sq}
        else:
            delta_bytes, root = await asyncio.to_thread(delta_object, inp.delta, bounds, self.config.encoding)
        members_sha = members_sha256(inp.members)
        commitment = RoundCommitment.create(
            self.wallet,
            stage=inp.stage,
            round=inp.round,
            base_hash=inp.base_hash,
            members_sha256=members_sha,
            tokens=inp.tokens,
            encoding=self.config.encoding,
            numel=d,
            parts_root=root,
            **totals,
        )
        if self._takes_part(inp):
            await self.store.publish(self._name(inp, "commit"), commitment.to_json())
        held = Held(
            inp=inp,
            members_sha=members_sha,
            bounds=bounds,
            owners=owners(inp.stage, inp.round, inp.base_hash, inp.members),
            commitment=commitment,
            delta_bytes=delta_bytes,
            anchor=anchor,
        )
        if self.me in inp.members:
            held.commitments[self.me] = commitment
        elif self.me in inp.probationers:
            held.probation[self.me] = commitment
        return held

    def _takes_part(self, inp: RoundInput) -> bool:
        """Whether this replica contributes this round (a member or a probationer), or only observes."""
        return self.me in inp.members or self.me in inp.probationers

    async def _read_commitments(self, held: Held) -> None:
        inp, result = held.inp, held.result
        assert result is not None

        async def read(member: str) -> None:
            raw = await self.store.fetch(
                member,
                self._name(inp, "commit"),
                max_bytes=SMALL_OBJECT_BYTES,
                wait_s=self.config.commit_timeout_s,
            )
            if raw is None:
                result.silent[member] = "no commitment before the commit deadline"
                return
            try:
                commitment = RoundCommitment.from_json(raw)
            except Refused as exc:
                result.refused[member] = f"commitment: {exc}"
                return
            reason = self._commitment_problem(held, member, commitment)
            if reason is not None:
                result.refused[member] = reason
            elif member in inp.banned:
                result.refused[member] = "banned in an earlier round"
            else:
                held.commitments[member] = commitment

        await asyncio.gather(*(read(m) for m in inp.members if m != self.me))
        result.committed = tuple(sorted(held.commitments))

    def _probation_commitments(self, held: Held) -> asyncio.Future[Any]:
        """The probationers' commitments, read once per round in the background when this replica
        first reduces a part (only owners and backups screen probationers). Nothing of the members'
        round waits for them: the screening that needs them runs beside the round, and whatever is
        not in when the round ends is cancelled (`_settle_probation`)."""
        if held.probation_reads is None:
            held.probation_reads = asyncio.gather(
                *(self._read_probationer(held, w) for w in held.inp.probationers), return_exceptions=True
            )
        return held.probation_reads

    async def _read_probationer(self, held: Held, wallet: str) -> None:
        """`wallet`'s commitment as a probationer, into `held.probation` if valid (else a verdict)."""
        assert held.result is not None
        raw = await self.store.fetch(
            wallet,
            self._name(held.inp, "commit"),
            max_bytes=SMALL_OBJECT_BYTES,
            wait_s=self.config.commit_timeout_s,
        )
        try:
            commitment = RoundCommitment.from_json(raw) if raw is not None else None
        except Refused as exc:
            held.result.probation[wallet] = f"commitment: {exc}"
            return
        if commitment is None:
            held.result.probation[wallet] = "no commitment before the commit deadline"
            return
        reason = self._commitment_problem(held, wallet, commitment)
        if reason is None and wallet in held.inp.banned:
            reason = "banned in an earlier round"
        if reason is not None:
            held.result.probation[wallet] = reason
        else:
            held.probation[wallet] = commitment

    def _commitment_problem(self, held: Held, author: str, c: RoundCommitment) -> str | None:
        inp = held.inp
        if c.wallet != author or not c.signature_valid():
            return "commitment not signed by its author"
        if (c.stage, c.round, c.members_sha256) != (inp.stage, inp.round, held.members_sha):
            return "commitment for another stage, round or member list"
        if c.base_hash != inp.base_hash:
            return f"base hash {c.base_hash[:16]} is not this round's θ hash {inp.base_hash[:16]}"
        if c.numel != inp.delta.numel():
            return f"numel {c.numel} is not the stage's {inp.delta.numel()}"
        if c.anchored != (held.anchor is not None):
            return "commitment " + (
                "states anchor sums in a round without an anchor"
                if c.anchored
                else "states no anchor sums in a round with an anchor"
            )
        return None

    async def _recompute(
        self, held: Held, inputs: InputList, parts: Mapping[str, bytes], length: int
    ) -> tuple[bytes, int, dict[str, str]]:
        """`reduce.recompute` of one part this replica reduces, with the round's screening and
        anchor, on a worker thread."""
        return await asyncio.to_thread(
            recompute,
            inputs,
            parts,
            length,
            self.config.encoding,
            self.rule,
            self._screening(held),
            held.anchor,
        )

    def _screening(self, held: Held) -> ValidationConfig | None:
        """The per-part screening of this round (wider limits may apply with an anchor)."""
        return self.config.screening(held.anchor is not None)

    async def _note_share_lies(
        self, held: Held, j: int, reads: Mapping[str, tuple[RoundCommitment, bytes, bytes]]
    ) -> None:
        """In a round with an anchor: report each author whose matched part j states sums in its leaf
        that are not the part's own (its signed commitment, the proof and the part show it); the
        evidence goes out with this replica's digest (`_agree`), so every member that checks it
        bans the liar too. The part stays in: whether a row is aggregated must not hang on a float
        tolerance, which an owner and its checkers could judge apart. Decoding every part again runs
        on a worker thread."""
        anchor = held.inp.anchor
        if held.anchor is None or anchor is None or not reads:
            return
        a, b = held.bounds[j]

        def lies() -> dict[str, str]:
            found = {}
            for author, (c, proof, data) in reads.items():
                reason = share_problem(c, b - a, proof, data, anchor[a:b])
                if reason is not None:
                    found[author] = reason
            return found

        for author, reason in (await asyncio.to_thread(lies)).items():
            c, proof, data = reads[author]
            self._found_lie(held, j, SumLie(c, j, proof, data), reason)

    def _found_lie(self, held: Held, j: int, lie: SumLie, reason: str) -> None:
        """Report `lie`'s signer and keep the evidence for the digest (members' lies only: a
        probationer's would convince nobody, members read members' evidence)."""
        author = lie.commitment.wallet
        self.log(f"round {held.inp.round}: part {j}: {author[:12]} lied about its anchor sums: {reason}")
        if held.result is not None:
            held.result.cheats.setdefault(author, f"part {j}: {reason}")
        if author in held.inp.members:
            held.lies.setdefault(author, lie)

    async def _scatter(self, held: Held) -> None:
        if self._takes_part(held.inp):
            await self.store.publish(self._name(held.inp, "delta"), held.delta_bytes)

    async def _reduce_owned(self, held: Held) -> None:
        mine = [j for j, owner in enumerate(held.owners) if owner == self.me]
        await asyncio.gather(*(self._reduce(held, j, replaces="") for j in mine))

    async def _read_part(
        self, held: Held, author: str, j: int, wait_s: float, commitment: RoundCommitment | None = None
    ) -> tuple[bytes, bytes] | str:
        """(proof, part bytes) of `author`'s part j checked against its commitment (the member's held
        one unless given), or why not."""
        commitment = commitment or held.commitments[author]
        n = len(held.inp.members)
        span = part_spans(held.bounds, commitment.encoding, commitment.anchored)[j]
        if author == self.me:
            raw: bytes | None = held.delta_bytes[span[0] : span[1]]
        else:
            raw = await self.store.fetch(
                author, self._name(held.inp, "delta"), max_bytes=span[1] - span[0], span=span, wait_s=wait_s
            )
        if raw is None or len(raw) != span[1] - span[0]:
            return "its part could not be read before the deadline"
        proof, data = split_slot(raw, n, commitment.anchored)
        if not part_matches(commitment, j, n, proof, data):
            lie = padding_problem(commitment, j, n, proof, data)
            if lie is not None and commitment.signature_valid() and author in held.inp.members:
                self._found_lie(held, j, SumLie(commitment, j, proof, data), lie)
            return f"part {j} does not match its signed commitment"
        return proof, data

    async def _reduce(self, held: Held, j: int, replaces: str) -> None:
        """Reduce part j as its owner (or as the backup of `replaces`) and publish the claim."""
        inp = held.inp
        a, b = held.bounds[j]
        authors = sorted(held.commitments)
        reads = await asyncio.gather(
            *(self._read_part(held, w, j, self.config.part_timeout_s) for w in authors)
        )
        parts, dropped = {}, []
        assert held.result is not None
        for author, got in zip(authors, reads, strict=True):
            if isinstance(got, str):
                dropped.append(Dropped(wallet=author, reason=got))
                held.result.refused.setdefault(author, f"part {j}: {got}")
            else:
                parts[author] = got[1]
        await self._note_share_lies(
            held,
            j,
            {
                w: (held.commitments[w], *got)
                for w, got in zip(authors, reads, strict=True)
                if not isinstance(got, str)
            },
        )
        for member in inp.members:
            if member not in held.commitments:
                dropped.append(Dropped(wallet=member, reason="no valid commitment held by the owner"))
        inputs = InputList(
            part=j,
            considered=tuple(held.commitments[w] for w in sorted(parts)),
            dropped=tuple(sorted(dropped, key=lambda x: x.wallet)),
        )
        try:
            aggregate, accepted, refused = await self._recompute(held, inputs, parts, b - a)
        except (Refused, ValueError) as exc:  # a part that matches its hash but does not decode
            self.log(f"round {inp.round}: part {j}: an input does not decode ({exc}); reducing without it")
            bad = {w for w, data in parts.items() if not _decodes(data, held.commitments[w].encoding, b - a)}
            for w in bad:
                del parts[w]
            inputs = InputList(
                part=j,
                considered=tuple(held.commitments[w] for w in sorted(parts)),
                dropped=tuple(sorted([*dropped, *(Dropped(wallet=w, reason="part does not decode") for w in bad)],
                                     key=lambda x: x.wallet)),
            )  # fmt: skip
            aggregate, accepted, refused = await self._recompute(held, inputs, parts, b - a)
        claim = AggregateClaim.create(
            self.wallet,
            **held.scope(),
            part=j,
            encoding=self.config.encoding,
            replaces=replaces,
            inputs_sha256=inputs.sha256(),
            accepted=accepted,
            aggregate_sha256=sha256_hex(aggregate),
        )
        # The claim goes last: whoever reads it can read what it names.
        await self.store.publish(self._name(inp, "inputs", j), inputs.to_json())
        await self.store.publish(self._agg_name(inp, j, claim.aggregate_sha256), aggregate)
        await self.store.publish(self._name(inp, "claim", j), claim.to_json())
        held.claims[j], held.aggregates[j], held.encodings[j] = claim, aggregate, claim.encoding
        assert held.result is not None
        for wallet, reason in refused.items():
            held.result.refused.setdefault(wallet, f"part {j}: {reason}")
        if inp.probationers and self.me in inp.members:  # in the background: nothing waits for them
            held.screening.append(asyncio.ensure_future(self._screen_probationers(held, j, inputs, parts)))

    async def _screen_probationers(
        self, held: Held, j: int, inputs: InputList, parts: Mapping[str, bytes]
    ) -> None:
        """Read and screen the probationers' parts j beside the members' (after the claim is out: the
        aggregate never waits for them). Screening judges each row against the round's robust
        reference, so the verdict is what a member's part would have got; the aggregate is
        untouched. A probationer's verdict is its first part's (an owner usually owns one part)."""
        result = held.result
        assert result is not None
        await asyncio.shield(self._probation_commitments(held))
        wallets = sorted(w for w in held.probation if w != self.me)
        reads = await asyncio.gather(
            *(self._read_part(held, w, j, self.config.part_timeout_s, held.probation[w]) for w in wallets)
        )
        trial = dict(parts)
        for wallet, got in zip(wallets, reads, strict=True):
            if isinstance(got, str):
                result.probation.setdefault(wallet, f"part {j}: {got}")
            else:
                trial[wallet] = got[1]
        tried = [w for w in wallets if w in trial]
        if not tried:
            return
        screened = InputList(
            part=j,
            considered=tuple(
                sorted([*inputs.considered, *(held.probation[w] for w in tried)], key=lambda c: c.wallet)
            ),
            dropped=(),
        )
        a, b = held.bounds[j]
        try:
            _, _, refused = await asyncio.to_thread(
                recompute,
                screened,
                trial,
                b - a,
                self.config.encoding,
                self.rule,
                self._screening(held),
                held.anchor,
            )
        except (Refused, ValueError) as exc:
            for w in tried:
                if not _decodes(trial[w], held.probation[w].encoding, b - a):
                    result.probation.setdefault(w, f"part {j}: part does not decode ({exc})")
            return
        for w in tried:
            reason = refused.get(w)
            result.probation.setdefault(
                w, f"part {j}: refused: {reason}" if reason else f"part {j}: passed screening (no weight)"
            )

    async def _read_claim(self, held: Held, j: int, owner: str, replaces: str, wait_s: float) -> bool:
        """Read part j's claim and aggregate from `owner`; True when both check out (then held)."""
        taken = await self._fetch_claim(held, j, owner, replaces, wait_s)
        if taken is not None:
            self._hold(held, *taken)
        return taken is not None

    async def _fetch_claim(
        self, held: Held, j: int, signer: str, replaces: str, wait_s: float
    ) -> Taken | None:
        """Part j's claim as `signer` serves it, with its aggregate, when both check out; holds nothing."""
        if signer == self.me:
            mine = held.claims.get(j)
            return (mine, held.aggregates[j]) if mine is not None and mine.wallet == self.me else None
        inp = held.inp
        raw = await self.store.fetch(
            signer, self._name(inp, "claim", j), max_bytes=SMALL_OBJECT_BYTES, wait_s=wait_s
        )
        if raw is None:
            return None
        try:
            claim = AggregateClaim.from_json(raw)
        except Refused:
            return None
        expected = (inp.stage, inp.round, inp.base_hash, held.members_sha, j, signer, replaces)
        got = (claim.stage, claim.round, claim.base_hash, claim.members_sha256, claim.part, claim.wallet,
               claim.replaces)  # fmt: skip
        if got != expected or not claim.signature_valid():
            return None
        # The aggregate is published before the claim: a short wait for it keeps a witness's worst
        # gather within `_echo`'s wait (a signer that names an aggregate it never serves is silent).
        return await self._fetch_aggregate(held, claim, min(wait_s, self.config.agree_timeout_s))

    async def _take_claim(
        self, held: Held, claim: AggregateClaim, wait_s: float, holders: tuple[str, ...] = ()
    ) -> bool:
        """Read the aggregate `claim` names (`_fetch_aggregate`); True when it checks out (then held)."""
        taken = await self._fetch_aggregate(held, claim, wait_s, holders)
        if taken is not None:
            self._hold(held, *taken)
        return taken is not None

    async def _fetch_aggregate(
        self, held: Held, claim: AggregateClaim, wait_s: float, holders: tuple[str, ...] = ()
    ) -> Taken | None:
        """`claim` with the aggregate it names, read by its hash (so an owner that signs two claims
        cannot tear a reader between one claim and the other's bytes) from its signer, else from
        `holders` (witnesses that echoed the claim keep a copy), when it checks out; holds nothing."""
        j = claim.part
        a, b = held.bounds[j]
        size = encoded_size(claim.encoding, b - a)
        name = self._agg_name(held.inp, j, claim.aggregate_sha256)
        for holder in dict.fromkeys((claim.wallet, *holders)):
            if holder == self.me:
                continue
            aggregate = await self.store.fetch(holder, name, max_bytes=size, wait_s=wait_s)
            if aggregate is None or sha256_hex(aggregate) != claim.aggregate_sha256:
                continue
            try:
                decode_part(aggregate, claim.encoding, b - a)
            except Refused:
                return None  # signed but undecodable: as good as withheld (and hash-bound: no copy differs)
            return claim, aggregate
        return None

    @staticmethod
    def _hold(held: Held, claim: AggregateClaim, aggregate: bytes) -> None:
        """Step with `claim` for its part (until the echoes or a fraud proof decide otherwise)."""
        j = claim.part
        held.claims[j], held.aggregates[j], held.encodings[j] = claim, aggregate, claim.encoding

    async def _gather(self, held: Held) -> None:
        """Witnesses gather the parts they witness; nobody else reads an owner's claim (see `_echo`),
        except where a part has no witness (one member, or ``backups`` = 0)."""
        await asyncio.gather(*(self._gather_part(held, j) for j in range(len(held.bounds))))

    def _chain(self, held: Held, j: int) -> list[str]:
        return backup_chain(held.owners, j, self.config.backups)

    async def _gather_part(self, held: Held, j: int) -> None:
        chain = self._chain(held, j)
        if len(chain) == 1:
            if chain[0] != self.me and not await self._read_claim(
                held, j, chain[0], "", self.config.gather_timeout_s
            ):
                assert held.result is not None
                held.result.silent.setdefault(chain[0], f"no valid aggregate of part {j} before the deadline")
            return
        if self.me in chain[1:]:
            await self._witness(held, j, chain)
            await self._publish_echo(held, j)

    async def _witness(self, held: Held, j: int, chain: list[str]) -> None:
        """Gather part j as one of its witnesses: down the chain, owner first, taking at each step
        the first valid claim to come, from the member at that step or from another witness's echo
        (so an owner that answers some witnesses only does not split them). When this replica's
        turn in the chain comes, it reduces the part itself as the backup."""
        result = held.result
        assert result is not None
        for k, signer in enumerate(chain):
            replaces = "" if k == 0 else chain[0]
            if signer == self.me:
                await self._reduce(held, j, replaces=replaces)
                return
            others = [w for w in chain[1:] if w not in (self.me, signer) and w in held.commitments]
            taken = await self._first_of(
                self._fetch_claim(held, j, signer, replaces, self.config.gather_timeout_s),
                *(self._echoed_claim(held, j, chain, k, w, self.config.gather_timeout_s) for w in others),
            )
            if taken is not None:
                self._hold(held, *taken)
                return
            result.silent.setdefault(signer, f"no valid aggregate of part {j} before the deadline")
        self.log(f"round {held.inp.round}: no valid aggregate of part {j} from {len(chain)} owner(s); zero")

    @staticmethod
    async def _first_of(*reads: Coroutine[Any, Any, Taken | None]) -> Taken | None:
        """The claim of the first read to return one, in the order the reads finish (the others are
        cancelled); None if none does. The reads hold nothing, the caller holds what this returns:
        on a loaded machine several reads finish in one turn of the event loop, and when each held
        its own claim the last one stayed, not the first (a witness read the owner's claim, then
        held another witness's echo of the owner's other claim, and the equivocation went unseen).
        A read that raises counts as failed: what it read came from another member and must not end
        the round."""
        tasks = [asyncio.ensure_future(r) for r in reads]
        try:
            for finished in asyncio.as_completed(tasks):
                try:
                    taken = await finished
                except Exception:
                    continue
                if taken is not None:
                    return taken
            return None
        finally:
            for task in tasks:
                task.cancel()

    async def _echoed_claim(
        self, held: Held, j: int, chain: list[str], step: int, witness: str, wait_s: float
    ) -> Taken | None:
        """The claim `witness` echoes for part j with its aggregate (from the signer or the witness),
        if it is a claim of part j at chain position `step` or earlier: a witness must not jump
        ahead to a backup's claim (another witness could forge one at once and show readers the
        owner's claim instead) while the member at `step` still has time to answer."""
        echo = await self._read_echo(held, j, witness, wait_s)
        if echo is None or not echo.claims or echo.claims[0].part != j:
            return None
        k = self._position(held, chain, echo.claims[0])
        if k is None or k > step:
            return None
        return await self._fetch_aggregate(held, echo.claims[0], wait_s=2.0, holders=(witness,))

    async def _publish_echo(self, held: Held, j: int) -> None:
        """As a witness of part j: publish the claim gathered for it (or none), and a copy of its
        aggregate for readers the signer does not serve."""
        inp, claim = held.inp, held.claims.get(j)
        if claim is not None and claim.wallet != self.me:  # this replica's own claims are published already
            await self.store.publish(self._agg_name(inp, j, claim.aggregate_sha256), held.aggregates[j])
        echo = Echo.create(
            self.wallet,
            **held.scope(),
            part=j,
            claims=() if claim is None else (claim,),
        )
        await self.store.publish(self._name(inp, "echo", j), echo.to_json())

    async def _read_echo(self, held: Held, j: int, witness: str, wait_s: float) -> Echo | None:
        """`witness`'s echo of part j, if it is signed by it and of this round and part."""
        echo = await self._read_signed(held, witness, self._name(held.inp, "echo", j), Echo, wait_s)
        return echo if echo is not None and echo.part == j else None

    async def _read_signed(
        self, held: Held, author: str, name: str, kind: type[_RoundSigned], wait_s: float
    ) -> _RoundSigned | None:
        """`author`'s small signed object `name`, if it parses as `kind`, is signed by `author` and
        belongs to this round (stage, round, base hash and member list); else None."""
        inp = held.inp
        raw = await self.store.fetch(author, name, max_bytes=SMALL_OBJECT_BYTES, wait_s=wait_s)
        try:
            msg = kind.from_json(raw) if raw is not None else None
        except Refused:
            return None
        if msg is None or msg.wallet != author:
            return None
        if (msg.stage, msg.round, msg.base_hash, msg.members_sha256) != (
            inp.stage, inp.round, inp.base_hash, held.members_sha):  # fmt: skip
            return None
        return msg if msg.signature_valid() else None

    async def _echo(self, held: Held) -> None:
        """Decide every part from its witnesses' echoes (``Echo``), which honest witnesses show alike
        to every replica, owners and witnesses included: an owner that shows different readers
        different claims, or some of them none, cannot split them. Of the chain positions the echoes
        show a claim at, the earliest decides: two different claims there are equivocation (the
        part is zero, the signer reported, the proof published as evidence); one claim is taken,
        its aggregate read by hash from its signer or a witness; no claim at all leaves the part
        zero. The wait covers a witness's slowest gather (every step of the chain timing out), so
        honest replicas leave this phase together. Per replica: ``backups`` small reads per part."""
        c = self.config
        # A witness's slowest gather: each earlier chain step times out on its claim (gather) and on
        # the aggregate it names (agree), then the witness reduces the part itself (part reads).
        wait = c.backups * (c.gather_timeout_s + c.agree_timeout_s) + c.part_timeout_s + c.agree_timeout_s
        chains = [self._chain(held, j) for j in range(len(held.bounds))]
        # Only members that committed (to this round's base hash and member list) can sign an echo
        # that counts; waiting on the others would only stall a replica whose θ went astray.
        targets = [
            (j, w)
            for j, chain in enumerate(chains)
            if len(chain) > 1
            for w in chain[1:]
            if w != self.me and w in held.commitments
        ]
        echoes = await asyncio.gather(*(self._read_echo(held, j, w, wait) for j, w in targets))
        echoed: dict[int, list[tuple[str, AggregateClaim]]] = {}
        for (j, witness), echo in zip(targets, echoes, strict=True):
            if echo is not None and echo.claims:
                echoed.setdefault(j, []).append((witness, echo.claims[0]))
        for j, chain in enumerate(chains):
            if self.me in chain[1:] and j in held.claims:
                echoed.setdefault(j, []).append((self.me, held.claims[j]))  # what this replica echoed
        await asyncio.gather(
            *(
                self._decide(held, j, chain, echoed.get(j, []))
                for j, chain in enumerate(chains)
                if len(chain) > 1
            )
        )
        held.gathered = dict(held.claims)

    def _position(self, held: Held, chain: list[str], claim: AggregateClaim) -> int | None:
        """The chain position `claim` is valid at (its signer's, naming the owner it replaces), or None."""
        inp = held.inp
        if claim.wallet not in chain:
            return None
        k = chain.index(claim.wallet)
        expected = (inp.stage, inp.round, inp.base_hash, held.members_sha, "" if k == 0 else chain[0])
        if (claim.stage, claim.round, claim.base_hash, claim.members_sha256, claim.replaces) != expected:
            return None
        if held.claims.get(claim.part) != claim and not claim.signature_valid():
            return None
        return k

    async def _decide(
        self, held: Held, j: int, chain: list[str], echoed: list[tuple[str, AggregateClaim]]
    ) -> None:
        result = held.result
        assert result is not None
        at: dict[int, dict[AggregateClaim, list[str]]] = {}
        for witness, claim in echoed:
            k = self._position(held, chain, claim) if claim.part == j else None
            if k is not None:
                at.setdefault(k, {}).setdefault(claim, []).append(witness)
        if not at:
            held.claims.pop(j, None)  # an owner's own claim no witness holds: zero, like every reader
            held.aggregates.pop(j, None)
            result.silent.setdefault(chain[0], f"no witness of part {j} holds a claim of it")
            return
        k = min(at)
        if k > 0:
            result.silent.setdefault(
                chain[0], f"no valid aggregate of part {j}: its witnesses took a backup's"
            )
        if len(at[k]) > 1:
            first, second = sorted(at[k], key=lambda c: c.sha256())[:2]
            proof = EquivocationProof(claims=(first, second))
            if self._takes_part(held.inp):
                await self.store.publish(self._name(held.inp, "equivocation", j), proof.to_json())
            self._apply_equivocation(held, j, chain[k])
            return
        ((claim, witnesses),) = at[k].items()
        if held.claims.get(j) == claim:
            return
        if not await self._take_claim(held, claim, wait_s=2.0, holders=tuple(witnesses)):
            held.claims.pop(j, None)
            held.aggregates.pop(j, None)
            self.log(
                f"round {held.inp.round}: part {j}: witnesses hold {claim.wallet[:12]}'s claim; its aggregate did not come"
            )

    def _apply_equivocation(self, held: Held, j: int, signer: str) -> None:
        """Zero part j this round (every replica holding the proof alike) and report its signer."""
        assert held.result is not None
        if j not in held.equivocations:
            self.log(f"round {held.inp.round}: part {j}: {signer[:12]} signed two aggregates; zero")
        held.result.cheats[signer] = (
            f"equivocation: signed two aggregates for part {j} of round {held.inp.round}"
        )
        held.claims.pop(j, None)
        held.aggregates.pop(j, None)
        held.equivocations.add(j)

    def _check_seed(self, held: Held) -> random.Random:
        """The checks' seed: a hash of this replica's own signature over the round and the claims it
        gathered. Fixed only after every claim is in (an owner cannot re-sign after seeing it), and
        unpredictable to everyone else (Ed25519 signatures are deterministic but need the secret key),
        so an owner cannot grind its claim until no replica's seed picks its part."""
        message = f"neuroshard/check/v2\n{held.inp.stage}\n{held.inp.round}\n{claims_sha256(held.gathered)}"
        return random.Random(hashlib.sha256(self.wallet.sign(message.encode())).digest())

    async def _check(self, held: Held) -> None:
        result = held.result
        assert result is not None
        if self.me not in held.inp.members:
            return  # a probationer's proofs would reach nobody (members read members' digests only)
        others = sorted(
            j for j, c in held.claims.items() if c.wallet != self.me and held.bounds[j][1] > held.bounds[j][0]
        )
        rng = self._check_seed(held)
        if self.config.checks is not None:
            picked = sorted(rng.sample(others, min(self.config.checks, len(others))))
        else:
            p = check_probability(len(held.inp.members), self.config.check_miss)
            picked = [j for j in others if rng.random() < p]
        result.checked = tuple(picked)
        await asyncio.gather(*(self._check_part(held, j) for j in picked))

    async def _check_part(self, held: Held, j: int) -> None:
        result, inp, claim = held.result, held.inp, held.claims[j]
        assert result is not None
        n = len(inp.members)
        raw = await self.store.fetch(
            claim.wallet, self._name(inp, "inputs", j), max_bytes=LIST_BYTES_PER_MEMBER * n + 4096, wait_s=5.0
        )
        try:
            inputs = InputList.from_json(raw) if raw is not None else None
        except Refused:
            inputs = None
        if inputs is None or inputs.sha256() != claim.inputs_sha256:
            self.log(
                f"round {inp.round}: part {j}: owner {claim.wallet[:12]} does not serve the inputs it signed"
            )
            result.silent.setdefault(claim.wallet, f"did not serve the inputs of part {j} for a check")
            return
        for c in inputs.considered:  # a member with two signed commitments is an equivocator
            mine = held.commitments.get(c.wallet)
            if mine is not None and mine != c and c.signature_valid() and c.round == inp.round:
                result.cheats[c.wallet] = f"equivocation: signed two commitments for round {inp.round}"
        reads = await asyncio.gather(*(self._read_input(held, c, j) for c in inputs.considered))
        if any(r is None for r in reads):
            self.log(f"round {inp.round}: part {j}: an input of the claim could not be read; not checked")
            return
        await self._note_share_lies(
            held,
            j,
            {
                c.wallet: (c, *got)
                for c, got in zip(inputs.considered, reads, strict=True)
                if got is not None and (held.commitments.get(c.wallet) == c or c.signature_valid())
            },
        )
        proof = FraudProof(claim, inputs, tuple(r for r in reads if r is not None))
        verdict = await self._verify(held, proof)
        if verdict.fraud:
            self.log(f"round {inp.round}: part {j}: owner {claim.wallet[:12]} cheated: {verdict.reason}")
            await self.store.publish(self._name(inp, "fraud", j), proof.encode())
            self._apply_fraud(held, j, proof.claim, verdict.reason, verdict.aggregate)

    async def _verify(self, held: Held, proof: FraudProof) -> FraudCheck:
        """`reduce.check_fraud` of `proof` against this round, on a worker thread."""
        inp = held.inp
        return await asyncio.to_thread(
            check_fraud,
            proof,
            owner=proof.claim.wallet,
            members=inp.members,
            bounds=held.bounds,
            stage=inp.stage,
            round_=inp.round,
            base_hash=inp.base_hash,
            members_sha256=held.members_sha,
            rule=self.rule,
            validation=self._screening(held),
            anchor=held.anchor,
        )

    async def _read_input(self, held: Held, c: RoundCommitment, j: int) -> tuple[bytes, bytes] | None:
        saved = held.commitments.get(c.wallet)
        held.commitments[c.wallet] = c  # read it against the commitment the owner used
        try:
            got = await self._read_part(held, c.wallet, j, wait_s=5.0)
        finally:
            if saved is None:
                del held.commitments[c.wallet]
            else:
                held.commitments[c.wallet] = saved
        return None if isinstance(got, str) else got

    def _apply_fraud(
        self, held: Held, j: int, claim: AggregateClaim, reason: str, aggregate: bytes | None
    ) -> None:
        """Replace part j by the aggregate its signed inputs give (what a backup owner would compute
        from the same inputs, so every replica holding the proof steps alike) and report the owner.
        When the inputs themselves convict the owner (a junk or undecodable input it took), there is
        no correct aggregate of them: the part is zero this round, on every replica alike."""
        assert held.result is not None
        if aggregate is None:
            a, b = held.bounds[j]
            aggregate = encode_part(torch.zeros(b - a), claim.encoding)
        held.result.cheats[claim.wallet] = f"fraud on part {j} of round {held.inp.round}: {reason}"
        held.claims.pop(j, None)
        held.frauds.add(j)
        if j not in held.equivocations:  # an equivocated part is zero, whatever else was proven
            held.aggregates[j], held.encodings[j] = aggregate, claim.encoding

    async def _agree(self, held: Held) -> None:
        """Publish this replica's digest, read every member's, and check the proofs others name.

        A fraud proof replaces a part only when it convicts the very claim this replica decided
        from the echoes (so a member cannot rewrite a part with a proof against a claim of its own
        making). Equivocation proofs named in digests are not fetched: every part was decided alike
        from the echoes, and a proof shown to some replicas only (an owner's own second claim) would
        split their verdicts and bans; the proof stays published as evidence for third parties.
        Fraud proofs are fetched concurrently under one deadline, one per (finder, part): a digest
        naming 64 parts it holds no proof for costs one wait, not 64."""
        inp = held.inp
        digest = RoundDigest.create(
            self.wallet,
            **held.scope(),
            claims_sha256=claims_sha256(held.gathered),
            frauds=tuple(sorted(held.frauds))[:64],
            equivocations=tuple(sorted(held.equivocations))[:64],
            lies=tuple(sorted(held.lies))[:64] or None,
        )
        if self.me in inp.members:  # only members' digests are read
            for liar in digest.lies or ():
                await self.store.publish(self._name(inp, f"lie-{liar}"), held.lies[liar].encode())
            await self.store.publish(self._name(inp, "digest"), digest.to_json())
        read = await asyncio.gather(*(self._read_digest(held, m) for m in inp.members if m != self.me))
        digests = [d for d in read if d is not None]
        frauds = {
            (d.wallet, j)
            for d in digests
            for j in d.frauds
            if j not in held.frauds and j in held.gathered and held.gathered[j].wallet != self.me
        }
        fraud_order = sorted(frauds)
        checked = await asyncio.gather(*(self._read_fraud_proof(held, w, j) for w, j in fraud_order))
        for (finder, j), found in zip(fraud_order, checked, strict=True):
            if found is not None and j not in held.frauds:
                proof, verdict = found
                self.log(
                    f"round {inp.round}: part {j}: {finder[:12]} proved owner {proof.claim.wallet[:12]} cheated"
                )
                self._apply_fraud(held, j, proof.claim, verdict.reason, verdict.aggregate)
        result = held.result
        assert result is not None
        # One piece of evidence convicts: per named liar, read at most LIE_READS finders' (the
        # first in wallet order), so digests naming many wallets cost each reader bounded bytes.
        finders: dict[str, list[str]] = {}
        if held.anchor is not None:
            for d in sorted(digests, key=lambda d: d.wallet):
                for liar in d.lies or ():
                    if liar in inp.members and liar not in result.cheats:
                        finders.setdefault(liar, []).append(d.wallet)
        liars = sorted(finders)
        convicted = await asyncio.gather(*(self._read_lie(held, w, finders[w][:LIE_READS]) for w in liars))
        for liar, shown in zip(liars, convicted, strict=True):
            if shown is not None:
                finder, why = shown
                self.log(f"round {inp.round}: {finder[:12]} showed {liar[:12]} lied: {why}")
                result.cheats.setdefault(liar, why)
        differ = sum(d.claims_sha256 != digest.claims_sha256 for d in digests)
        if differ * 2 > len(digests):
            self.log(
                f"round {inp.round}: {differ} of {len(digests)} digests name other claims than this replica's"
            )

    async def _read_digest(self, held: Held, member: str) -> RoundDigest | None:
        return await self._read_signed(
            held, member, self._name(held.inp, "digest"), RoundDigest, self.config.agree_timeout_s
        )

    async def _read_fraud_proof(
        self, held: Held, finder: str, j: int
    ) -> tuple[FraudProof, FraudCheck] | None:
        """`finder`'s fraud proof for part j and its verdict, if it convicts the claim this replica
        decided part j with; else None."""
        inp = held.inp
        a, b = held.bounds[j]
        bound = LIST_BYTES_PER_MEMBER * len(inp.members) * 2 + len(inp.members) * (
            encoded_size("fp16", b - a) + 4096
        )
        raw = await self.store.fetch(finder, self._name(inp, "fraud", j), max_bytes=bound, wait_s=5.0)
        if raw is None:
            return None
        try:
            proof = FraudProof.decode(raw)
        except Refused:
            return None
        if proof.claim.part != j or proof.claim != held.gathered.get(j):
            return None  # a proof against some other claim says nothing about the part decided
        verdict = await self._verify(held, proof)
        return (proof, verdict) if verdict.fraud else None

    async def _read_lie(self, held: Held, liar: str, finders: list[str]) -> tuple[str, str] | None:
        """(finder, reason) of the first of `finders` whose ``lie-{liar}`` convicts `liar` (checked
        here, on a worker thread), or None."""
        inp, anchor = held.inp, held.inp.anchor
        if anchor is None:
            return None
        longest = max(b - a for a, b in held.bounds)
        bound = (
            SMALL_OBJECT_BYTES + 64 * len(inp.members).bit_length() + encoded_size("fp16", max(longest, 1))
        )
        scope = (inp.stage, inp.round, inp.base_hash, held.members_sha)
        for finder in finders:
            raw = await self.store.fetch(finder, self._name(inp, f"lie-{liar}"), max_bytes=bound, wait_s=5.0)
            try:
                lie = SumLie.decode(raw) if raw is not None else None
            except Refused:
                continue
            if lie is None or lie.commitment.wallet != liar:
                continue
            reason = await asyncio.to_thread(
                check_sum_lie, lie, members=inp.members, bounds=held.bounds, scope=scope, anchor=anchor
            )
            if reason is not None:
                return finder, f"part {lie.part}: {reason}"
        return None

    async def _settle_probation(self, held: Held) -> None:
        """End the probationers' screenings with the round: what is not done by now is cancelled and
        its probationers marked unscreened (a part that never came costs the members nothing)."""
        assert held.result is not None
        tasks = [*held.screening, *([held.probation_reads] if held.probation_reads is not None else [])]
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for wallet in held.inp.probationers if held.screening else ():  # owners only: others screen nothing
            if wallet in held.probation:
                held.result.probation.setdefault(
                    wallet, "not screened: its part did not come during the round"
                )
            else:
                held.result.probation.setdefault(wallet, "no commitment during the round")

    def _finish(self, held: Held) -> RoundResult:
        result = held.result
        assert result is not None
        out = result.aggregate
        missing = []
        for j, (a, b) in enumerate(held.bounds):
            if b == a:
                continue
            data = None if j in held.equivocations else held.aggregates.get(j)
            if data is None:
                missing.append(j)
                continue
            out[a:b] = decode_part(data, held.encodings[j], b - a)
        result.claims = dict(held.claims)
        result.missing_parts = tuple(missing)
        return result

    @staticmethod
    def _name(inp: RoundInput, kind: str, part: int | None = None) -> str:
        return object_name(inp.stage, inp.round, kind, part)

    @staticmethod
    def _agg_name(inp: RoundInput, part: int, aggregate_sha256: str) -> str:
        """An aggregate is named by its hash: a name is never bound to two different bodies."""
        return object_name(inp.stage, inp.round, f"agg-{aggregate_sha256}", part)


def _decodes(data: bytes, encoding: str, length: int) -> bool:
    try:
        decode_part(data, encoding, length)
    except (Refused, ValueError):
        return False
    return True


def refused_reasons(result: RoundResult) -> Mapping[str, str]:
    """Every wallet the round refused or reported, with the first reason (for round lines)."""
    return {**result.silent, **result.refused, **result.cheats}
