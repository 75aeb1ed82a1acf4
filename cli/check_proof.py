"""`neuroshard-check-proof`: check a fraud proof alone, without the verifier's verdict.

    curl -s VERIFIER/api/fraud-proofs                       # sha256, wallet, stage, data_spans, ...
    curl -so p.proof VERIFIER/api/fraud-proofs/SHA256
    curl -sD headers -o network.json VERIFIER/api/network   # X-NeuroShard-Signature in headers
    neuroshard-check-proof p.proof --network network.json [--operator-key HEX --signature HEX]
        [--wallet W] [--spans '[[3,0,16]]'] [--cache-dir DIR]
    neuroshard-check-proof sender.proof [--wallet W]        # a sender proof (the list's kind)
    neuroshard-check-proof continuity.proof --network network.json [--wallet W]

A sender proof (verifier.segmentcheck.SenderFraudProof, kind "sender" in the list) holds a
replica's signed round log and a header it signed for a receiver: the log records sending that
receiver, for that micro-batch, other bytes than the header signs. Both are the sender's own
signatures (the header signs whom it was sent to as well as its payload), so it needs no
definition, no data and no replay; with --network, the log's stage must be one of the
run's and its steps no more than a round's.

A continuity proof (verifier.segmentcheck.ContinuityFraudProof, kind "continuity") holds a
replica's signed log of one round, θ_round's bytes and the hash of the optimizer state the round
started from (together they open the log's first checkpoint), and its signed log of the round
before with the opening of that round's last checkpoint: the round started from AdamW moments
that are neither fresh nor the ones its round before ended with. It needs --network (both logs'
commitments must name its digest: a wallet may train several runs, whose round numbers repeat;
θ's length must be the stage's, whose number of parameter tensors fixes a fresh optimizer's
digest), no data and no replay. The rest of this text is about segment proofs.

The proof (verifier.segmentcheck.SegmentFraudProof) holds one segment of a replica's round: its
signed commitment, its hash-chained log, the checkpoints at the segment's two ends and the
messages each step consumed, each signed by its sender, and the payloads each step sent on. This
command checks the material against the commitment and the senders' signatures, replays the
segment's steps with the run's definition and compares the replayed end with the committed one,
and what each step sent with what its replay computed. Stage 0 re-reads its batches from the run's
data set (the definition names the manifest and its publisher key; one served over HTTP is cached
in --cache-dir); --spans, the receipt's data spans as GET /api/fraud-proofs lists them, must then
match the signed log's.

What the verdict depends on, besides the proof's own signed bytes:

- the definition (--network: a network.toml, or the JSON body of GET /api/network). Its sha256
  (of its canonical bytes) is printed with the verdict. It is checked only with --operator-key
  and --signature (the operator's public key, and the X-NeuroShard-Signature header GET
  /api/network answers with): the same check a node joining the run makes
  (node.network_definition.verify_network); a definition that fails it is refused. Without them,
  the definition is whatever the file says;
- the tolerance and step-count flags. With neither --device nor --precision (the default) the
  replay is held to the tolerance that holds for every receipt whatever it trained on
  (verifier.replaycheck.calibrated_tolerance at the run's segment length: SEGMENT_TOLERANCE up
  to SEGMENT_TOLERANCE_STEPS steps, CALIBRATED_TOLERANCE beyond) and to the step-count rule every precision meets
  (fp16's: counts may fall short of the steps, uniformly): the most lenient, and the only verdict
  that does not depend on the verifier's listing. --device and --precision, given together as the
  list shows the receipt's, apply the verifier's own tolerance and count rule
  (verifier.replaycheck.tolerance_for), which are only as right as the listing;
- the wallet printed is the one whose key signed the commitment (a proof does not prove fraud
  unless that signature holds); --wallet (a wallet id or public key) refuses a proof signed by
  any other.

The file is bounded before it is loaded: its header is read first (the commitment, the log and
the length of θ: the definition's, or the stage's grown with the tokenizer, node.vocab), a log of
more steps than the run's rounds is refused, and so is a file larger than a segment body of that
stage can be (node.p2p.replay.segment_size_bound). The replay builds the stage at that
vocabulary (verifier.stageshape).

Prints one line. Exit 0: `PROVES FRAUD: wallet W stage S round R segment J (reason) [definition
…]`; exit 1: `does not prove fraud: reason [definition …]`; exit 2: the proof, the definition or
the data cannot be read or are refused (unverified definition, another wallet, too large).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuroshard.cli.parser import Parser
from neuroshard.node.network_definition import verify_network
from neuroshard.node.p2p.replay import segment_log_bound, segment_size_bound
from neuroshard.node.segment_store import MAX_MATERIAL_HEADER, SegmentMaterial
from neuroshard.protocol.identity import wallet_id_of
from neuroshard.protocol.refusal import Refused
from neuroshard.verifier.background import open_run_dataset
from neuroshard.verifier.network import NetworkDefinition, NetworkError, load_network, parse_network
from neuroshard.verifier.replaycheck import ReplayCheckConfig, calibrated_tolerance, tolerance_for
from neuroshard.verifier.segmentcheck import (
    ANY_PRECISION,
    CONTINUITY_PROOF_MAGIC,
    SENDER_PROOF_MAGIC,
    BatchReader,
    ContinuityFraudProof,
    SegmentFraudProof,
    SenderFraudProof,
    judge_continuity_proof,
    judge_fraud_proof,
    judge_sender_proof,
)
from neuroshard.verifier.segmentlive import batch_reader
from neuroshard.verifier.stageshape import declared_length, largest_numel, stage_config, stage_size

PROG = "neuroshard-check-proof"
DEVICES = ("cpu", "cuda", "mps")
PRECISIONS = ("fp32", "bf16", "fp16")
MAX_MESSAGE_BYTES = ReplayCheckConfig().max_message_bytes
"""Largest message a proof's step may carry: what the verifier accepts when it fetches a segment."""


class Unreadable(Exception):
    """The proof, the definition or the data cannot be read, or are refused (exit 2)."""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("proof", type=Path, help="the proof file (GET /api/fraud-proofs/{sha256})")
    p.add_argument(
        "--network",
        type=Path,
        help="the run's definition: network.toml, or the JSON of GET /api/network (a segment proof needs it)",
    )
    p.add_argument(
        "--operator-key",
        type=_hex_bytes(32, "--operator-key"),
        help="the operator's public key (64 hex): refuse a definition it did not sign (needs --signature)",
    )
    p.add_argument(
        "--signature",
        type=_hex_bytes(64, "--signature"),
        help="the definition's signature: GET /api/network's X-NeuroShard-Signature header (128 hex)",
    )
    p.add_argument(
        "--wallet",
        help="the wallet the proof must be signed by (wallet id or public key); another's is refused",
    )
    p.add_argument(
        "--spans",
        type=_spans,
        default=[],
        help="stage 0: the receipt's data spans as JSON, [[shard, start, end], ...] (the list's data_spans)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        help="where a data set served over HTTP is cached (stage 0; default ~/.neuroshard/cache)",
    )
    p.add_argument(
        "--device", choices=DEVICES, help="the receipt's device (the list's device; with --precision)"
    )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="the receipt's precision (the list's precision; with --device)",
    )
    return p


def _hex_bytes(n: int, flag: str) -> Any:
    def parse(text: str) -> bytes:
        try:
            value = bytes.fromhex(text)
        except ValueError:
            value = b""
        if len(value) != n:
            raise argparse.ArgumentTypeError(f"{flag} must be {2 * n} hex characters")
        return value

    return parse


def _spans(text: str) -> list[tuple[int, int, int]]:
    try:
        value: Any = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--spans is not JSON: {exc}") from None
    if not isinstance(value, list) or not all(
        isinstance(s, list) and len(s) == 3 and all(type(x) is int and x >= 0 for x in s) for s in value
    ):
        raise argparse.ArgumentTypeError("--spans must be a JSON list of [shard, start, end] integer triples")
    return [(s[0], s[1], s[2]) for s in value]


def _network(args: argparse.Namespace) -> tuple[NetworkDefinition, str]:
    """(the definition, how it was checked); NetworkError when it cannot be read or, with
    --operator-key, is not signed by that key."""
    path: Path = args.network
    if path.suffix != ".json":
        network = load_network(path)
        body = network.canonical_bytes()  # what the operator signs (node.network_definition.sign_network)
    else:
        try:
            body = path.read_bytes()
            doc = json.loads(body)
        except (OSError, ValueError) as exc:
            raise NetworkError(f"cannot read network definition {path}: {exc}") from None
        if not isinstance(doc, dict):
            raise NetworkError(f"{path} does not hold a network definition object")
        network = parse_network(doc, str(path), served=True)  # the body of GET /api/network
    if args.operator_key is None:
        return network, "not checked against an operator key"
    network = verify_network(body, args.signature.hex(), args.operator_key)
    return network, f"signed by operator {args.operator_key.hex()[:16]}…"


def _definition(args: argparse.Namespace) -> tuple[NetworkDefinition, str]:
    """(the definition, the verdict line's tail naming its digest and how it was checked);
    Unreadable when `_network` cannot read or trust it."""
    try:
        network, checked = _network(args)
    except NetworkError as exc:
        raise Unreadable(str(exc)) from None
    return network, f" [definition sha256 {network.digest()}, {checked}]"


def _read_head(path: Path) -> tuple[int, bytes]:
    """(the file's size, its safetensors length prefix and header): enough to read the commitment
    and the log without loading any tensor."""
    with path.open("rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        prefix = f.read(8)
        if len(prefix) < 8:
            return size, prefix
        (n,) = struct.unpack("<Q", prefix)
        return size, prefix + f.read(min(n, MAX_MATERIAL_HEADER + 1))


@dataclass(frozen=True)
class Loaded:
    network: NetworkDefinition
    about: str
    """The verdict line's tail: the definition's digest and whether its signature was checked."""
    wallet: str
    proof: SegmentFraudProof
    read: BatchReader | None


SENDER_PROOF_MAX_BYTES = 64 << 20
"""Largest sender proof read without a definition (a round log is ~0.3 KB a step, at most
node.p2p.replay.segment_log_bound); with one, that bound for the run's rounds."""


def check(args: argparse.Namespace) -> tuple[bool, str]:
    """(proves, the line to print); raises Unreadable when the proof, the definition or the data
    cannot be read (whatever the exception), not when the replay fails."""
    magic = max(len(SENDER_PROOF_MAGIC), len(CONTINUITY_PROOF_MAGIC))
    try:
        with args.proof.open("rb") as f:
            first = f.read(magic)
    except OSError as exc:
        raise Unreadable(f"cannot read {args.proof}: {exc.strerror or exc}") from None
    try:
        if first.startswith(SENDER_PROOF_MAGIC):
            return check_sender(args)
        if args.network is None:
            what = "a continuity" if first.startswith(CONTINUITY_PROOF_MAGIC) else "a segment"
            raise Unreadable(
                f"{args.proof} is not a sender fraud proof (no NSSENDER1 line); {what} fraud proof "
                "needs --network"
            )
        if first.startswith(CONTINUITY_PROOF_MAGIC):
            return check_continuity(args)
        loaded = load(args)
    except Unreadable:
        raise
    except Exception as exc:  # crafted input must end in one line, not a traceback
        raise Unreadable(f"cannot read {args.proof}: {type(exc).__name__}: {exc}") from None
    if isinstance(loaded, str):
        return False, loaded
    network, proof, about = loaded.network, loaded.proof, loaded.about
    k = network.segment_k  # the run's k picks the tolerance, as the live checker does
    if args.device is None:  # and --precision: main() takes both or neither
        tolerance, trained = calibrated_tolerance(k), ANY_PRECISION
    else:
        config = ReplayCheckConfig()
        tolerance, trained = (
            tolerance_for(args.device, args.precision, config, segment_steps=k),
            args.precision,
        )
    verdict = judge_fraud_proof(
        proof, model=network.model, diloco=network.diloco, num_stages=network.num_stages,
        tolerance=tolerance, read_batch=loaded.read, spans=args.spans, trained_precision=trained,
        network=network.digest(),
    )  # fmt: skip
    if not verdict.proves:
        return False, f"does not prove fraud: {verdict.reason}{about}"
    c = proof.material.commitment
    where = f"wallet {loaded.wallet} stage {c.stage} round {c.round} segment {proof.material.segment}"
    return True, f"PROVES FRAUD: {where} ({verdict.reason}){about}"


def check_sender(args: argparse.Namespace) -> tuple[bool, str]:
    """A sender proof's verdict line (module docstring)."""
    network, about = None, " [no definition]"
    limit = SENDER_PROOF_MAX_BYTES
    if args.network is not None:
        network, about = _definition(args)
        limit = segment_log_bound(network.diloco.inner_steps) + (64 << 10)
    _no_segment_flags(args, "a sender proof")
    data = _read_bounded(args.proof, limit, "a sender proof can")
    try:
        proof = SenderFraudProof.decode(data)
    except Refused as exc:
        raise Unreadable(f"{args.proof} is not a sender fraud proof: {exc.detail}") from None
    c = proof.log.commitment
    wallet = _signer(args, c.wallet)
    if network is not None and len(proof.log.log.steps) > network.diloco.inner_steps:
        return False, f"does not prove fraud: its log has more steps than a round of this run{about}"
    verdict = judge_sender_proof(
        proof,
        num_stages=None if network is None else network.num_stages,
        network=None if network is None else network.digest(),
    )
    if not verdict.proves:
        return False, f"does not prove fraud: {verdict.reason}{about}"
    step = proof.step()
    where = f"wallet {wallet} stage {c.stage} round {c.round} step {step} (segment {proof.segment()})"
    return True, f"PROVES FRAUD: {where} ({verdict.reason}){about}"


def _no_segment_flags(args: argparse.Namespace, what: str) -> None:
    """Refuse the flags that only a segment proof's replay reads."""
    given = (("--spans", args.spans), ("--device", args.device), ("--cache-dir", args.cache_dir))
    ignored = [flag for flag, value in given if value]
    if ignored:
        raise Unreadable(f"{' and '.join(ignored)} apply to segment fraud proofs; {args.proof} is {what}")


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    """The file's bytes, at most `limit`: bounded by reading, not by stat (a pipe has no size)."""
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise Unreadable(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise Unreadable(f"{path} holds more than the {limit} bytes {what}")
    return data


def _signer(args: argparse.Namespace, key: str) -> str:
    """The wallet id of the key that signed the proof's commitment; refused when --wallet names another."""
    wallet = wallet_id_of(bytes.fromhex(key))
    if args.wallet is not None and args.wallet.lower() not in (wallet, key):
        raise Unreadable(f"{args.proof} is signed by wallet {wallet}, not {args.wallet}")
    return wallet


def check_continuity(args: argparse.Namespace) -> tuple[bool, str]:
    """A continuity proof's verdict line (module docstring); needs the definition: θ's length must
    be one of the stage's (grown with the tokenizer or not), and the stage's number of parameter
    tensors fixes a fresh optimizer's digest."""
    network, about = _definition(args)
    _no_segment_flags(args, "a continuity proof")
    stages = network.num_stages
    largest = max(largest_numel(network.model, stage, stages) for stage in range(stages))
    limit = 2 * segment_log_bound(network.diloco.inner_steps) + (64 << 10) + 4 * largest
    data = _read_bounded(args.proof, limit, "a continuity proof of this run can")
    try:
        proof = ContinuityFraudProof.decode(data)
    except Refused as exc:
        raise Unreadable(f"{args.proof} is not a continuity fraud proof: {exc.detail}") from None
    del data
    c = proof.log.commitment
    wallet = _signer(args, c.wallet)
    if not 0 <= c.stage < stages:
        return False, f"does not prove fraud: the proof is for stage {c.stage}, the run has {stages}{about}"
    for signed in (proof.log, proof.previous):
        if signed is not None and len(signed.log.steps) > network.diloco.inner_steps:
            return False, f"does not prove fraud: a log has more steps than a round of this run{about}"
    try:  # the definition's length, or the stage's grown with the tokenizer (node.vocab)
        stage_config(network.model, c.stage, stages, proof.numel)
    except ValueError as exc:
        raise Unreadable(f"{args.proof} is not a stage-{c.stage} proof of this run's model: {exc}") from None
    n_tensors = stage_size(network.model, c.stage, stages)[1]
    verdict = judge_continuity_proof(proof, n_tensors=n_tensors, network=network.digest(), num_stages=stages)
    if not verdict.proves:
        return False, f"does not prove fraud: {verdict.reason}{about}"
    where = f"wallet {wallet} stage {c.stage} round {c.round} (its first checkpoint)"
    return True, f"PROVES FRAUD: {where} ({verdict.reason}){about}"


def load(args: argparse.Namespace) -> Loaded | str:
    """The definition, the proof (bounded before it is loaded) and, at stage 0, the data; a
    `does not prove fraud` line when the proof is for a stage the run does not have."""
    try:
        size, head = _read_head(args.proof)
    except OSError as exc:
        raise Unreadable(f"cannot read {args.proof}: {exc.strerror or exc}") from None
    network, about = _definition(args)
    try:
        commitment = SegmentFraudProof.commitment(head)
        log, segment = SegmentMaterial.read_log(head)
    except Refused as exc:
        raise Unreadable(f"{args.proof} is not a segment fraud proof: {exc.detail}") from None
    wallet = _signer(args, commitment.wallet)
    stage, stages = commitment.stage, network.num_stages
    if not 0 <= stage < stages:
        return f"does not prove fraud: the proof is for stage {stage}, the run has {stages}{about}"
    inner = network.diloco.inner_steps
    if len(log.steps) > inner:
        raise Unreadable(
            f"{args.proof} is not a proof of this run: its log has {len(log.steps)} steps, a round has {inner}"
        )
    try:  # the definition's length, or the stage's grown with the tokenizer (node.vocab)
        numel = declared_length(head, "theta_round", "the proof")
        stage_config(network.model, stage, stages, numel)
    except ValueError as exc:  # Refused included
        raise Unreadable(f"{args.proof} is not a stage-{stage} proof of this run's model: {exc}") from None
    n_tensors = stage_size(network.model, stage, stages)[1]
    first, end = log.segment(segment)
    bound = segment_size_bound(numel, n_tensors, end - first, MAX_MESSAGE_BYTES, log.segment_steps)
    if size > bound:
        raise Unreadable(
            f"{args.proof} holds {size} bytes, more than a stage-{stage} segment of {end - first} steps "
            f"can ({bound})"
        )
    try:
        data = args.proof.read_bytes()
    except OSError as exc:
        raise Unreadable(f"cannot read {args.proof}: {exc.strerror or exc}") from None
    try:
        proof = SegmentFraudProof.decode(data, numel=numel, n_tensors=n_tensors)
    except Refused as exc:
        raise Unreadable(
            f"{args.proof} is not a stage-{stage} proof of this run's model: {exc.detail}"
        ) from None
    del data
    read: BatchReader | None = None
    if stage == 0:
        cache = args.cache_dir or Path.home() / ".neuroshard" / "cache"
        try:
            dataset = open_run_dataset(
                network,
                cache,
                lambda line: print(f"{PROG}: {line}", file=sys.stderr),
                needed_by="a stage-0 proof needs",
            )
        except (OSError, ValueError) as exc:  # Refused is a ValueError
            raise Unreadable(f"cannot open the run's data set: {exc}") from None
        read = batch_reader(dataset, network, wallet)
    return Loaded(network, about, wallet, proof, read)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.device is None) != (args.precision is None):
        parser.error("--device and --precision go together (both as the list shows them, or neither)")
    if (args.operator_key is None) != (args.signature is None):
        parser.error("--operator-key and --signature go together")
    try:
        proves, line = check(args)
    except Unreadable as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(line, flush=True)
    return 0 if proves else 1


if __name__ == "__main__":
    sys.exit(main())
