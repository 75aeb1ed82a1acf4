"""Replay spot-check cost relative to the work it checks, side by side in one run.

The work: one DiLoCo round of a lone replica, the real `Trainer.run` (H inner steps on its
assigned shards) with the real receipt hook keeping the round for replay (node.replay). The
check: what the verifier does for a sampled receipt (verifier.replaycheck) — fetch the
round's θ_round, Δ and inner state from the node's peer server over loopback (signed GET,
safetensors), check the three digests, read the claimed batches, replay the H inner steps
and compare the Δs. Both at the same torch thread count (the verifier runs on one).
Rounds alternate (train, check, train, check, …) so drift in machine speed hits both alike.

    .venv/bin/python bench/bench_replay.py [--inner-steps 100] [--rounds 3] [--threads 1]
    .venv/bin/python bench/bench_replay.py --precision bf16   # a bf16-autocast node, replayed in fp32

With --precision bf16 the node trains with bf16 autocast and the verdict uses the verifier's
cross-precision acceptance (verifier.replaycheck.tolerance_for; segments of at most 25 steps its
SEGMENT_TOLERANCE).

Segment checks (issue 17): the same node also keeps a segment log (node.segments, k =
--segment-steps, default H/40 as in a network.toml) and its checkpoints on disk (node.segment_store); after each round
the verifier's segment check (verifier.segmentcheck.check_segment) replays every segment of it from
the store, so the bench prints the cost of one segment check against the round's work, the honest
verdicts (any refusal of an honest segment is a false refusal: target 0; run with --precision
bf16 for cross-precision replays), and the recording's own cost. The same for the last stage of a
2-stage pipeline, trained on activations a stage-0 sender codes and signs. Then, with real replays, a liar
that fakes some segments (scales their update by --lie-scale) is checked segment by segment; and a
seeded simulation (--trials, default 1,000) gives the probability that a replica faking a fraction
of its segments is caught within --sim-rounds rounds when the verifier draws --draws segments per
round after the receipt is committed.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from common import DEFAULT_TEXT, bench_dataset, parse_with_quick, quick_dataset

from neuroshard.data import BatchStream
from neuroshard.node.actcodec import DEFAULT_CODEC
from neuroshard.node.device import Placement, resolve_device
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig, copy_into_parameters, flat_parameters, tensor_digest
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.network_definition import DEFAULT_SEGMENTS_PER_ROUND
from neuroshard.node.p2p.pipeline_wire import decode_activations, encode_activations, encode_gradient
from neuroshard.node.p2p.plane import PeerPlane, PeerPlaneConfig
from neuroshard.node.p2p.replay import ReplayService, decode_replay
from neuroshard.node.p2p.rounds import RoundReport
from neuroshard.node.pipeline import stage_inner_step
from neuroshard.node.receipt import Receipting
from neuroshard.node.replay import ReplayArchive
from neuroshard.node.segment_store import SegmentStore
from neuroshard.node.segments import SegmentConfig, SegmentRecorder
from neuroshard.node.trainer import Trainer, TrainerConfig, lone_replica
from neuroshard.node.wallet import Wallet
from neuroshard.node.work import RoundWork
from neuroshard.protocol.identity import sha256_hex
from neuroshard.protocol.peer import REPLAY
from neuroshard.protocol.pipeline import ActivationHeader, micro_batch_id
from neuroshard.protocol.reports import DataSpan
from neuroshard.protocol.segments import Received
from neuroshard.protocol.signing import sign_request
from neuroshard.verifier.replaycheck import ReplayCheckConfig, tolerance_for
from neuroshard.verifier.segmentcheck import SegmentClaim, SegmentVerdict, check_segment
from neuroshard.verifier.spotcheck import SpotCheckConfig, claimed_batches, compare_deltas, replay_inner_steps

OPERATOR = Wallet.from_token("bench-replay-operator")
SCRATCH = tempfile.TemporaryDirectory(prefix="bench-replay-")
"""Checkpoints and segment stores of this run (hundreds of MB a round): removed at exit."""


def scratch() -> Path:
    """A new directory under SCRATCH."""
    return Path(tempfile.mkdtemp(dir=SCRATCH.name))


NODE = Wallet.from_token("bench-replay-node-wallet")


class TimedRecorder(SegmentRecorder):
    """The node's recorder, timing its own work (checkpoint hashes and disk writes)."""

    seconds = 0.0

    def record_step(self, diloco: DiLoCo, **kw: Any) -> None:
        start = time.perf_counter()
        super().record_step(diloco, **kw)
        self.seconds += time.perf_counter() - start

    def end_round(self, diloco: DiLoCo) -> None:
        start = time.perf_counter()
        super().end_round(diloco)
        self.seconds += time.perf_counter() - start


def caught_within(
    rng: random.Random, *, segments: int, fake: float, draws: int, rounds: int, exact: bool
) -> int | None:
    """One trial: the first round (1-based) in which a drawn segment is a faked one, else None.
    Each round the replica fakes each segment with probability `fake` (independently), or with
    `exact` exactly round(fake · segments) of them at random: it cannot aim at the segments that
    will be drawn, since the draw is fixed after its receipt commits the chain. The verifier draws
    `draws` distinct segments uniformly; a drawn faked segment is refused (the tests and the
    real-replay part of this bench show each lie refused)."""
    d = min(draws, segments)
    for r in range(1, rounds + 1):
        if exact:
            faked = set(rng.sample(range(segments), round(fake * segments)))
        else:
            faked = {j for j in range(segments) if rng.random() < fake}
        if faked.intersection(rng.sample(range(segments), d)):
            return r
    return None


def simulate(
    segments: int, fake: float, draws: int, rounds: int, trials: int, *, exact: bool, seed: int
) -> tuple[float, float]:
    """(share of `trials` seeded trials caught within `rounds`, the closed form): per round a liar
    faking F segments escapes with C(S − F, d) / C(S, d); independent faking averages that over
    F ~ Binomial(S, fake), which is (1 − fake)^d."""
    rng = random.Random(seed)
    caught = sum(
        caught_within(rng, segments=segments, fake=fake, draws=draws, rounds=rounds, exact=exact) is not None
        for _ in range(trials)
    )
    d = min(draws, segments)
    if exact:
        f = round(fake * segments)
        escape = math.comb(segments - f, d) / math.comb(segments, d)
    else:
        escape = sum(
            math.comb(segments, f) * fake**f * (1 - fake) ** (segments - f) * math.comb(segments - f, d)
            for f in range(segments + 1)
        ) / math.comb(segments, d)
    return caught / trials, 1 - escape**rounds


def fetch(address: str, round_: int, numel: int, n_tensors: int) -> tuple[Any, float]:
    path = REPLAY.format(round=round_)
    start = time.perf_counter()
    request = urllib.request.Request(
        f"http://{address}{path}", headers=sign_request(OPERATOR, "GET", path, b"", time.time())
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        body = reply.read()
    return decode_replay(body, round_, numel, n_tensors), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--inner-steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--precision", choices=("fp32", "bf16", "fp16"), default="fp32", help="the node's inner loop"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the node trains: cpu, cuda, cuda:N (the verifier replays on the CPU)",
    )
    parser.add_argument(
        "--segment-steps", type=int, default=None, help="k (default: H/40, a network.toml's default)"
    )
    parser.add_argument("--draws", type=int, default=4, help="segments the verifier checks per round")
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--sim-rounds", type=int, default=11)
    parser.add_argument("--lie-scale", type=float, default=1.25, help="a faked segment's update × this")
    args = parse_with_quick(
        parser,
        inner_steps=4,
        rounds=1,
        model_size="micro",
        batch_size=2,
        seq_len=32,
        segment_steps=2,
        trials=200,
    )
    torch.set_num_threads(args.threads)
    h = args.inner_steps
    k = args.segment_steps or max(1, h // DEFAULT_SEGMENTS_PER_ROUND)

    dataset = quick_dataset() if args.quick else bench_dataset(args.text)
    print(f"text: {'the quick text' if args.quick else args.text}")
    model_cfg = ModelConfig.named(args.model_size, vocab_size=dataset.tokenizer.vocab_size)
    diloco_cfg = DiLoCoConfig(inner_steps=h, warmup_steps=20, total_steps=20_000)
    args.placement = Placement(device=resolve_device(args.device), precision=args.precision)
    tolerance = tolerance_for(args.placement.device.type, args.precision, ReplayCheckConfig())
    args.segment_tolerance = tolerance_for(
        args.placement.device.type, args.precision, ReplayCheckConfig(), segment_steps=k
    )
    reports: list[RoundReport] = []
    receipts: list[dict[str, Any]] = []

    archive = ReplayArchive(keep_rounds=2)
    segment_config = SegmentConfig(segment_steps=k, keep_rounds=2)
    store = SegmentStore(scratch(), segment_config, log=print)
    recorder = TimedRecorder(segment_config, stage=0, sink=store)
    work = RoundWork()
    receipting = Receipting(
        lone_round(reports),
        reports,
        work,
        lambda receipt: receipts.append(receipt.to_obj()),
        batch_size=args.batch_size,
        tokens_per_step=args.batch_size * args.seq_len,
        log=print,
        archive=archive,
        segments=recorder,
        signer=NODE,
        archive_every_round=True,  # the whole-round replay is this bench's baseline
    )
    trainer = Trainer(
        wallet_id="bench",
        dataset=dataset,
        model_config=model_cfg,
        diloco_config=diloco_cfg,
        config=TrainerConfig(
            batch_size=args.batch_size, seq_len=args.seq_len, checkpoint_every=10**9, log_every=10**9
        ),
        checkpoint_dir=scratch(),
        log=lambda line: None,
        finish_round=receipting,
        work=work,
        segments=recorder,
        placement=args.placement,
    )
    receipting.round_started(trainer.diloco)
    net = PeerPlane(
        PeerPlaneConfig(port=0, join_timeout_s=0),
        Wallet.from_token("bench-replay-node"),
        stage=0,
        log=lambda line: None,
        extensions=[ReplayService(archive, allowed_wallet=OPERATOR.public_key_hex)],
    )
    net.start()
    params = list(trainer.model.parameters())
    numel, n_tensors = sum(p.numel() for p in params), len(params)
    print(
        f"model {args.model_size} ({numel:,} params), batch {args.batch_size}x{args.seq_len}, H={h}, "
        f"node {args.placement.describe()} (verdict at cosine >= {tolerance.min_cosine}, norm ±{tolerance.norm_tolerance}), "
        f"torch threads {args.threads}, load average {os.getloadavg()[0]:.2f} at start"
    )
    node_s, fetch_s, read_s, replay_s = [], [], [], []
    segment_s: list[float] = []
    record_s: list[float] = []
    honest: list[SegmentVerdict] = []
    try:
        for r in range(args.rounds + 1):
            trainer.config.max_steps = (r + 1) * h
            recorder.seconds = 0.0
            result = trainer.run(threading.Event())
            if r == 0:
                continue  # round 0 warms up kernels and the allocator on both sides
            record_s.append(recorder.seconds)
            segment_s += check_segments(args, dataset, model_cfg, diloco_cfg, store, receipts[-1], honest)
            doc = receipts[-1]
            record, seconds = fetch(net.address, doc["round"], numel, n_tensors)
            start = time.perf_counter()
            digests_ok = (
                tensor_digest(record.theta_round) == doc["base_hash"]
                and tensor_digest(record.delta) == doc["delta_digest"]
                and record.inner.digest() == doc["inner_state_digest"]
            )
            fetch_s.append(seconds + time.perf_counter() - start)
            start = time.perf_counter()
            batches = claimed_batches(
                source=dataset.source,
                manifest=dataset.manifest,
                wallet_id="bench",
                spans=[DataSpan(**span) for span in doc["data"]],
                batch_size=args.batch_size,
                seq_len=args.seq_len,
            )
            read_s.append(time.perf_counter() - start)
            replayed = replay_inner_steps(
                model_cfg,
                diloco_cfg,
                record.theta_round,
                batches,
                round_=doc["round"],
                inner_state=record.inner,
            )
            verdict = compare_deltas(record.delta, replayed, tolerance)
            replay_s.append(time.perf_counter() - start)
            node_s.append(result.inner_seconds)
            print(
                f"  round {doc['round']}: node inner {node_s[-1]:.2f} s | verifier fetch+digests {fetch_s[-1]:.2f} s, "
                f"replay {replay_s[-1]:.2f} s of which reading batches {read_s[-1]:.2f} s ({'pass' if verdict.ok and digests_ok else 'FAIL'}: {verdict.reason}) "
                f"| load {os.getloadavg()[0]:.2f}"
            )
    finally:
        net.stop()
        dataset.source.close()
    n, f, p = statistics.median(node_s), statistics.median(fetch_s), statistics.median(replay_s)
    print(
        f"median: node {n:.2f} s per round, check {f + p:.2f} s (fetch+digests {f:.2f}, replay {p:.2f}); "
        f"check/work = {(f + p) / n:.3f}"
    )
    segments = math.ceil(h / k)
    seg = statistics.median(segment_s)
    refused = [v for v in honest if not v.ok]
    cosines = [v.cosine for v in honest if v.cosine is not None]
    ratios = [v.norm_ratio for v in honest if v.norm_ratio is not None]
    print(
        f"segment check (k={k}, {segments} segments a round): median {seg:.3f} s per segment check "
        f"(store read + commitments + replay + compare) = {seg / n:.3f} of the round's work (k/H = {k / h:.3f}); "
        f"{args.draws} segments a round = {min(args.draws, segments) * seg / n:.3f} of it; "
        f"recording {statistics.median(record_s):.3f} s per round = {statistics.median(record_s) / n:.3f} of it"
    )
    segment_tolerance = args.segment_tolerance
    print(
        f"honest segments ({args.placement.describe()} node, CPU fp32 replay, cosine >= "
        f"{segment_tolerance.min_cosine}, norm ±{segment_tolerance.norm_tolerance}): "
        f"{len(honest) - len(refused)}/{len(honest)} passed, false refusals {len(refused)}; cosine min {min(cosines):.6f}, "
        f"norm ratio {min(ratios):.4f}..{max(ratios):.4f}"
    )
    later_stage_segments(args, dataset, model_cfg, diloco_cfg, k)
    liar_segments(args, dataset, model_cfg, diloco_cfg, k, segment_tolerance)
    print(
        f"detection, simulated ({args.trials} seeded trials, {args.draws} segments drawn a round, share caught "
        f"within {args.sim_rounds} rounds; closed form in brackets):"
    )
    for s_count in sorted({segments, 10, 40}):
        for exact in (False, True):
            cells = []
            for fake in (0.01, 0.02, 0.05, 0.10, 0.20, 0.50):
                seed = int(fake * 1000) + 7 * s_count + exact
                sim, closed = simulate(
                    s_count, fake, args.draws, args.sim_rounds, args.trials, exact=exact, seed=seed
                )
                cells.append(f"{fake:.0%}: {sim:.3f} ({closed:.3f})")
            how = "exactly round(share × segments)" if exact else "each independently"
            print(
                f"  {s_count:3d} segments a round (check/work {min(args.draws, s_count) / s_count:.3f}), "
                f"faking {how}: " + ", ".join(cells)
            )


def check_segments(
    args: argparse.Namespace,
    dataset: Any,
    model_cfg: ModelConfig,
    diloco_cfg: DiLoCoConfig,
    store: SegmentStore,
    doc: dict[str, Any],
    verdicts: list[SegmentVerdict],
) -> list[float]:
    """Check every segment of the receipt's round as the verifier would; returns seconds per check."""
    spans = [(d["shard_id"], d["offset_start"], d["offset_end"]) for d in doc["data"]]
    claim = SegmentClaim(
        model=model_cfg, diloco=diloco_cfg, num_stages=1, stage=0, round=doc["round"],
        wallet=NODE.public_key_hex, root=doc["segment_root"], spans=spans,
    )  # fmt: skip
    tolerance = args.segment_tolerance
    seconds = []
    for j in range(doc["segments"]):
        start = time.perf_counter()
        material = store.material(doc["round"], j)
        assert material is not None
        verdict = check_segment(claim, material, tolerance, read_batch=_reader(args, dataset, "bench"))
        seconds.append(time.perf_counter() - start)
        verdicts.append(verdict)
    return seconds


def _reader(args: argparse.Namespace, dataset: Any, wallet_id: str) -> Any:
    def read(span: tuple[int, int, int]) -> Any:
        (batch,) = claimed_batches(
            source=dataset.source, manifest=dataset.manifest, wallet_id=wallet_id,
            spans=[DataSpan(shard_id=span[0], offset_start=span[1], offset_end=span[2])],
            batch_size=args.batch_size, seq_len=args.seq_len,
        )  # fmt: skip
        return batch

    return read


def later_stage_segments(
    args: argparse.Namespace, dataset: Any, model_cfg: ModelConfig, diloco_cfg: DiLoCoConfig, k: int
) -> None:
    """The last stage of a 2-stage pipeline, one round: it trains (in --precision) on activations a
    stage-0 sender computes from the text and sends signed, in the run's codec, records them and
    the gradients it sends back, and every segment is checked with an fp32 replay from the recorded
    bytes (the gradients sent back held to the replay's: verifier.segmentcheck.sent_comparisons)."""
    sender = Wallet.from_token("bench-replay-stage0")
    torch.manual_seed(0)
    stage0 = build_stage(model_cfg, 0, 2).eval()
    diloco = DiLoCo(
        build_stage(model_cfg, 1, 2), diloco_cfg,
        placement=args.placement,
    )  # fmt: skip
    config = SegmentConfig(segment_steps=k, keep_rounds=1)
    store = SegmentStore(scratch(), config, log=print)
    recorder = SegmentRecorder(config, stage=1, sink=store)
    manifest = dataset.manifest
    stream = BatchStream(
        source=dataset.source, manifest=manifest, order=[s.id for s in manifest.shards],
        seed="bench-stage1", batch_size=args.batch_size, seq_len=args.seq_len,
    )  # fmt: skip
    recorder.start_round(diloco)
    base = tensor_digest(diloco.theta_round)
    start = time.perf_counter()
    for i in range(diloco_cfg.inner_steps):
        inputs, labels = stream.next_batch()
        with torch.no_grad():
            hidden = stage0(inputs)
        body = encode_activations(hidden, labels, DEFAULT_CODEC)
        mb = micro_batch_id(sender.public_key_hex, 0, i)
        header = ActivationHeader.create(
            sender, to=NODE.public_key_hex, micro_batch=mb, stage=1, round=0, batch=hidden.shape[0], seq_len=hidden.shape[1],
            dim=hidden.shape[2], codec=DEFAULT_CODEC, payload_sha256=sha256_hex(body),
        )  # fmt: skip
        got, got_labels = decode_activations(body, header, model_cfg.vocab_size)
        grad, _ = stage_inner_step(diloco, got, got_labels, None)
        message = Received("activations", sender.public_key_hex, header.to_json(), body)
        recorder.record_step(diloco, micro_batch=mb, received=[message])
        reply = encode_gradient(grad, DEFAULT_CODEC)  # its gradient back, kept with the step as a node does
        recorder.note_sent(mb, "gradient", sha256_hex(reply), reply)
    work = time.perf_counter() - start
    recorder.end_round(diloco)
    delta = diloco.pseudo_gradient()
    diloco.outer_step(delta)
    closed = recorder.close_round(NODE)
    assert closed is not None
    log = closed[0]
    claim = SegmentClaim(
        model=model_cfg, diloco=diloco_cfg, num_stages=2, stage=1, round=0, wallet=NODE.public_key_hex,
        root=log.root(), base_hash=base, delta_digest=tensor_digest(delta),
    )  # fmt: skip
    tolerance = args.segment_tolerance
    verdicts, seconds = [], []
    for j in range(log.segments):
        t = time.perf_counter()
        material = store.material(0, j)
        assert material is not None
        verdicts.append(check_segment(claim, material, tolerance))
        seconds.append(time.perf_counter() - t)
    cosines = [v.cosine for v in verdicts if v.cosine is not None]
    ratios = [v.norm_ratio for v in verdicts if v.norm_ratio is not None]
    refused = [v.reason for v in verdicts if not v.ok]
    print(
        f"later stage (stage 1 of 2, {args.placement.describe()} replica on {DEFAULT_CODEC}-coded activations, fp32 replay): "
        f"{len(verdicts) - len(refused)}/{len(verdicts)} segments passed, false refusals {len(refused)}"
        f"{' (' + refused[0] + ')' if refused else ''}; cosine min {min(cosines):.6f}, norm ratio "
        f"{min(ratios):.4f}..{max(ratios):.4f}; a segment check {statistics.median(seconds):.3f} s = "
        f"{statistics.median(seconds) / work:.3f} of the round's {work:.2f} s"
    )


def liar_segments(
    args: argparse.Namespace,
    dataset: Any,
    model_cfg: ModelConfig,
    diloco_cfg: DiLoCoConfig,
    k: int,
    tolerance: SpotCheckConfig,
) -> None:
    """A replica that scales the update of every other segment by --lie-scale (and commits to it,
    as a liar must), checked segment by segment with real replays."""
    config = SegmentConfig(segment_steps=k, keep_rounds=2)
    store = SegmentStore(scratch(), config, log=print)
    recorder = ScalingLiar(config, stage=0, sink=store, scale=args.lie_scale)
    reports: list[RoundReport] = []
    receipts: list[dict[str, Any]] = []
    work = RoundWork()
    receipting = Receipting(
        lone_round(reports),
        reports, work, lambda receipt: receipts.append(receipt.to_obj()), batch_size=args.batch_size,
        tokens_per_step=args.batch_size * args.seq_len, log=print, segments=recorder, signer=NODE,
    )  # fmt: skip
    trainer = Trainer(
        wallet_id="liar", dataset=dataset, model_config=model_cfg, diloco_config=diloco_cfg,
        config=TrainerConfig(batch_size=args.batch_size, seq_len=args.seq_len, checkpoint_every=10**9, log_every=10**9),
        checkpoint_dir=scratch(), log=lambda line: None, finish_round=receipting, work=work, segments=recorder,
        placement=args.placement,
    )  # fmt: skip
    receipting.round_started(trainer.diloco)
    trainer.config.max_steps = diloco_cfg.inner_steps
    trainer.run(threading.Event())
    doc = receipts[-1]
    spans = [(d["shard_id"], d["offset_start"], d["offset_end"]) for d in doc["data"]]
    claim = SegmentClaim(
        model=model_cfg, diloco=diloco_cfg, num_stages=1, stage=0, round=doc["round"],
        wallet=NODE.public_key_hex, root=doc["segment_root"], spans=spans,
    )  # fmt: skip
    faked_refused = honest_passed = faked = 0
    for j in range(doc["segments"]):
        material = store.material(doc["round"], j)
        assert material is not None
        verdict = check_segment(claim, material, tolerance, read_batch=_reader(args, dataset, "liar"))
        if j in recorder.faked.get(doc["round"], set()):
            faked += 1
            faked_refused += not verdict.ok
        else:
            honest_passed += verdict.ok
    print(
        f"liar (update × {args.lie_scale} in every other segment, real replays): faked segments refused "
        f"{faked_refused}/{faked}, its honest segments passed {honest_passed}/{doc['segments'] - faked}"
    )


class ScalingLiar(SegmentRecorder):
    """Scales the weights' change over every odd segment by `scale` just before that segment's end
    checkpoint, so the committed chain holds the faked update (the lie a replica hiding skipped
    micro-batches, or inflating its contribution, would have to commit to)."""

    def __init__(self, *args: Any, scale: float, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.scale = scale
        self._start: Any = None
        self.faked: dict[int, set[int]] = {}
        """Round → segments whose update was scaled."""

    def start_round(self, diloco: DiLoCo) -> None:
        super().start_round(diloco)
        self._start = flat_parameters(diloco.params)

    def record_step(self, diloco: DiLoCo, **kw: Any) -> None:
        k, done = self.config.segment_steps, diloco.steps_in_round
        j = (done - 1) // k
        if j % 2 == 1 and (done % k == 0 or done == diloco.config.inner_steps):  # the segment's last step
            now = flat_parameters(diloco.params)
            copy_into_parameters(self._start + self.scale * (now - self._start), diloco.params)
            self.faked.setdefault(diloco.round, set()).add(j)
        super().record_step(diloco, **kw)
        if done % k == 0:
            self._start = flat_parameters(diloco.params)  # the next segment starts here


def lone_round(reports: list[RoundReport]) -> Any:
    """A lone replica's round hook that also reports the round (as the peer network would)."""

    def finish(diloco: DiLoCo) -> None:
        reports.append(_report(diloco.round))
        lone_replica(diloco)

    return finish


def _report(round_: int) -> RoundReport:
    return RoundReport(
        stage=0, round=round_, accepted=(), rejected=(), equivocators=(), late=False,
        next_round=round_ + 1, theta_hash="0" * 64, agree=1, voters=1, resynced_from=None, seconds=0.0,
    )  # fmt: skip


if __name__ == "__main__":
    main()
