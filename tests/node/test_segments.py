"""The segment log: its chain and root, the recorder's bookkeeping, the bounded disk store, and the
trainer + receipt hook committing a root the verifier's segment check accepts on real data."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from tests_support import refused

from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, build_stage, stage_layers
from neuroshard.node.network_definition import NetworkDefinition
from neuroshard.node.p2p.pipeline_wire import bytes_per_token
from neuroshard.node.p2p.rounds import RoundReport
from neuroshard.node.receipt import Receipting
from neuroshard.node.replay import ReplayArchive
from neuroshard.node.reporting import DISK_MARGIN, segment_round_bytes, segment_store
from neuroshard.node.segment_store import SegmentMaterial, SegmentStore
from neuroshard.node.segments import (
    SegmentCheckpoint,
    SegmentConfig,
    SegmentRecorder,
    SegmentSink,
    round_bytes,
)
from neuroshard.node.trainer import Trainer, TrainerConfig, lone_replica
from neuroshard.node.wallet import Wallet
from neuroshard.node.work import RoundWork
from neuroshard.protocol.identity import sha256_hex
from neuroshard.protocol.reports import DataSpan, Receipt
from neuroshard.protocol.segments import (
    FailedStep,
    Received,
    ReceivedRef,
    SegmentCommitment,
    SegmentLog,
    SentRef,
    SignedHeader,
    StepRecord,
    max_failed,
    max_failed_in_segment,
    max_headers,
    segment_boundaries,
)
from neuroshard.testing.verifier import small_network
from neuroshard.verifier.replaycheck import ReplayCheckConfig, tolerance_for
from neuroshard.verifier.segmentcheck import SegmentClaim, check_segment
from neuroshard.verifier.spotcheck import claimed_batches

MODEL = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, ffn_dim=32, max_seq_len=16)
WALLET = Wallet.from_token("segments")


def _log(**overrides: Any) -> SegmentLog:
    steps = tuple(StepRecord(data=(1, 2 * i, 2 * i + 2)) for i in range(5))
    fields: dict[str, Any] = dict(
        stage=0, round=3, segment_steps=2, start_step=15, steps=steps,
        checkpoints=tuple(sha256_hex(bytes([i])) for i in range(4)),
    )  # fmt: skip
    fields.update(overrides)
    return SegmentLog(**fields)


def test_boundaries_cut_a_round_into_segments_of_k_and_a_shorter_last_one() -> None:
    assert segment_boundaries(5, 2) == [0, 2, 4, 5]
    assert segment_boundaries(4, 2) == [0, 2, 4]
    assert segment_boundaries(0, 2) == [0]
    log = _log()
    assert log.segments == 3 and log.segment(2) == (4, 5)
    with pytest.raises(IndexError):
        log.segment(3)
    with refused("malformed", match="needs 4 checkpoint hashes"):
        _log(checkpoints=log.checkpoints[:3])


def test_the_root_changes_with_every_step_record_and_checkpoint_and_survives_json() -> None:
    log = _log()
    again = SegmentLog.from_json(log.to_json())
    assert again == log and again.root() == log.root()
    steps = list(log.steps)
    steps[3] = StepRecord(data=(1, 6, 9))
    variants = [
        _log(steps=tuple(steps)),
        _log(checkpoints=(*log.checkpoints[:2], sha256_hex(b"x"), log.checkpoints[3])),
        _log(round=4),
        _log(start_step=16),
        _log(steps=log.steps[:4], checkpoints=log.checkpoints[:3]),
        _log(
            headers=(
                SignedHeader(kind="gradient", micro_batch="00" * 16, to="11" * 32, payload_sha256="22" * 32),
            )
        ),
    ]
    roots = {v.root() for v in variants}
    assert log.root() not in roots and len(roots) == len(variants)
    assert SegmentLog.from_json(variants[-1].to_json()) == variants[-1]


def test_a_malformed_log_is_refused() -> None:
    obj = _log().to_json().replace(b'"data":[1,0,2]', b'"data":[1,2,0]')
    with refused("malformed", match="ends at 0 before it starts"):
        SegmentLog.from_json(obj)
    with refused("malformed", match="exactly"):
        SegmentLog.from_json(b'{"stage":0}')
    a, b = (
        SignedHeader(kind="activations", micro_batch=f"{i:032x}", to="11" * 32, payload_sha256="22" * 32)
        for i in range(2)
    )
    for listed in ((b, a), (a, a)):  # one order, each once: one root for one set of headers
        with refused("malformed", match="sorted, each listed once"):
            _log(headers=listed)
    many = [
        SignedHeader(kind="activations", micro_batch=f"{i:032x}", to="11" * 32, payload_sha256="22" * 32)
        for i in range(max_headers(5) + 1)
    ]
    with refused("malformed", match="headers"):
        SegmentLog.from_json(_log().to_json().replace(b'"headers":[]', _listed(many)))


def test_a_log_from_before_headers_were_listed_reads_back_with_its_old_root() -> None:
    """Fraud proofs kept from before 2026-12-07 hold logs without a headers list: such a log parses
    (headers None), keeps the root it was committed to (the chain without the headers' entry) and
    writes back as it was; an empty list is another log, with another root."""
    old = _log().to_obj()
    del old["headers"]
    log = SegmentLog.from_obj(old)
    assert log.headers is None and log.to_obj() == old
    assert log.root() != _log().root() and SegmentLog.from_json(log.to_json()).root() == log.root()


def _failed(after: int, received: tuple[ReceivedRef, ...] = ()) -> FailedStep:
    return FailedStep(
        after=after, micro_batch="ab" * 16, received=received,
        sent=SentRef(kind="activations", payload_sha256="22" * 32),
    )  # fmt: skip


def test_a_log_s_failed_steps_are_bound_into_its_root_and_checked_when_read() -> None:
    """Failed steps (a middle stage's micro-batches offered downstream and never stepped on) are a
    chain entry of their own: a log that lists one has another root, one from before they were
    listed (no "failed" key) keeps its old root and writes back as it was, and a list out of
    order, past the round's last step, too long, or naming a gradient as offered is refused."""
    given = ReceivedRef(
        kind="activations", sender="aa" * 32, header_sha256="bb" * 32, payload_sha256="cc" * 32
    )
    listed = _log(failed=(_failed(0), _failed(2, (given,))))
    back = SegmentLog.from_json(listed.to_json())
    assert back == listed and back.root() == listed.root() != _log().root()
    assert listed.failures_in(0) == [] and listed.failures_in(1) == [
        1
    ]  # one without its input is not replayed
    old = _log().to_obj()
    del old["failed"]
    before = SegmentLog.from_obj(old)
    assert before.failed is None and before.to_obj() == old and before.root() != _log().root()
    assert before.failures_in(0) == []
    for wrong in ((_failed(3), _failed(1)), (_failed(5),)):
        with refused("malformed", match="in order, each before the round's last step"):
            _log(failed=wrong)
    too_many = [_failed(0).to_obj() for _ in range(max_failed(5) + 1)]
    with refused("malformed", match="failed steps must be a list of at most"):
        SegmentLog.from_obj({**_log().to_obj(), "failed": too_many})
    gradient = {**_failed(1).to_obj(), "sent": {"kind": "gradient", "payload_sha256": "22" * 32}}
    with refused("malformed", match="must be activations"):
        SegmentLog.from_obj({**_log().to_obj(), "failed": [gradient]})
    two = {**_failed(1).to_obj(), "received": [given.to_obj(), given.to_obj()]}
    with refused("malformed", match="at most 1 message"):
        SegmentLog.from_obj({**_log().to_obj(), "failed": [two]})


def test_offers_carried_from_a_crashed_run_come_first_and_a_segment_s_failed_steps_are_bounded() -> None:
    """An entry without its input (an offer of a crashed run of the round, listed, not replayed) is
    only ever written at the redone round's start: one placed later, or after a replayed entry, is
    a forged way to list an offer unchecked and is refused. A log with one `carries` (a segment
    check of it earns no credit: verifier.segmentlive). One segment lists at most
    `max_failed_in_segment(k)` replayed failed steps (each costs the check a forward)."""
    given = ReceivedRef(
        kind="activations", sender="aa" * 32, header_sha256="bb" * 32, payload_sha256="cc" * 32
    )
    assert _log(failed=(_failed(0), _failed(0, (given,)))).carries
    assert not _log(failed=(_failed(0, (given,)),)).carries and not _log().carries
    for forged in ((_failed(2),), (_failed(0, (given,)), _failed(0))):
        with refused("malformed", match="carried from a crashed run .* must come first, at step 0"):
            _log(failed=forged)
    k = _log().segment_steps
    crowd = tuple(_failed(2, (given,)) for _ in range(max_failed_in_segment(k) + 1))
    with refused("malformed", match=f"segment 1 lists more than {max_failed_in_segment(k)} failed steps"):
        _log(failed=crowd)
    assert len(_log(failed=crowd[1:]).failures_in(1)) == max_failed_in_segment(k)


def test_a_round_with_more_failed_steps_in_a_segment_than_a_log_holds_records_none(tmp_path: Path) -> None:
    """The recorder counts a segment's replayed failed steps as the log's validator does: k + 8 in
    one segment make a log that parses; one more, no log for the round (and it says why)."""
    k = 2
    for extra, logged in ((0, True), (1, False)):
        said: list[str] = []
        recorder = SegmentRecorder(SegmentConfig(segment_steps=k), stage=1, log=said.append)
        diloco = _engine()
        recorder.start_round(diloco)
        given = Received("activations", "dd" * 32, b"header", b"input")
        for i in range(diloco.config.inner_steps):
            if i == k:  # the first step of segment 1: its failures ran at the segment's start
                for n in range(max_failed_in_segment(k) + extra):
                    mb = f"{1000 + n:032x}"
                    recorder.note_header(diloco.round, "activations", mb, "aa" * 32, "cc" * 32, b"x")
                    recorder.note_failed(mb, [given])
            diloco.inner_step(*_batch(i))
            recorder.record_step(diloco, micro_batch=f"{i:032x}", received=[given])
        recorder.end_round(diloco)
        diloco.outer_step(diloco.pseudo_gradient())
        closed = recorder.close_round(WALLET)
        if logged:
            assert closed is not None and len(closed[0].failures_in(1)) == max_failed_in_segment(k)
            assert SegmentLog.from_json(closed[0].to_json()) == closed[0]
        else:
            assert closed is None and any("failed more steps than a log holds" in x for x in said), said


def _listed(headers: list[SignedHeader]) -> bytes:
    return b'"headers":[' + b",".join(x.to_json() for x in headers) + b"]"


def test_every_header_signed_is_listed_in_the_round_it_names_even_across_a_crash(tmp_path: Path) -> None:
    """The recorder lists every header signed naming the round being recorded, once, sorted; one
    naming another round is not this round's. Each is on disk before it is sent, so a round redone
    after a crash (a new recorder on the same store, the round started again) lists what the
    crashed run signed, and a line the crash cut short is skipped. A round that signs more headers
    than a log holds gets no log (and says why) rather than one that leaves headers out."""
    said: list[str] = []
    store = SegmentStore(tmp_path, SegmentConfig(segment_steps=2), log=lambda _: None)
    crashed = SegmentRecorder(SegmentConfig(segment_steps=2), stage=1, sink=store)
    diloco = _engine()
    crashed.start_round(diloco)
    round_ = diloco.round
    crashed.note_header(round_, "gradient", "ff" * 16, "ee" * 32, "cc" * 32)  # then the process dies
    with open(tmp_path / f"round-{round_:012d}" / "headers.jsonl", "ab") as torn:
        torn.write(b'{"kind":"activ')  # a line cut short: its header was never sent
    recorder = SegmentRecorder(SegmentConfig(segment_steps=2), stage=1, sink=store, log=said.append)
    recorder.start_round(diloco)  # the round redone from its start
    for i in range(diloco.config.inner_steps):
        mb = f"{i:032x}"
        for to in ("bb" * 32, "aa" * 32, "bb" * 32):  # busy, then taken elsewhere; a retry repeats one
            recorder.note_header(round_, "activations", mb, to, "cc" * 32)
        recorder.note_header(round_ + 1, "activations", mb, "dd" * 32, "cc" * 32)  # another round's
        diloco.inner_step(*_batch(i))
        recorder.record_step(diloco, micro_batch=mb)
    recorder.end_round(diloco)
    diloco.outer_step(diloco.pseudo_gradient())
    closed = recorder.close_round(WALLET)
    assert closed is not None
    log, _ = closed
    assert len(log.headers) == 2 * diloco.config.inner_steps + 1 and list(log.headers) == sorted(log.headers)
    assert {x.to for x in log.headers} == {"aa" * 32, "bb" * 32, "ee" * 32}
    assert store.log(round_) is not None and store.log(round_)[0].headers == log.headers  # type: ignore[index]
    # A round a crash left with its headers alone holds no heavy files: the budget and the choice of
    # the round to keep pass over it.
    store.header(
        round_ + 7,
        SignedHeader(kind="gradient", micro_batch="ff" * 16, to="ee" * 32, payload_sha256="cc" * 32),
    )
    store.abandon(round_ + 7)
    assert (tmp_path / f"round-{round_ + 7:012d}" / "headers.jsonl").exists()
    store.trim()
    assert store.rounds() == [round_] and store.load_checkpoint(round_, 0) is not None

    recorder.start_round(diloco)
    for i in range(max_headers(diloco.config.inner_steps) + 1):  # more than a log of its steps holds
        recorder.note_header(diloco.round, "activations", "ee" * 16, f"{i:064x}", "cc" * 32)
    for i in range(diloco.config.inner_steps):
        diloco.inner_step(*_batch(i))
        recorder.record_step(diloco, micro_batch=f"{i:032x}")
    recorder.end_round(diloco)
    diloco.outer_step(diloco.pseudo_gradient())
    assert recorder.close_round(WALLET) is None
    assert any("more pipeline headers or failed more steps than a log holds" in line for line in said)


def test_a_failed_step_is_kept_with_what_it_ran_on_and_a_crashed_run_s_offers_are_carried(
    tmp_path: Path,
) -> None:
    """A later stage's micro-batch that offered activations downstream and failed is recorded as a
    failed step after the steps before it, with the message it ran on; the store keeps that and
    the offered bytes, and the material of its segment carries them (through the wire's encoding).
    A failure that offered nothing records nothing. Offers a crashed run signed naming the round
    are carried into the redone round's log as failed steps without their input, once each."""
    store = SegmentStore(tmp_path, SegmentConfig(segment_steps=2), log=lambda _: None)
    crashed = SegmentRecorder(SegmentConfig(segment_steps=2), stage=1, sink=store)
    diloco = _engine()
    crashed.start_round(diloco)
    round_ = diloco.round
    for to in ("aa" * 32, "bb" * 32):  # one offer to two replicas, then the process dies
        crashed.note_header(round_, "activations", "01" * 16, to, "cc" * 32, b"offer")
    recorder = SegmentRecorder(SegmentConfig(segment_steps=2), stage=1, sink=store)
    recorder.start_round(diloco)
    given = Received("activations", "dd" * 32, b"header", b"input")
    first = f"{1:032x}"
    for i in range(diloco.config.inner_steps):
        mb = f"{i:032x}"
        if i == 1:
            recorder.note_failed("ee" * 16, [given])  # failed before it offered anything
            for to in ("aa" * 32, "bb" * 32):
                recorder.note_header(round_, "activations", mb, to, sha256_hex(b"first"), b"first")
            recorder.note_failed(mb, [given])
        diloco.inner_step(*_batch(i))
        recorder.record_step(diloco, micro_batch=mb, received=[given])
    recorder.end_round(diloco)
    diloco.outer_step(diloco.pseudo_gradient())
    closed = recorder.close_round(WALLET)
    assert closed is not None
    log, _ = closed
    offered = SentRef(kind="activations", payload_sha256=sha256_hex(b"first"))
    assert log.failed == (
        FailedStep(
            after=0,
            micro_batch="01" * 16,
            received=(),
            sent=SentRef(kind="activations", payload_sha256="cc" * 32),
        ),
        FailedStep(after=1, micro_batch=first, received=(given.ref(),), sent=offered),
    )
    assert store.load_failed(round_, 1) == ([given], b"first") and store.load_failed(round_, 0) is None
    material = store.material(round_, 0)
    assert material is not None and [(n, body) for n, _, body in material.failed] == [(1, b"first")]
    wire = SegmentMaterial.decode(
        material.encode(), numel=material.start.weights.numel(), n_tensors=material.start.inner.steps.numel()
    )
    assert wire.failed == material.failed == ((1, (given,), b"first"),)
    # Metadata that names other failed steps, or more messages than one ran on, or no number at
    # all, is refused before any of it is used; so is a failed step's tensor left out.
    n, k = material.start.weights.numel(), material.start.inner.steps.numel()
    for failed, said in (
        ("0:1", "not the ones its segment replays"),
        ("1:2", "not the ones its segment replays"),
        ("", "not the ones its segment replays"),
        ("x:1", "metadata is incomplete"),
    ):
        with refused("malformed", match=said):
            SegmentMaterial.decode(_with_metadata(material.encode(), failed=failed), numel=n, n_tensors=k)
    with refused("malformed", match="unexpectedly or lacks them"):
        SegmentMaterial.decode(_with_metadata(material.encode(), drop="f1.sent"), numel=n, n_tensors=k)
    assert store.material(round_, 1) is not None and store.material(round_, 1).failed == ()  # type: ignore[union-attr]
    # A driver redoing a round re-sends its own ids' bytes: it carries nothing over.
    driver = SegmentRecorder(SegmentConfig(segment_steps=2), stage=0, sink=store)
    store.header(
        round_ + 1,
        SignedHeader(kind="activations", micro_batch="01" * 16, to="aa" * 32, payload_sha256="cc" * 32),
    )
    diloco.round, diloco.steps_in_round = round_ + 1, 0
    driver.start_round(diloco)
    for i in range(diloco.config.inner_steps):
        diloco.inner_step(*_batch(i))
        driver.record_step(diloco, micro_batch=f"{i:032x}")
    driver.end_round(diloco)
    diloco.outer_step(diloco.pseudo_gradient())
    closed = driver.close_round(WALLET)
    assert closed is not None and closed[0].failed == ()


def _with_metadata(data: bytes, *, drop: str = "", **changes: str) -> bytes:
    """Segment material's bytes with metadata entries changed (an empty value removes one) and a
    tensor dropped: what a dishonest replica could serve."""
    from safetensors.torch import load, save

    size = int.from_bytes(data[:8], "little")  # safetensors: a u64 header length, then its JSON
    metadata = dict(json.loads(data[8 : 8 + size])["__metadata__"])
    for key, value in changes.items():
        if value:
            metadata[key] = value
        else:
            metadata.pop(key, None)
    tensors = {name: t for name, t in load(data).items() if name != drop}
    return save(tensors, metadata=metadata)


def test_received_and_sent_refs_are_hashes_of_what_travelled() -> None:
    m = Received("activations", WALLET.public_key_hex, b'{"h":1}', b"payload")
    assert m.ref() == ReceivedRef(
        kind="activations",
        sender=WALLET.public_key_hex,
        header_sha256=sha256_hex(b'{"h":1}'),
        payload_sha256=sha256_hex(b"payload"),
    )
    record = StepRecord(
        micro_batch="ab" * 16,
        received=[m.ref()],
        sent=[SentRef(kind="gradient", payload_sha256=sha256_hex(b"g"))],
    )
    assert StepRecord.from_obj(record.to_obj(), "step") == record


def _engine() -> DiLoCo:
    torch.manual_seed(0)
    return DiLoCo(build_stage(MODEL, 0, 1), DiLoCoConfig(inner_steps=5, warmup_steps=1, total_steps=50))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(i))
    return tokens[:, :-1], tokens[:, 1:]


def _record_round(recorder: SegmentRecorder, diloco: DiLoCo, late_sent: bool = False) -> SegmentLog:
    recorder.start_round(diloco)
    for i in range(diloco.config.inner_steps):
        diloco.inner_step(*_batch(i))
        recorder.record_step(diloco, data=(0, 2 * i, 2 * i + 2), micro_batch=f"{i:032x}")
        if late_sent:
            recorder.note_sent(f"{i:032x}", "gradient", sha256_hex(bytes([i])))
    recorder.end_round(diloco)
    diloco.outer_step(diloco.pseudo_gradient())
    closed = recorder.close_round(WALLET)
    assert closed is not None
    log, commitment = closed
    assert commitment is not None and commitment.signature_valid() and commitment.root == log.root()
    return log


def test_the_recorder_checkpoints_every_k_steps_and_at_the_round_end(tmp_path: Path) -> None:
    store = SegmentStore(tmp_path, SegmentConfig(segment_steps=2), log=lambda _: None)
    recorder = SegmentRecorder(SegmentConfig(segment_steps=2), stage=0, sink=store)
    diloco = _engine()
    log = _record_round(recorder, diloco, late_sent=True)
    assert log.boundaries == [0, 2, 4, 5] and log.start_step == 0 and len(log.steps) == 5
    assert [s.sent for s in log.steps][2] == [
        SentRef(kind="gradient", payload_sha256=sha256_hex(bytes([2])))
    ]  # arrived after its step
    for b, h in zip(log.boundaries, log.checkpoints, strict=True):
        checkpoint = store.load_checkpoint(0, b)
        assert checkpoint is not None and checkpoint.sha256() == h
    material = store.material(0, 1)
    assert material is not None and (material.start.sha256(), material.end.sha256()) == log.checkpoints[1:3]
    n = material.start.weights.numel()
    decoded = SegmentMaterial.decode(material.encode(), numel=n, n_tensors=len(diloco.params))
    assert decoded.log == log and torch.equal(decoded.end.weights, material.end.weights)
    with refused("malformed"):
        SegmentMaterial.decode(material.encode(), numel=n + 1, n_tensors=len(diloco.params))
    with refused("malformed"):
        SegmentMaterial.decode(material.encode()[:-3], numel=n, n_tensors=len(diloco.params))
    assert store.material(0, 3) is None and store.material(1, 0) is None


def test_a_round_entered_mid_way_is_not_committed(tmp_path: Path) -> None:
    recorder = SegmentRecorder(SegmentConfig(segment_steps=2), stage=0)
    diloco = _engine()
    diloco.inner_step(*_batch(0))
    recorder.start_round(diloco)  # resumed from a mid-round checkpoint: earlier steps are unknown
    recorder.record_step(diloco, data=(0, 0, 2))
    recorder.end_round(diloco)
    assert recorder.close_round(WALLET) is None
    recorder.start_round(_engine())
    other = _engine()
    recorder.start_round(other)
    other.inner_step(*_batch(0))
    other.inner_step(*_batch(1))  # a step the recorder did not see
    recorder.record_step(other, data=(0, 0, 2))
    recorder.end_round(other)
    assert recorder.close_round(WALLET) is None


def test_the_store_keeps_the_last_rounds_within_its_byte_budget(tmp_path: Path) -> None:
    lines: list[str] = []
    config = SegmentConfig(segment_steps=2, keep_rounds=2)
    store = SegmentStore(tmp_path / "a", config, log=lines.append)
    recorder = SegmentRecorder(config, stage=1, sink=store)
    diloco = _engine()
    for _ in range(4):
        _record_round(recorder, diloco)
    assert store.rounds() == [2, 3]
    one_round = sum(f.stat().st_size for f in (tmp_path / "a" / "round-000000000003").iterdir())
    tight = dataclasses.replace(config, keep_rounds=5, max_bytes=int(1.5 * one_round))
    store = SegmentStore(tmp_path / "b", tight, log=lines.append)
    recorder = SegmentRecorder(tight, stage=1, sink=store)
    for _ in range(3):
        _record_round(recorder, diloco)
    assert store.rounds() == [6]  # a second round would pass the budget
    assert not lines
    small = dataclasses.replace(config, max_bytes=one_round // 2)
    store = SegmentStore(tmp_path / "c", small, log=lines.append)
    _record_round(SegmentRecorder(small, stage=1, sink=store), diloco)
    assert store.rounds() == [7] and "over the store's" in lines[-1]  # kept alone, and said so


def test_received_messages_are_stored_with_their_bytes(tmp_path: Path) -> None:
    store = SegmentStore(tmp_path, SegmentConfig(segment_steps=2), log=lambda _: None)
    messages = [Received("activations", WALLET.public_key_hex, b'{"a":1}', bytes(range(256)) * 3)]
    store.received(5, 7, messages)
    assert store.load_received(5, 7) == messages and store.load_received(5, 8) == []


def test_a_commitment_signed_by_another_wallet_does_not_verify() -> None:
    c = SegmentCommitment.create(WALLET, stage=1, round=2, root="ab" * 32)
    forged = dataclasses.replace(c, wallet=Wallet.from_token("other").public_key_hex)
    assert c.signature_valid() and not forged.signature_valid()


def _report(round_: int) -> RoundReport:
    return RoundReport(
        stage=0, round=round_, accepted=(), rejected=(), equivocators=(), late=False,
        next_round=round_ + 1, theta_hash="0" * 64, agree=1, voters=1, resynced_from=None, seconds=0.0,
    )  # fmt: skip


def test_the_trainer_commits_a_root_that_a_stage_0_segment_check_accepts(published, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    dataset = published.dataset
    model = dataclasses.replace(MODEL, vocab_size=dataset.tokenizer.vocab_size, max_seq_len=32)
    diloco_cfg = DiLoCoConfig(inner_steps=6, warmup_steps=2, total_steps=100)
    config = SegmentConfig(segment_steps=4)
    store = SegmentStore(tmp_path / "segments", config, log=lambda _: None)
    recorder = SegmentRecorder(config, stage=0, sink=store)
    work = RoundWork()
    reports: list[RoundReport] = []
    receipts: list[Receipt] = []

    def finish(diloco: DiLoCo) -> None:
        reports.append(_report(diloco.round))
        lone_replica(diloco)

    archive = ReplayArchive(keep_rounds=4)
    receipting = Receipting(
        finish, reports, work, receipts.append, batch_size=2, tokens_per_step=64,
        log=lambda _: None, segments=recorder, signer=WALLET, archive=archive,
    )  # fmt: skip
    trainer = Trainer(
        wallet_id=WALLET.wallet_id, dataset=dataset, model_config=model, diloco_config=diloco_cfg,
        config=TrainerConfig(batch_size=2, seq_len=32, max_steps=12, checkpoint_every=100, log_every=100),
        checkpoint_dir=tmp_path / "ck", log=lambda _: None, finish_round=receipting, work=work, segments=recorder,
    )  # fmt: skip
    receipting.round_started(trainer.diloco)
    trainer.run(threading.Event())
    assert [r.round for r in receipts] == [0, 1]
    receipt = Receipt.from_json(receipts[1].to_json())
    assert receipt.segments == 2 and receipt.segment_root is not None
    held = store.log(1)
    assert held is not None and held[0].root() == receipt.segment_root
    # Rounds checked by segments keep no whole-round replay material in memory (θ, Δ and the
    # moments: 16 bytes a parameter a round); a receipt without a root still does (test_replay).
    assert archive.rounds() == []

    spans = [(s.shard_id, s.offset_start, s.offset_end) for s in receipt.data]

    def read_batch(span: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        (batch,) = claimed_batches(
            source=dataset.source, manifest=dataset.manifest, wallet_id=WALLET.wallet_id,
            spans=[DataSpan(shard_id=span[0], offset_start=span[1], offset_end=span[2])],
            batch_size=2, seq_len=32,
        )  # fmt: skip
        return batch

    claim = SegmentClaim(
        model=model, diloco=diloco_cfg, num_stages=1, stage=0, round=1,
        wallet=WALLET.public_key_hex, root=receipt.segment_root, spans=spans,
        base_hash=receipt.base_hash, delta_digest=receipt.delta_digest,
    )  # fmt: skip
    tolerance = tolerance_for("cpu", "fp32", ReplayCheckConfig())
    for j in range(2):
        material = store.material(1, j)
        assert material is not None
        verdict = check_segment(claim, material, tolerance, read_batch=read_batch)
        assert verdict.ok and verdict.cosine is not None and verdict.cosine > 1 - 1e-9, verdict.reason


def test_a_receipt_names_a_segment_root_with_its_count_or_neither() -> None:
    base: dict[str, Any] = dict(
        stage=1, round=0, inner_steps=4, start_step=0, tokens=0, data=[], losses=[],
        base_hash="0" * 64, result_hash="1" * 64, delta_digest="2" * 64,
    )  # fmt: skip
    assert Receipt.from_obj(base).segment_root is None  # before issue 17: accepted
    assert Receipt.from_obj({**base, "segment_root": "3" * 64, "segments": 2})
    for bad in ({"segment_root": "3" * 64}, {"segments": 2}, {"segment_root": "3" * 64, "segments": 5}):
        with refused("invalid"):
            Receipt.from_obj({**base, **bad})


def test_a_round_whose_engine_was_rebuilt_is_not_committed(tmp_path: Path) -> None:
    """Vocabulary growth builds a new engine after the round's first checkpoint was taken: that
    checkpoint no longer fits the model the round trains, so the round commits no segment root."""
    store = SegmentStore(tmp_path, SegmentConfig(segment_steps=2), log=lambda _: None)
    recorder = SegmentRecorder(SegmentConfig(segment_steps=2), stage=0, sink=store)
    before = _engine()
    recorder.start_round(before)
    after = _engine()  # the rebuilt replica
    after.inner_step(*_batch(0))
    recorder.record_step(after, data=(0, 0, 2))
    recorder.end_round(after)
    assert recorder.close_round(WALLET) is None
    assert store.rounds() == [] and not (tmp_path / "round-000000000000").exists()


def test_checkpoints_are_hashed_and_stored_off_the_training_thread() -> None:
    """A slow disk does not hold up the inner steps until more than MAX_IO_IN_FLIGHT writes wait;
    the round's log still names every checkpoint's hash, in order."""
    released = threading.Event()
    stored: list[int] = []

    class SlowSink(SegmentSink):
        def checkpoint(self, round_: int, step: int, checkpoint: SegmentCheckpoint) -> None:
            released.wait(timeout=30)
            stored.append(step)

    recorder = SegmentRecorder(SegmentConfig(segment_steps=1), stage=0, sink=SlowSink())
    engine = _engine()
    recorder.start_round(engine)  # checkpoint 0: queued, blocked
    engine.inner_step(*_batch(0))
    recorder.record_step(engine, data=(0, 0, 2))  # checkpoint 1: queued
    assert stored == []  # the training thread went on while the first write waits
    released.set()
    for i in (1, 2):
        engine.inner_step(*_batch(i))
        recorder.record_step(engine, data=(0, 2 * i, 2 * i + 2))
    recorder.end_round(engine)
    closed = recorder.close_round(WALLET)
    assert closed is not None and stored == [0, 1, 2, 3]
    assert len(closed[0].checkpoints) == 4


def test_a_committed_round_is_not_abandoned_by_a_resume_at_its_start(tmp_path: Path) -> None:
    """A node that crashed after committing a round and resumed at that round's start must still
    answer for it: starting the round again does not delete its committed log; uncommitted
    leftovers, half-written files included, do go."""
    config = SegmentConfig(segment_steps=2)
    store = SegmentStore(tmp_path, config, log=lambda _: None)
    diloco = _engine()
    log = _record_round(SegmentRecorder(config, stage=0, sink=store), diloco)
    store.abandon(log.round)
    assert store.log(log.round) is not None and store.end_opening(log.round) is not None
    lines: list[str] = []
    again = SegmentRecorder(config, stage=0, sink=store, log=lines.append)
    before = store.load_checkpoint(log.round, 0)
    diloco.round = log.round  # resumed at the committed round's start
    diloco.steps_in_round = 0
    again.start_round(diloco)  # not recorded again: the kept checkpoints stay the committed ones
    again.flush()
    after = store.load_checkpoint(log.round, 0)
    assert before is not None and after is not None and torch.equal(before.weights, after.weights)
    assert lines == [f"segments: round {log.round} was committed before a restart; not recorded again"]
    leftover = tmp_path / "round-000000000005"
    leftover.mkdir()
    (leftover / "ckpt-00000000.tmp").write_bytes(b"half")
    store.abandon(5)
    assert not leftover.exists()


def test_what_a_step_sent_is_kept_with_it_and_nothing_strays_to_another_step(tmp_path: Path) -> None:
    """The bytes a step sent on go to the store beside it: activations forwarded during the step, a
    gradient reply encoded after it (also after end_round, until the round is closed). A reply for
    no recorded step is dropped, not hung on the next one, and a step that failed after forwarding
    leaves nothing for the step after it."""
    store = SegmentStore(tmp_path, SegmentConfig(segment_steps=2), log=lambda _: None)
    recorder = SegmentRecorder(SegmentConfig(segment_steps=2), stage=1, sink=store)
    diloco = _engine()
    recorder.start_round(diloco)
    steps = diloco.config.inner_steps
    for i in range(steps):
        mb = f"{i:032x}"
        if i == 2:  # forwarded, then the step failed: the micro-batch is retried as step 2 again
            recorder.note_sent(mb, "activations", sha256_hex(b"first try"), b"first try")
            recorder.note_failed(mb)
        recorder.note_sent(f"{99:032x}", "gradient", sha256_hex(b"stray"), b"stray")  # no such step
        # A late answer to an attempt of another micro-batch that a step gave up on: not this step's.
        recorder.note_received(Received("gradient", "aa" * 32, b"late", b"late"), f"{98:032x}")
        recorder.note_sent(mb, "activations", sha256_hex(bytes([i])), bytes([i]))
        diloco.inner_step(*_batch(i))
        recorder.record_step(diloco, micro_batch=mb)
        if i < steps - 1:
            recorder.note_sent(mb, "gradient", sha256_hex(bytes([100 + i])), bytes([100 + i]))
    recorder.end_round(diloco)
    last = f"{steps - 1:032x}"
    recorder.note_sent(last, "gradient", sha256_hex(bytes([100 + steps - 1])), bytes([100 + steps - 1]))
    diloco.outer_step(diloco.pseudo_gradient())
    closed = recorder.close_round(WALLET)
    assert closed is not None
    log, _ = closed
    for i, step in enumerate(log.steps):
        want = [("activations", bytes([i])), ("gradient", bytes([100 + i]))]
        assert [(r.kind, r.payload_sha256) for r in step.sent] == [(k, sha256_hex(b)) for k, b in want], i
        assert store.load_sent(0, i) == want and step.received == []


def test_one_id_trained_twice_keeps_each_step_s_payloads_on_that_step(tmp_path: Path) -> None:
    """One replica may train one driver's micro-batch twice (two replicas of the stage between sent
    it on). Activations go to the step in progress, never to the earlier step of that id; a reply
    named by its step (`last_step`, as the stage worker names it) lands there even when the later
    step of that id was recorded first."""
    store = SegmentStore(tmp_path, SegmentConfig(segment_steps=2), log=lambda _: None)
    recorder = SegmentRecorder(SegmentConfig(segment_steps=2), stage=1, sink=store)
    diloco = _engine()
    recorder.start_round(diloco)
    mb = "ab" * 16
    named = []
    for i in range(diloco.config.inner_steps):
        recorder.note_sent(mb, "activations", sha256_hex(bytes([i])), bytes([i]))
        diloco.inner_step(*_batch(i))
        recorder.record_step(diloco, micro_batch=mb)
        named.append(recorder.last_step())
    assert named == [(0, i) for i in range(diloco.config.inner_steps)]
    for i, step in reversed(list(enumerate(named))):  # replies noted newest first
        recorder.note_sent(mb, "gradient", sha256_hex(bytes([100 + i])), bytes([100 + i]), step=step)
    recorder.end_round(diloco)
    diloco.outer_step(diloco.pseudo_gradient())
    closed = recorder.close_round(WALLET)
    assert closed is not None
    for i, step in enumerate(closed[0].steps):
        want = [("activations", bytes([i])), ("gradient", bytes([100 + i]))]
        assert [(r.kind, r.payload_sha256) for r in step.sent] == [(k, sha256_hex(b)) for k, b in want], i


def _pipeline_run(**changes: Any) -> NetworkDefinition:
    """A 2-stage run of the tiny model, H = 40, k = 4, 8×64 micro-batches, fitted43 between stages."""
    base = small_network(
        training={"batch_size": 8, "seq_len": 64, "segment_steps": 4},
        diloco={"inner_steps": 40, "warmup_steps": 0, "total_steps": 1000},
    )
    return dataclasses.replace(base, **{"num_stages": 2, "pipeline_codec": "fitted43", **changes})


def test_a_round_of_segment_material_is_sized_from_the_run_s_definition() -> None:
    """11 checkpoints of 12 bytes a parameter (⌈40/4⌉ + 1) and, at a stage boundary, the 40 steps'
    payloads in the run's codec, received and sent; a single-stage run has no payloads."""
    run = _pipeline_run()
    model = run.model
    forward, backward = bytes_per_token("fitted43", model.dim)
    for stage in (0, 1):
        params = model.num_params(
            layers=stage_layers(model.n_layers, stage, 2), embedding=stage == 0, head=stage == 1
        )
        payload = 40 * (forward + backward) * 8 * 64
        assert segment_round_bytes(run, stage) == 11 * 12 * params + payload
    lone = dataclasses.replace(run, num_stages=1)
    assert (
        segment_round_bytes(lone, 0) == round_bytes(model.num_params(), 40, 4) == 11 * 12 * model.num_params()
    )


def test_the_segment_store_s_budget_follows_the_run_and_the_disk(tmp_path: Path) -> None:
    """A node keeps --replay-rounds rounds of what its run's rounds take (with a margin), no fixed
    budget; with room for fewer it keeps what fits and says so; with room for none it does not
    start (every challenge would go unanswered) and says what it needs."""
    run = _pipeline_run()
    per_round = int(segment_round_bytes(run, 1) * DISK_MARGIN)
    lines: list[str] = []
    store = segment_store(tmp_path, run, 1, 3, lines.append, free=lambda _: 100 * per_round)
    assert store.config.max_bytes == 3 * per_round and store.config.segment_steps == 4
    assert store.directory == tmp_path / "segments" / run.digest()[:16]
    assert "a round, budget" in lines[-1] and "room for" not in lines[-1]

    # The round being written comes on top of the closed ones the budget keeps.
    store = segment_store(tmp_path, run, 1, 3, lines.append, free=lambda _: 3 * per_round)
    assert store.config.max_bytes == int(3 * per_round * 0.9) - per_round
    assert store.config.max_bytes + per_round <= 0.9 * 3 * per_round
    assert "room for 1 of --replay-rounds 3" in lines[-1], lines[-1]

    with pytest.raises(ValueError, match=r"needs .* of disk a round at stage 1"):
        segment_store(tmp_path, run, 1, 3, lines.append, free=lambda _: 2 * per_round)

    # Nodes sharing one disk (neuroshard-swarm) each count their share of its free space.
    store = segment_store(tmp_path, run, 1, 3, lines.append, free=lambda _: 12 * per_round, share=0.25)
    assert store.config.max_bytes == int(3 * per_round * 0.9) - per_round
    with pytest.raises(ValueError, match=r"\(0.125 of its free space\)"):
        segment_store(tmp_path, run, 1, 3, lines.append, free=lambda _: 12 * per_round, share=0.125)
    with pytest.raises(ValueError, match="disk-share"):
        segment_store(tmp_path, run, 1, 3, lines.append, free=lambda _: 12 * per_round, share=0.0)


def test_the_budget_follows_a_grown_vocabulary(tmp_path: Path) -> None:
    """A round that starts with more parameters (the vocabulary grew) sets the budget for rounds of
    that size from the free space then, so the store keeps --replay-rounds of them, not fewer; a
    disk that cannot hold two of them keeps one and says that older challenges go unanswered."""
    run = _pipeline_run()
    last = run.num_stages - 1  # the head's stage holds vocabulary rows
    params = run.model.num_params(
        layers=stage_layers(run.model.n_layers, last, run.num_stages), embedding=False, head=True
    )
    grown = params + 3 * run.model.vocab_size * run.model.dim  # the vocabulary grown 4x
    space = {"free": 100 * int(segment_round_bytes(run, last, grown) * DISK_MARGIN)}
    lines: list[str] = []
    store = segment_store(tmp_path, run, last, 3, lines.append, free=lambda _: space["free"])
    before = store.config.max_bytes
    store.fit(params)  # the definition's size: the budget it was set for
    assert store.config.max_bytes == before
    store.fit(grown)
    assert store.config.max_bytes == 3 * int(segment_round_bytes(run, last, grown) * DISK_MARGIN) > before
    assert "rounds of" in lines[-1] and "room for" not in lines[-1], lines[-1]
    space["free"] = int(segment_round_bytes(run, last, grown) * DISK_MARGIN)  # the disk filled up meanwhile
    store.fit(params)
    store.fit(grown)
    assert store.config.max_bytes == int(segment_round_bytes(run, last, grown) * DISK_MARGIN)
    assert "one round is kept" in lines[-1], lines[-1]


def test_a_store_trims_what_an_earlier_run_left_before_writing(tmp_path: Path) -> None:
    """Rounds an earlier run kept beyond this run's budget go when the store opens, not after the
    first round, which would be written on top of them."""
    directory = tmp_path / "store"
    for r in range(3):
        heavy = directory / f"round-{r:012d}"
        heavy.mkdir(parents=True)
        (heavy / "ckpt-000000.safetensors").write_bytes(b"x" * 1000)
        (heavy / "log.json").write_text("{}")
    store = SegmentStore(
        directory, SegmentConfig(segment_steps=4, keep_rounds=3, max_bytes=1500), log=lambda _: None
    )
    store.trim()
    left = sorted(p.parent.name for p in directory.rglob("ckpt-*"))
    assert left == [f"round-{2:012d}"]
