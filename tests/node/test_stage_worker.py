"""The stage > 0 training loop: jobs in arrival order, rounds every H steps, busy refusals, checkpoints."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from neuroshard.node.checkpoint import CheckpointIdentity, CheckpointMismatch
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.p2p.pipeline import Busy, Job, JobResult
from neuroshard.node.pipeline import DEGENERATE_MEAN_SQUARE, NonFiniteStep, stage_fingerprint
from neuroshard.node.segments import SegmentConfig, SegmentRecorder, SegmentSink
from neuroshard.node.stage_worker import Forward, JobQueue, StageCheckpoint, StageWorker, WorkerConfig
from neuroshard.node.trainer import TrainResult
from neuroshard.node.vocab import VocabSchedule, vocab_of
from neuroshard.protocol.identity import sha256_hex
from neuroshard.protocol.segments import Received, SegmentLog, SentRef, SignedHeader

MODEL = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, ffn_dim=32, max_seq_len=16)
H = 3


def _engine() -> DiLoCo:
    return DiLoCo(build_stage(MODEL, 1, 2), DiLoCoConfig(inner_steps=H, warmup_steps=0, total_steps=100))


def _middle_engine() -> DiLoCo:
    """Stage 1 of 3: a middle stage, which sends its output on."""
    return DiLoCo(
        build_stage(dataclasses.replace(MODEL, n_layers=3), 1, 3),
        DiLoCoConfig(inner_steps=H, warmup_steps=0, total_steps=100),
    )


def _job(results: list[JobResult], seed: int) -> Job:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 8, MODEL.dim, generator=g)
    labels = torch.randint(0, MODEL.vocab_size, (2, 8), generator=g)
    return Job(hidden, labels, f"{seed:032x}", results.append)


def _identity(stage: int = 1, stages: int = 2) -> CheckpointIdentity:
    return CheckpointIdentity(
        wallet_id="w",
        stage=stage,
        model_fingerprint=stage_fingerprint(MODEL, stages),
        tokenizer_sha256="t" * 64,
    )


def _feed(worker: StageWorker, steps: int) -> tuple[list[JobResult], int, TrainResult]:
    """Run the worker and offer it `steps` jobs one at a time, as a sender waiting for each reply
    (and retrying when busy), until it ends: (replies, refusals, its result)."""
    results: list[JobResult] = []
    outcome: list[TrainResult] = []
    thread = threading.Thread(target=lambda: outcome.append(worker.run(threading.Event(), 0.01)), daemon=True)
    thread.start()
    refusals = 0
    for i in range(steps):
        deadline = time.monotonic() + 10.0
        while len(results) <= i and time.monotonic() < deadline:
            try:
                worker.jobs.offer(_job(results, i))
            except Busy:  # the reply to the H-th step comes before the round: the next offer may land in it
                refusals += 1
                time.sleep(0.005)
                continue
            while len(results) <= i and time.monotonic() < deadline:
                time.sleep(0.005)
    thread.join(10.0)
    assert not thread.is_alive()
    return results, refusals, outcome[0]


def test_the_worker_trains_on_jobs_closes_rounds_every_h_steps_and_checkpoints(tmp_path: Path) -> None:
    rounds: list[int] = []

    def finish(diloco: DiLoCo) -> None:
        rounds.append(diloco.steps_in_round)
        diloco.outer_step(diloco.pseudo_gradient())

    checkpoint = StageCheckpoint(path=tmp_path / "s1.pt", identity=_identity())
    worker = StageWorker(
        _engine(), WorkerConfig(max_steps=2 * H, max_pending=10), log=lambda s: None,
        finish_round=finish, checkpoint=checkpoint,
    )  # fmt: skip
    results, refusals, result = _feed(worker, 2 * H)
    assert (result.steps, result.rounds) == (2 * H, 2) and rounds == [H, H]
    assert len(results) == 2 * H and all(isinstance(r, tuple) for r in results)
    assert worker.jobs.refused == refusals
    assert [r[2] for r in results if isinstance(r, tuple)] == [0] * H + [1] * H  # the round each step was in
    with pytest.raises(Busy):  # finished: nothing more is taken
        worker.jobs.offer(_job(results, 99))

    with pytest.raises(RuntimeError, match="already run"):  # its replies' thread is gone
        worker.run(threading.Event(), 0.01)

    resumed = _engine()
    assert StageCheckpoint(path=checkpoint.path, identity=_identity()).load(resumed)
    assert (resumed.step, resumed.round) == (2 * H, 2)
    assert resumed.weights_hash() == worker.diloco.weights_hash()
    for a, b in zip(resumed.params, worker.diloco.params, strict=True):
        assert torch.equal(a, b)
    # A checkpoint of another staging is refused, not loaded into the wrong layers.
    with pytest.raises(CheckpointMismatch, match="model_fingerprint"):
        StageCheckpoint(path=checkpoint.path, identity=_identity(stages=3)).load(_engine())


def test_a_full_queue_refuses_and_queued_jobs_get_busy_when_the_round_starts() -> None:
    engine = _engine()
    release = threading.Event()

    def finish(diloco: DiLoCo) -> None:
        release.wait(5.0)
        diloco.outer_step(diloco.pseudo_gradient())

    worker = StageWorker(
        engine, WorkerConfig(max_pending=1, max_steps=1), log=lambda s: None, finish_round=finish
    )
    results: list[JobResult] = []
    worker.jobs.offer(_job(results, 0))
    worker.jobs.offer(_job(results, 1))
    with pytest.raises(Busy, match="already wait"):
        worker.jobs.offer(_job(results, 2))
    assert worker.jobs.refused == 1
    # Entering the round drains what waits: those senders retry elsewhere, nothing was stepped for them.
    engine.steps_in_round = H - 1
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop, 0.01), daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if len(results) == 2:
                break
            threading.Event().wait(0.01)
        assert isinstance(results[0], tuple) and isinstance(results[1], Busy)
    finally:
        release.set()
        thread.join(10.0)
    assert engine.step == 1 and engine.round == 1


def test_the_last_stage_grows_its_head_at_the_scheduled_round_and_its_checkpoint_resumes_grown(
    tmp_path: Path,
) -> None:
    schedule = VocabSchedule()
    schedule.set(80, 1)
    told: list[int] = []
    schedule.on_grown = lambda engine: told.append(engine.round)
    lines: list[str] = []
    checkpoint = StageCheckpoint(path=tmp_path / "s1.pt", identity=_identity())
    worker = StageWorker(
        _engine(), WorkerConfig(max_steps=2 * H, max_pending=10), log=lines.append,
        finish_round=lambda d: d.outer_step(d.pseudo_gradient()), checkpoint=checkpoint, vocab_schedule=schedule,
    )  # fmt: skip
    results, _, _ = _feed(worker, 2 * H)
    assert all(isinstance(r, tuple) for r in results)  # the steps after the growth trained on the grown head
    assert told == [1] and vocab_of(worker.diloco) == 80
    assert "vocabulary grew 64 -> 80 at round 1 as scheduled: head extended, existing rows kept" in lines
    # A restart builds the definition's vocabulary; the checkpoint's rows say the stage grew.
    resumed = StageCheckpoint(path=checkpoint.path, identity=_identity()).load(_engine())
    assert resumed is not None and vocab_of(resumed) == 80
    assert resumed.weights_hash() == worker.diloco.weights_hash() and resumed.round == 2


def test_a_stage_resumes_a_checkpoint_made_before_the_tokenizer_grew(tmp_path: Path) -> None:
    old = _identity()
    StageCheckpoint(path=tmp_path / "s1.pt", identity=old).save(_engine(), wait=True)
    grown_tokenizer = CheckpointIdentity(
        wallet_id="w", stage=1, model_fingerprint=old.model_fingerprint, tokenizer_sha256="u" * 64
    )
    with pytest.raises(CheckpointMismatch, match="tokenizer_sha256"):
        StageCheckpoint(path=tmp_path / "s1.pt", identity=grown_tokenizer).load(_engine())
    lineage = StageCheckpoint(path=tmp_path / "s1.pt", identity=grown_tokenizer, older_tokenizers=("t" * 64,))
    assert lineage.load(_engine()) is not None


def test_a_checkpoint_from_before_a_growth_this_stage_never_took_is_refused(tmp_path: Path) -> None:
    """Without a verifier a pipeline never grows: a replica built at a grown tokenizer's size does not
    load the older, smaller checkpoint into its larger head (it says why instead of a shape error)."""
    StageCheckpoint(path=tmp_path / "s1.pt", identity=_identity()).save(_engine(), wait=True)
    grown = DiLoCo(
        build_stage(dataclasses.replace(MODEL, vocab_size=80), 1, 2),
        DiLoCoConfig(inner_steps=H, warmup_steps=0, total_steps=100),
    )
    with pytest.raises(CheckpointMismatch, match="holds a model of 64 ids, this replica is built at 80"):
        StageCheckpoint(path=tmp_path / "s1.pt", identity=_identity()).load(grown)


def test_every_gradient_sent_back_is_in_the_step_s_record_before_the_round_closes(tmp_path: Path) -> None:
    """A job whose transport encodes the reply (the pipeline route's) is answered with the bytes the
    worker encoded and recorded as its step's gradient sent back; the round closes only after every
    answer of the round, so its log names each of them (what a segment check compares and a
    sender's records are matched on)."""
    recorder = SegmentRecorder(SegmentConfig(segment_steps=H), stage=1)
    logs: list[SegmentLog] = []
    answered_at_close: list[int] = []
    results: list[JobResult] = []

    def finish(diloco: DiLoCo) -> None:
        answered_at_close.append(sum(isinstance(r, tuple) for r in results))
        recorder.end_round(diloco)
        diloco.outer_step(diloco.pseudo_gradient())
        closed = recorder.close_round()
        assert closed is not None
        logs.append(closed[0])
        recorder.start_round(diloco)

    engine = _engine()
    recorder.start_round(engine)
    worker = StageWorker(
        engine, WorkerConfig(max_steps=2 * H, max_pending=10), log=lambda s: None, finish_round=finish,
        segments=recorder,
    )  # fmt: skip

    def encoded(seed: int) -> Job:
        job = _job(results, seed)
        job.encode = lambda grad: grad.numpy().tobytes()  # any codec: the record names these bytes
        job.received = Received("activations", SENDER, b"{}", b"")  # the reply is signed for its sender
        return job

    thread = threading.Thread(target=worker.run, args=(threading.Event(), 0.01), daemon=True)
    thread.start()

    def answered() -> int:
        return sum(isinstance(r, tuple) for r in results)

    for i in range(2 * H):
        deadline = time.monotonic() + 10.0
        while answered() <= i and time.monotonic() < deadline:
            seen = len(results)
            try:
                worker.jobs.offer(encoded(i))
            except Busy:  # in its outer round
                time.sleep(0.005)
                continue
            while len(results) == seen and time.monotonic() < deadline:  # an answer, or Busy: offer again
                time.sleep(0.005)
    thread.join(10.0)
    assert not thread.is_alive() and answered_at_close == [H, 2 * H]  # answers, not Busy drains
    replies = [r for r in results if isinstance(r, tuple)]
    assert len(replies) == 2 * H and all(isinstance(r[0], bytes) for r in replies)
    recorded = [step.sent for log in logs for step in log.steps]
    assert recorded == [[SentRef(kind="gradient", payload_sha256=sha256_hex(r[0]))] for r in replies]  # type: ignore[arg-type]
    # Each reply's header is listed in the log of the round it names (the round of its step).
    listed = [{(x.kind, x.micro_batch, x.to) for x in log.headers or ()} for log in logs]
    assert listed == [
        {("gradient", f"{i:032x}", SENDER) for i in range(r * H, (r + 1) * H)} for r in range(2)
    ]


SENDER = "aa" * 32


class _FullDisk(SegmentSink):
    def header(self, round_: int, header: SignedHeader) -> None:
        raise OSError(28, "No space left on device")


def test_a_reply_whose_header_cannot_be_kept_is_not_sent() -> None:
    """A reply is sent only once its header is on disk (node.segments): when it cannot be written,
    the sender gets the error (and tries another replica), and the step records no gradient sent."""
    recorder = SegmentRecorder(SegmentConfig(segment_steps=H), stage=1, sink=_FullDisk())
    engine = _engine()
    recorder.start_round(engine)
    said: list[str] = []
    worker = StageWorker(engine, WorkerConfig(max_steps=1), log=said.append, segments=recorder)
    results: list[JobResult] = []
    job = _job(results, 0)
    job.encode = lambda grad: grad.numpy().tobytes()
    job.received = Received("activations", SENDER, b"{}", b"")
    worker.jobs.offer(job)
    worker.run(threading.Event(), 0.01)
    assert len(results) == 1 and isinstance(results[0], OSError), results
    assert any("cannot keep a gradient reply's header" in line for line in said), said
    assert recorder._current is not None and recorder._current.steps[0].sent == []


def test_replies_land_on_their_own_steps_when_one_id_is_trained_twice() -> None:
    """Two senders pass the same driver micro-batch on (one replica may train one id twice) while
    the replies queue behind a slow encoder: each reply is recorded on the step that computed it,
    not on the newest step of that id."""
    recorder = SegmentRecorder(SegmentConfig(segment_steps=H), stage=1)
    logs: list[SegmentLog] = []
    results: list[JobResult] = []

    def finish(diloco: DiLoCo) -> None:
        recorder.end_round(diloco)
        diloco.outer_step(diloco.pseudo_gradient())
        closed = recorder.close_round()
        assert closed is not None
        logs.append(closed[0])

    engine = _engine()
    recorder.start_round(engine)
    worker = StageWorker(
        engine, WorkerConfig(max_steps=H, max_pending=10), log=lambda s: None, finish_round=finish,
        segments=recorder,
    )  # fmt: skip

    def slowly(grad: torch.Tensor) -> bytes:
        time.sleep(0.05)  # the worker steps on while this reply waits
        return grad.numpy().tobytes()

    for i in range(H):
        job = dataclasses.replace(_job(results, i), micro_batch="ab" * 16, encode=slowly)
        worker.jobs.offer(job)
    thread = threading.Thread(target=worker.run, args=(threading.Event(), 0.01), daemon=True)
    thread.start()
    thread.join(10.0)
    assert not thread.is_alive() and len(logs) == 1
    replies = [r for r in results if isinstance(r, tuple)]
    assert len(replies) == H
    recorded = [step.sent for step in logs[0].steps]
    assert recorded == [[SentRef(kind="gradient", payload_sha256=sha256_hex(r[0]))] for r in replies]  # type: ignore[arg-type]


def _one_step(engine: DiLoCo, downstream: Forward, **kwargs: Any) -> StageWorker:
    """A middle stage's worker that ends after one step, sending its output on through `downstream`."""
    return StageWorker(
        engine, WorkerConfig(max_steps=1, max_pending=10), log=lambda s: None, downstream=downstream, **kwargs
    )


def test_a_middle_stage_job_that_offered_its_output_and_failed_is_a_failed_step() -> None:
    """A middle stage's job whose every attempt downstream failed answers its sender with the error
    (it retries) and is recorded as a failed step after the steps before it, with the message it
    ran on and the activations it offered (node.segments.note_failed): the headers it signed for
    them are held to that record, and a segment check replays it. Its retry, at the same weights,
    offers the same bytes and becomes the step."""
    recorder = SegmentRecorder(SegmentConfig(segment_steps=H), stage=1)
    engine = _middle_engine()
    recorder.start_round(engine)
    tries: list[str] = []

    def downstream(hidden: torch.Tensor, labels: torch.Tensor, mb: str) -> tuple[torch.Tensor, float]:
        body = hidden.numpy().tobytes()
        recorder.note_header(engine.round, "activations", mb, "bb" * 32, sha256_hex(body), body)
        tries.append(mb)
        if len(tries) == 1:
            raise ConnectionError("no replica of stage 2 took it")
        recorder.note_sent(mb, "activations", sha256_hex(body), body)
        return torch.zeros_like(hidden), 1.0

    worker = _one_step(engine, downstream, segments=recorder)
    results: list[JobResult] = []
    first, again = _job(results, 0), _job(results, 0)
    first.received = again.received = Received("activations", SENDER, b"{}", b"x")
    worker.jobs.offer(first)
    worker.jobs.offer(again)
    worker.run(threading.Event(), 0.01)
    assert isinstance(results[0], ConnectionError) and isinstance(results[1], tuple), results
    current = recorder._current
    assert current is not None and [(f.after, f.micro_batch) for f in current.failed] == [(0, f"{0:032x}")]
    assert current.failed[0].received == (first.received.ref(),)
    assert current.steps[0].sent[0] == current.failed[0].sent  # the same weights offer the same bytes


def test_a_failed_job_answers_its_sender_even_when_the_store_raises() -> None:
    """A store that cannot keep a failed step raises on the worker's thread, but the job's sender
    gets its answer first (it would otherwise wait out its timeout for a replica that is gone)."""

    class Broken(SegmentRecorder):
        def note_failed(self, micro_batch: str, received: Sequence[Received] = ()) -> None:
            raise OSError("disk full")

    engine = _middle_engine()

    def downstream(hidden: torch.Tensor, labels: torch.Tensor, mb: str) -> tuple[torch.Tensor, float]:
        raise ConnectionError("no replica of stage 2 took it")

    worker = _one_step(engine, downstream, segments=Broken(SegmentConfig(segment_steps=H), stage=1))
    results: list[JobResult] = []
    worker.jobs.offer(_job(results, 0))
    with pytest.raises(OSError, match="disk full"):
        worker.run(threading.Event(), 0.01)
    assert len(results) == 1 and isinstance(results[0], ConnectionError), results


def test_a_middle_stage_blames_an_overflowing_gradient_by_its_job_id_and_steps_without_a_failed_step() -> (
    None
):
    """The worker hands `stage_inner_step` a blame bound to the job's micro-batch: the transport
    bans whoever answered that id, the output goes elsewhere, and the step is recorded as one step
    (no failed step: nothing failed that a segment check must replay)."""
    recorder = SegmentRecorder(SegmentConfig(segment_steps=H), stage=1)
    engine = _middle_engine()
    recorder.start_round(engine)
    answers: list[str] = []
    blamed: list[tuple[str, str]] = []

    def downstream(hidden: torch.Tensor, labels: torch.Tensor, mb: str) -> tuple[torch.Tensor, float]:
        answers.append(mb)
        return torch.full_like(hidden, 3e38 if len(answers) == 1 else 1e-3), 1.0

    worker = _one_step(
        engine, downstream, blame=lambda mb, why: blamed.append((mb, why)) is None, segments=recorder
    )
    results: list[JobResult] = []
    job = _job(results, 0)
    job.received = Received("activations", SENDER, b"{}", b"x")
    worker.jobs.offer(job)
    worker.run(threading.Event(), 0.01)
    assert isinstance(results[0], tuple) and engine.step == 1, results
    assert [mb for mb, _ in blamed] == [f"{0:032x}"] == answers[:1] and len(answers) == 2
    current = recorder._current
    assert current is not None and current.failed == [] and len(current.steps) == 1


def test_dropping_a_sender_answers_its_waiting_jobs_busy_and_keeps_the_others_in_order() -> None:
    jobs = JobQueue(max_pending=4)
    results: dict[int, list[JobResult]] = {i: [] for i in range(4)}
    for i, sender in enumerate(["aa", "bb", "aa", "cc"]):
        job = _job(results[i], i)
        job.received = Received("activations", sender * 32, b"{}", b"x")
        jobs.offer(job)
    assert jobs.drop("aa" * 32, "struck") == 2
    assert [type(r[0]) for r in (results[0], results[2])] == [Busy, Busy] and not results[1]
    left = [jobs.take(0.01), jobs.take(0.01), jobs.take(0.01)]
    assert [j.micro_batch if j else None for j in left] == [f"{1:032x}", f"{3:032x}", None]
    jobs.offer(_job([], 9))  # room again


def test_a_middle_stage_sends_no_degenerate_output_and_fails_the_step_on_its_sender(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An output with a degenerate position (node.pipeline.degenerate_problem) is not offered: the
    step fails as the sender's fault (the service strikes whoever sent the activations), nothing
    is stepped, and the log records no failed step (nothing was signed or sent)."""
    recorder = SegmentRecorder(SegmentConfig(segment_steps=H), stage=1)
    engine = _middle_engine()
    recorder.start_round(engine)
    forward = engine.model.forward
    calls: list[int] = []

    def fitted(x: torch.Tensor) -> torch.Tensor:
        """The first job's output as activations fitted to its weights make it: one position, the
        last, just under twice the bound (the codec could carry it under the bound itself, and the
        next stage would strike this replica)."""
        calls.append(1)
        out = forward(x)
        if len(calls) > 1:
            return out
        scale = torch.ones_like(out)
        target = 1.9 * DEGENERATE_MEAN_SQUARE * MODEL.norm_eps
        scale[-1, -1] = (target / out[-1, -1].detach().pow(2).mean()).sqrt()
        return out * scale

    monkeypatch.setattr(engine.model, "forward", fitted)
    offered: list[str] = []

    def downstream(hidden: torch.Tensor, labels: torch.Tensor, mb: str) -> tuple[torch.Tensor, float]:
        offered.append(mb)
        return torch.zeros_like(hidden), 1.0

    worker = _one_step(engine, downstream, segments=recorder)
    results: list[JobResult] = []
    for seed in (0, 1):  # the second job's output is the stage's own: it steps, and the run ends
        job = _job(results, seed)
        job.received = Received("activations", SENDER, b"{}", b"x")
        worker.jobs.offer(job)
    worker.run(threading.Event(), 0.01)
    failure = results[0]
    assert isinstance(failure, NonFiniteStep) and not failure.gradient_at_fault, results
    assert "degenerate" in str(failure) and isinstance(results[1], tuple)
    assert offered == [f"{1:032x}"] and engine.step == 1
    current = recorder._current
    assert current is not None and current.failed == [] and len(current.steps) == 1
