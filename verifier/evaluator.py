"""Live measured loss: fetch the majority weights from nodes, check them, evaluate, record.

A background thread (never the API's request path) does, every `poll_s`:

1. **fetch** — once stage 0 has reported rounds at least `every_rounds` past the last
   measured (or fetched) state, ask the live replicas of every stage, best reputation first,
   for their status and then their state over the peer plane (GET /p2p/status, GET
   /p2p/state, signed with the operator wallet like any peer request; safetensors, never
   pickle). Each stage's θ bytes are checked against the hash in its node's signed status,
   and the per-stage pairs (round R_s, hash h_s) are kept pending together. A node serves the
   state it holds *now*, so the verifier takes whatever round each stage is at. A stage whose
   vocabulary grew with the tokenizer (node.vocab) is fetched, built and measured at the
   vocabulary its θ holds (verifier.stageshape).
2. **judge** — a pending model counts only once, for every stage s, round R_s−1 of s is
   settled (verifier.ledger) and its majority result hash is h_s: each stage's weights are
   then that stage's majority, not one node's word. A model with any minority stage is
   dropped. Then the stages are run in order (stage 0's embedding to the last stage's head)
   and the held-out loss on the held-out shard (network.toml [evaluation] held_out_shard,
   which node shard assignment excludes) is measured (verifier.evaluate) and stored with
   `ledger.record_evaluation` under stage 0's round.
3. **keep** — the measured model, stages assembled, is written as a round file under
   `models_dir` (node.model_file.save_round_model: safetensors, atomic, the newest `keep_models`
   kept), which `neuroshard-export --checkpoint ROUND` turns into a Hugging Face folder; and
   every `sample_every` evaluations a short text it generates from a fixed prompt is stored
   (`text_samples`) for the dashboard.

Pipeline runs: rounds are per stage and the stages' round counters need not move together,
so the measured model is "each stage's latest settled majority", the model the network
would hand a newcomer now. With one stage this is plain DiLoCo's majority θ.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session
from torch import Tensor, nn

from neuroshard.node.codec import decode_state, state_size_bound
from neuroshard.node.diloco import copy_into_parameters, tensor_digest
from neuroshard.node.generate import SamplingConfig, sample_text
from neuroshard.node.model import ModelConfig, Transformer, build_stage
from neuroshard.node.model_file import MODELS_DIR, StageProvenance, save_round_model
from neuroshard.node.vocab import holds_vocab
from neuroshard.protocol.peer import STATE, STATE_HEADER, StateInfo
from neuroshard.protocol.refusal import Refused
from neuroshard.tokenizer import BPETokenizer

from . import ledger
from . import models as m
from .background import JobContext, PollingThread, open_run_dataset, signed_get
from .datacheck import DataCheckConfig, DataChecker
from .evaluate import LossMeasurement, measure_loss, stage_hash
from .network import NetworkDefinition
from .stageshape import largest_numel, stage_config

Log = Callable[[str], None]


@dataclass(kw_only=True)
class EvaluatorConfig:
    poll_s: float = 2.0
    """Seconds between looks at the database for new rounds and settled ones."""
    max_batches: int = 16
    """Held-out batches (of the network's batch_size × seq_len) per measurement: 16 × 8 × 128 =
    16k tokens by default, ~0.5 s for the tiny model on one CPU thread."""
    timeout_s: float = 120.0
    """Whole-request limit for one state download."""
    max_pending: int = 4
    """Fetched states waiting for their round to settle; the oldest is dropped beyond."""
    cache_dir: Path | None = None
    """Shard cache when the data set is served over HTTP."""
    data_checks: DataCheckConfig | None = field(default_factory=DataCheckConfig)
    """Check the data spans of a sample of receipts on the same thread (verifier.datacheck); None: don't."""
    models_dir: Path | None = None
    """Where the measured majority models are kept as round files, stages assembled, for
    `neuroshard-export --checkpoint ROUND` (the CLI gives HOME/models/RUN, `models_dir_for`);
    None: keep none."""
    keep_models: int = 3
    """Round files kept, the newest: each is the whole model in fp32 (4 bytes a parameter,
    ~0.5 GB for a 125M-parameter model)."""
    sample_every: int = 5
    """Generate and store a text sample every this many evaluations (the first one included);
    0: never. 40 tokens take 0.4 s of one thread with the tiny model and 2.9 s with 125m
    (measured, no KV cache), so about 30 s with 1b by parameter count."""
    sample_prompt: str = "The "
    """The fixed prompt every sample continues, so samples differ only by the weights."""
    sampling: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(
            max_new_tokens=40, temperature=0.8, top_k=50, top_p=0.95, seed=0
        )
    )
    """Seeded, so the same weights always give the same sample."""

    def __post_init__(self) -> None:
        if self.poll_s <= 0 or self.max_batches < 1 or self.timeout_s <= 0 or self.max_pending < 1:
            raise ValueError(f"EvaluatorConfig: periods must be > 0 and counts ≥ 1, got {self}")
        if self.keep_models < 1 or self.sample_every < 0:
            raise ValueError(
                f"EvaluatorConfig: keep_models must be ≥ 1 (got {self.keep_models}) and sample_every "
                f"≥ 0 (got {self.sample_every})"
            )
        if self.sample_every and not self.sample_prompt:
            raise ValueError("EvaluatorConfig: sample_prompt must not be empty")


def models_dir_for(home: Path, network: NetworkDefinition) -> Path:
    """HOME/models/RUN: one directory of round files per run definition (as the embedded
    verifier keeps one database per definition), so two runs' rounds never mix."""
    return home / MODELS_DIR / hashlib.sha256(network.canonical_bytes()).hexdigest()[:12]


@dataclass(frozen=True)
class Fetched:
    """One stage's θ_round from one replica, matching the hash in its signed state header."""

    stage: int
    round: int
    theta_hash: str
    theta: Tensor
    wallet_id: str


Model = tuple[Fetched, ...]
"""Every stage's fetched θ, stage 0 first."""


def load_held_out(
    network: NetworkDefinition, cache_dir: Path | None, log: Log
) -> tuple[Tensor, BPETokenizer]:
    """The held-out shard's tokens and the run's tokenizer, verified against the publisher-signed
    manifest."""
    dataset = open_run_dataset(network, cache_dir, log, needed_by="the evaluator needs")
    try:
        shard = network.held_out_shard
        if shard >= dataset.manifest.total_shards:
            raise ValueError(
                f"held-out shard {shard} is not in the manifest ({dataset.manifest.total_shards} shards)"
            )
        return dataset.source.fetch(dataset.manifest.shard(shard)), dataset.tokenizer
    finally:
        dataset.source.close()


class Evaluator:
    """The verifier's own measurements of the majority model, on a background thread."""

    def __init__(
        self,
        ctx: JobContext,
        *,
        config: EvaluatorConfig | None = None,
        held_out: Callable[[], Tensor] | None = None,
        tokenizer: Callable[[], BPETokenizer] | None = None,
        peer_ttl_s: float = 90.0,
    ) -> None:
        """`held_out`, `tokenizer`: loaders in place of the run's data set (tests). `peer_ttl_s`:
        a replica is asked for its state while its last heartbeat is younger than this."""
        self.config = config or EvaluatorConfig()
        self.ctx = ctx
        self._peer_ttl_s = peer_ttl_s
        self._held_out: Tensor | None = None
        self._tokenizer: BPETokenizer | None = None
        self._newest_kept = 0
        """The newest round this process kept a file of; an older one is not kept after it."""
        self._load_held_out = held_out or (lambda: self._load_data()[0])
        self._load_tokenizer = tokenizer or (lambda: self._load_data()[1])
        network = ctx.network
        self._largest = [
            largest_numel(network.model, s, network.num_stages) for s in range(network.num_stages)
        ]
        """The most values a stage's θ may hold (at the largest grown vocabulary, verifier.stageshape)."""
        self.pending: dict[int, Model] = {}
        """Fetched models waiting for their rounds to settle, by stage 0's round."""
        self.last_fetched = -1
        self.measured: list[tuple[int, LossMeasurement]] = []
        self._loop = PollingThread("evaluator", self.run_once, self.config.poll_s, ctx.log, "evaluator")
        checks = self.config.data_checks
        self.checker = None if checks is None else DataChecker(ctx, config=checks)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop(self.config.timeout_s)

    # --- one pass -----------------------------------------------------------------------------

    def run_once(self) -> None:
        try:
            self._maybe_fetch()
            self._judge_pending()
        finally:
            if self.checker is not None:
                self.checker.run_once()

    def _maybe_fetch(self) -> None:
        every = self.ctx.network.evaluate_every_rounds
        with self.ctx.db.read() as session:
            latest = session.scalar(select(func.max(m.HashVote.round)).where(m.HashVote.stage == 0))
            measured = session.scalar(select(func.max(m.Evaluation.round)))
            peers = [self._live_replicas(session, s) for s in range(self.ctx.network.num_stages)]
        if latest is None:
            return  # no receipt yet: no round result anyone voted on
        done = max(self.last_fetched, -1 if measured is None else measured)
        if done >= 0 and latest + 1 < done + every:
            return
        model = []
        for stage, replicas in enumerate(peers):
            fetched = self._fetch_stage(stage, replicas, after=done if stage == 0 else 0)
            if fetched is None:
                return  # a stage with no usable replica now: try again next pass
            model.append(fetched)
        round_ = model[0].round
        self.pending[round_] = tuple(model)
        self.last_fetched = round_
        while len(self.pending) > self.config.max_pending:
            dropped = min(self.pending)
            del self.pending[dropped]
            self.ctx.log(f"evaluator: round {dropped} never settled; dropped its fetched state")

    def _live_replicas(self, session: Session, stage: int) -> list[tuple[str, str]]:
        """(address, wallet id) of the stage's live, active replicas, best reputation first."""
        rows = session.execute(
            select(m.Peer.address, m.Wallet.wallet_id)
            .join(m.Wallet, m.Wallet.wallet_id == m.Peer.wallet_id)
            .where(
                m.Peer.stage == stage,
                m.Wallet.status == m.STATUS_ACTIVE,
                m.Peer.last_heartbeat >= self.ctx.clock() - self._peer_ttl_s,
            )
            .order_by(m.Wallet.reputation.desc(), m.Wallet.wallet_id)
        ).all()
        return [(address, wallet_id) for address, wallet_id in rows]

    def _fetch_stage(self, stage: int, replicas: list[tuple[str, str]], *, after: int) -> Fetched | None:
        """The first replica's θ whose round is past `after` (and ≥ 1: round 0 has no vote to check)."""
        for address, wallet_id in replicas:
            fetched = self.fetch_state(address, wallet_id, stage)
            if fetched is not None and fetched.round >= 1 and fetched.round > after:
                return fetched
        return None

    def _majority(self, stage: int, round_: int) -> str | None:
        with self.ctx.db.read() as session:
            settled = session.get(m.Round, (stage, round_))
            return None if settled is None else settled.majority_hash

    def _judge_pending(self) -> None:
        for round_ in sorted(self.pending):
            model = self.pending[round_]
            majorities = [self._majority(f.stage, f.round - 1) for f in model]
            if any(h is None for h in majorities):
                continue  # some stage's round R_s−1 is not settled yet: wait
            del self.pending[round_]
            minority = [(f, h) for f, h in zip(model, majorities, strict=True) if f.theta_hash != h]
            if minority:
                for f, h in minority:
                    self.ctx.log(
                        f"evaluator: stage {f.stage} θ_{f.round} from {f.wallet_id} ({f.theta_hash[:16]}) is not "
                        f"the majority ({(h or '')[:16]}); not measured"
                    )
                continue
            stages = self.build(model)
            result = self.measure(stages)
            with self.ctx.db.write() as session:
                ledger.record_evaluation(
                    session, round_, result.loss, result.tokens, stderr=result.stderr, now=self.ctx.clock()
                )
            self.measured.append((round_, result))
            rounds = ", ".join(f"stage {f.stage} θ_{f.round} {f.theta_hash[:16]}" for f in model)
            self.ctx.log(
                f"evaluator: round {round_} held-out loss {result.loss:.4f} "
                f"(± {result.stderr or 0.0:.4f}, {result.tokens} tokens) on the majority model ({rounds})"
            )
            self._keep(round_, model, stages)

    def build(self, model: Model) -> list[Transformer]:
        """Every stage loaded with its fetched θ and re-hashed, stage 0 first; each at the
        vocabulary its θ holds (grown with the tokenizer, or the definition's)."""
        network = self.ctx.network
        stages = []
        for fetched in model:
            config = stage_config(network.model, fetched.stage, network.num_stages, fetched.theta.numel())
            stage = build_stage(config, fetched.stage, network.num_stages)
            copy_into_parameters(fetched.theta, stage.parameters())
            if stage_hash(stage) != fetched.theta_hash:
                raise ValueError(
                    f"stage {fetched.stage} θ_{fetched.round} does not hash to {fetched.theta_hash[:16]} once loaded"
                )
            stages.append(stage)
        return stages

    def measure(self, stages: list[Transformer]) -> LossMeasurement:
        """The held-out loss of the stages run in order."""
        if self._held_out is None:
            self._held_out = self._load_held_out()
        return measure_loss(
            stages,
            self._held_out,
            self.ctx.network.batch_size,
            self.ctx.network.seq_len,
            max_batches=self.config.max_batches,
        )

    # --- what a measured model leaves behind: its round file and, now and then, a sample ------

    def _load_data(self) -> tuple[Tensor, BPETokenizer]:
        if self._held_out is None or self._tokenizer is None:
            self._held_out, self._tokenizer = load_held_out(
                self.ctx.network, self.config.cache_dir, self.ctx.log
            )
        return self._held_out, self._tokenizer

    def tokenizer(self) -> BPETokenizer:
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def _keep(self, round_: int, model: Model, stages: list[Transformer]) -> None:
        """The round file and the sample, each on its own: a failure is logged, the measurement stays."""
        if self.config.models_dir is not None and round_ < self._newest_kept:
            # Pipeline stages settle out of order: a round judged after a later one is measured
            # but not kept, since a round file past the one written counts as an earlier run's.
            self.ctx.log(f"evaluator: round {round_} judged after round {self._newest_kept}: not kept")
        elif self.config.models_dir is not None:
            self._newest_kept = round_
            provenance = [StageProvenance(f.stage, f.round, f.theta_hash) for f in model]
            try:
                path = save_round_model(
                    self.config.models_dir,
                    round_,
                    self.assembled_config(stages),
                    stages,
                    provenance,
                    self.tokenizer(),
                    keep=self.config.keep_models,
                )
                self.ctx.log(f"evaluator: round {round_}'s majority model kept as {path}")
            except (OSError, ValueError) as exc:
                self.ctx.log(f"evaluator: round {round_}'s majority model not kept: {exc}")
        try:
            if self._sample_due():
                self.store_sample(round_, stages)
        except (OSError, ValueError) as exc:
            self.ctx.log(f"evaluator: round {round_}: no text sample: {exc}")

    def assembled_config(self, stages: list[Transformer]) -> ModelConfig:
        """The config of the whole model the stages make, at their vocabulary. A model file holds
        one: while the head has grown and the embedding not yet (the verifier grows the last stage
        first), the stages make no whole model and ValueError says so (the round is not kept)."""
        vocabs = {st.config.vocab_size for s, st in enumerate(stages) if holds_vocab(s, len(stages))}
        if len(vocabs) != 1:
            raise ValueError(
                f"its embedding and head hold vocabularies {sorted(vocabs)}; a model file holds one"
            )
        return dataclasses.replace(self.ctx.network.model, vocab_size=vocabs.pop())

    def _sample_due(self) -> bool:
        """True for the first evaluation and then once `sample_every` more were recorded since
        the last sample (counted in the database, so a restart or another worker keeps the pace)."""
        every = self.config.sample_every
        if every == 0:
            return False
        with self.ctx.db.read() as session:
            last = session.scalar(select(func.max(m.TextSample.round)))
            since = select(func.count()).select_from(m.Evaluation)
            if last is not None:
                since = since.where(m.Evaluation.round > last)
            return last is None or (session.scalar(since) or 0) >= every

    def store_sample(self, round_: int, stages: list[Transformer]) -> str:
        """Continue the fixed prompt with the measured model (node.generate) and store the text.

        Only ids below the embedding's rows, the head's and the tokenizer's vocabulary are drawn
        (`FirstLogits`): a model may hold more rows than the tokenizer the verifier loaded spells
        (a definition's padded vocabulary, or rows grown for a tokenizer published since), and
        during a growth the head holds more than the embedding can take back. ValueError (no
        sample) when the prompt itself needs an id past them."""
        tokenizer = self.tokenizer()
        cfg = self.config.sampling
        usable = min(stages[0].config.vocab_size, stages[-1].config.vocab_size, tokenizer.vocab_size)
        if max(tokenizer.encode(self.config.sample_prompt), default=0) >= usable:
            raise ValueError(f"the prompt encodes to an id past the {usable} the model and tokenizer share")
        text = sample_text(
            nn.Sequential(*stages, FirstLogits(usable)), tokenizer, self.config.sample_prompt, cfg,
            max_seq_len=self.ctx.network.model.max_seq_len,
        )  # fmt: skip
        # Byte tokens can spell NUL, which PostgreSQL's text type refuses.
        text = text.replace("\x00", "\N{REPLACEMENT CHARACTER}")
        with self.ctx.db.write() as session:
            session.merge(
                m.TextSample(
                    round=round_,
                    prompt=self.config.sample_prompt,
                    text=text,
                    max_new_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature,
                    seed=cfg.seed,
                    created_at=self.ctx.clock(),
                )
            )
        self.ctx.log(f"evaluator: round {round_} sample: {self.config.sample_prompt!r} → {text[:60]!r}…")
        return text

    # --- the peer plane, as a client ----------------------------------------------------------

    def _get(self, address: str, path: str, max_bytes: int) -> tuple[bytes, Message] | None:
        try:
            return signed_get(
                self.ctx.operator,
                address,
                path,
                max_bytes=max_bytes,
                timeout_s=self.config.timeout_s,
                now=self.ctx.clock(),
            )
        except (OSError, ValueError) as exc:  # BodyTooLarge included: ignored like no answer
            self.ctx.log(f"evaluator: {address}{path}: {exc}")
            return None

    def fetch_state(self, address: str, wallet_id: str, stage: int = 0) -> Fetched | None:
        """The node's current θ_round of `stage`, checked against the hash in its signed state header."""
        network = self.ctx.network
        got = self._get(address, STATE, state_size_bound(self._largest[stage]))
        if got is None:
            return None
        body, headers = got
        try:
            info = StateInfo.from_json(headers.get(STATE_HEADER, ""))
        except Refused as exc:
            self.ctx.log(f"evaluator: state header from {wallet_id}: {exc}")
            return None
        if not info.signature_valid() or info.stage != stage:
            self.ctx.log(
                f"evaluator: state of {wallet_id} refused (bad signature, or stage {info.stage} for {stage})"
            )
            return None
        try:  # the definition's length, or the stage's grown with the tokenizer (node.vocab)
            stage_config(network.model, stage, network.num_stages, info.numel)
        except ValueError as exc:
            self.ctx.log(f"evaluator: state of {wallet_id} refused: {exc}")
            return None
        try:
            theta, _ = decode_state(body, info.numel, with_momentum=bool(info.momentum_hash))
        except (Refused, ValueError) as exc:
            self.ctx.log(f"evaluator: state body from {wallet_id}: {exc}")
            return None
        if tensor_digest(theta) != info.theta_hash:
            self.ctx.log(f"evaluator: state of {wallet_id} does not match its hash; refused")
            return None
        return Fetched(
            stage=stage, round=info.round, theta_hash=info.theta_hash, theta=theta, wallet_id=wallet_id
        )


class FirstLogits(nn.Module):
    """Keeps the first `n` logits of the model before it: (..., V) -> (..., n)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, logits: Tensor) -> Tensor:
        return logits[..., : self.n]
