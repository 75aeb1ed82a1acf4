"""`neuroshard-check-proof`: check a segment fraud proof alone, trusting no verifier.

    curl -s VERIFIER/api/fraud-proofs                       # sha256, wallet, stage, data_spans, ...
    curl -so p.proof VERIFIER/api/fraud-proofs/SHA256
    neuroshard-check-proof p.proof --network network.toml [--spans '[[3,0,16]]'] [--cache-dir DIR]

The proof (verifier.segmentcheck.SegmentFraudProof) holds one segment of a replica's round: its
signed commitment, its hash-chained log, the checkpoints at the segment's two ends and the
messages each step consumed, each signed by its sender. This command checks the material against
the commitment and the senders' signatures, replays the segment's steps with the run's definition
and compares the replayed end with the committed one. Stage 0 re-reads its batches from the run's
data set (the definition names the manifest and its publisher key; one served over HTTP is cached
in --cache-dir); --spans, the receipt's data spans as GET /api/fraud-proofs lists them, must then
match the signed log's.

--network takes the definition as TOML, or as the JSON body of the verifier's GET /api/network.
The tolerance is the one that holds for every receipt whatever it trained on
(verifier.replaycheck.CALIBRATED_TOLERANCE) unless --device and --precision name the receipt's
(as the list shows them), which give the verifier's own (verifier.replaycheck.tolerance_for).

Prints one line. Exit 0: `PROVES FRAUD: wallet W stage S round R segment J (reason)`; exit 1:
`does not prove fraud: reason`; exit 2: the proof, the definition or the data cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from neuroshard.cli.parser import Parser
from neuroshard.node.model import build_stage
from neuroshard.protocol.identity import wallet_id_of
from neuroshard.protocol.refusal import Refused
from neuroshard.verifier.background import open_run_dataset
from neuroshard.verifier.network import NetworkDefinition, NetworkError, load_network, parse_network
from neuroshard.verifier.replaycheck import CALIBRATED_TOLERANCE, ReplayCheckConfig, tolerance_for
from neuroshard.verifier.segmentcheck import BatchReader, SegmentFraudProof, judge_fraud_proof
from neuroshard.verifier.segmentlive import batch_reader

PROG = "neuroshard-check-proof"
DEVICES = ("cpu", "cuda", "mps")
PRECISIONS = ("fp32", "bf16", "fp16")


class Unreadable(Exception):
    """The proof, the definition or the data cannot be read (exit 2)."""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("proof", type=Path, help="the proof file (GET /api/fraud-proofs/{sha256})")
    p.add_argument(
        "--network",
        type=Path,
        required=True,
        help="the run's definition: network.toml, or the JSON of GET /api/network",
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
    p.add_argument("--device", choices=DEVICES, help="the receipt's device (the list's device)")
    p.add_argument("--precision", choices=PRECISIONS, help="the receipt's precision (the list's precision)")
    return p


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


def _network(path: Path) -> NetworkDefinition:
    if path.suffix != ".json":
        return load_network(path)
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise NetworkError(f"cannot read network definition {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise NetworkError(f"{path} does not hold a network definition object")
    return parse_network(doc, str(path))


def check(args: argparse.Namespace) -> tuple[bool, str]:
    """(proves, the line to print); raises Unreadable."""
    try:
        data = args.proof.read_bytes()
    except OSError as exc:
        raise Unreadable(f"cannot read {args.proof}: {exc.strerror or exc}") from None
    try:
        network = _network(args.network)
    except NetworkError as exc:
        raise Unreadable(str(exc)) from None
    try:
        commitment = SegmentFraudProof.commitment(data)
    except Refused as exc:
        raise Unreadable(f"{args.proof} is not a segment fraud proof: {exc.detail}") from None
    stage, stages = commitment.stage, network.num_stages
    if not 0 <= stage < stages:
        return False, f"does not prove fraud: the proof is for stage {stage}, the run has {stages}"
    params = list(build_stage(network.model, stage, stages).parameters())
    try:
        proof = SegmentFraudProof.decode(data, numel=sum(p.numel() for p in params), n_tensors=len(params))
    except Refused as exc:
        raise Unreadable(
            f"{args.proof} is not a stage-{stage} proof of this run's model: {exc.detail}"
        ) from None
    wallet = wallet_id_of(bytes.fromhex(commitment.wallet))
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
    if args.device is None and args.precision is None:
        tolerance = CALIBRATED_TOLERANCE
    else:
        tolerance = tolerance_for(args.device, args.precision, ReplayCheckConfig())
    verdict = judge_fraud_proof(
        proof, model=network.model, diloco=network.diloco, num_stages=stages, tolerance=tolerance,
        read_batch=read, spans=args.spans, trained_precision=args.precision,
    )  # fmt: skip
    if not verdict.proves:
        return False, f"does not prove fraud: {verdict.reason}"
    where = f"wallet {wallet} stage {stage} round {commitment.round} segment {proof.material.segment}"
    return True, f"PROVES FRAUD: {where} ({verdict.reason})"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        proves, line = check(args)
    except Unreadable as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(line, flush=True)
    return 0 if proves else 1


if __name__ == "__main__":
    sys.exit(main())
