"""Spot checks (proof of work): re-run a replica's claimed inner steps and compare the Δ.

A receipt says which data a replica read (shard ids and window offsets, a pure function of
its wallet id and the manifest: data.assign_shards, data.shards.window_order) and
commits to its pseudo-gradient Δ (`delta_digest`). The verifier starts from θ_round (the
previous round's majority weights), runs the same inner steps on the same batches with the
run's DiLoCo configuration, and compares its Δ with the replica's: a replica that lied about
Δ, or trained on data other than what it claims (and was assigned), fails.

What replay can and cannot check:

- Single-stage runs (plain DiLoCo data parallelism): the whole inner computation is local,
  so it can be replayed. It is exact (cosine 1) when the replay also starts from the
  replica's inner optimizer state: DiLoCo keeps the AdamW moments across rounds, so the
  replica commits to them in its receipt (`inner_state_digest`) and serves them when asked
  (node.replay, node.p2p.replay; verifier.replaycheck does this live). Across machines,
  float reduction order differs slightly; the tolerances below absorb that, not a different
  batch.
- Pipeline stages: a stage's gradients depend on activations and gradients from the other
  stages' replicas, so one stage cannot be replayed alone. What can be checked there is the
  data assignment (stage 0's spans, `check_data_spans`), hash agreement and contribution
  validity (verifier.reputation).

"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from neuroshard.data import BatchStream, DataPosition, Manifest, ShardSource
from neuroshard.node.device import Placement
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig, copy_into_parameters
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.replay import InnerState, install_inner_state
from neuroshard.protocol.reports import DataSpan

from .stageshape import stage_config


class SpotCheckError(ValueError):
    """A claim that cannot even be replayed (inconsistent spans, wrong shapes)."""


@dataclass(kw_only=True)
class SpotCheckConfig:
    min_cosine: float = 0.99
    """Measured on a 2-layer test model, 4 inner steps (tests/verifier/test_spotcheck.py): an honest
    replay gives cosine 1 − 1e-13 at 1 and at 2 threads; the same steps on another shard 0.78;
    a replay without the replica's AdamW moments 0.66. Larger models and other CPUs or GPUs may
    sit further from 1; measure before tightening or loosening."""
    norm_tolerance: float = 0.05
    """|‖claimed‖ / ‖replayed‖ − 1| allowed: catches a right direction with a scaled size."""


@dataclass(frozen=True)
class SpotCheckResult:
    ok: bool
    cosine: float
    norm_ratio: float
    """‖claimed‖ / ‖replayed‖."""
    reason: str


def check_data_spans(
    order: Sequence[int], spans: Sequence[DataSpan], *, batch_size: int, inner_steps: int
) -> list[str]:
    """Problems with a receipt's data claim, without replaying anything (empty when fine).

    The spans must cover exactly inner_steps·batch_size windows, each a whole number of
    batches, and each next shard must be the one after the previous in the wallet's order
    (assign_shards), so a replica cannot pick the shards it likes.
    """
    problems: list[str] = []
    total = 0
    position = {shard: i for i, shard in enumerate(order)}
    for k, span in enumerate(spans):
        width = span.offset_end - span.offset_start
        total += width
        if width % batch_size:
            problems.append(
                f"span {k} (shard {span.shard_id}) holds {width} windows, not whole batches of {batch_size}"
            )
        if span.shard_id not in position:
            problems.append(f"span {k}: shard {span.shard_id} is not in the manifest")
            continue
        if k > 0 and spans[k - 1].shard_id in position:
            expected = order[(position[spans[k - 1].shard_id] + 1) % len(order)]
            if span.shard_id != expected:
                problems.append(
                    f"span {k}: shard {span.shard_id} does not follow shard {spans[k - 1].shard_id} "
                    f"in this wallet's order (expected {expected})"
                )
    if total != inner_steps * batch_size:
        problems.append(
            f"spans hold {total} windows; {inner_steps} inner steps of {batch_size} need {inner_steps * batch_size}"
        )
    return problems


def claimed_batches(
    *,
    source: ShardSource,
    manifest: Manifest,
    wallet_id: str,
    spans: Iterable[DataSpan],
    batch_size: int,
    seq_len: int,
) -> list[tuple[Tensor, Tensor]]:
    """The (inputs, labels) batches the spans name, read exactly as the node's BatchStream reads them."""
    out: list[tuple[Tensor, Tensor]] = []
    for span in spans:
        stream = BatchStream(
            source=source,
            manifest=manifest,
            order=[span.shard_id],
            seed=wallet_id,
            batch_size=batch_size,
            seq_len=seq_len,
            position=DataPosition(order_index=0, offset=span.offset_start),
            prefetch=0,
        )
        while stream.position.offset < span.offset_end:
            before = stream.position.offset
            out.append(stream.next_batch())
            if stream.position.offset != before + batch_size:
                raise SpotCheckError(
                    f"span on shard {span.shard_id} ends at window {span.offset_end}, past the shard's last batch"
                )
    return out


def replay_inner_steps(
    model_config: ModelConfig,
    diloco_config: DiLoCoConfig,
    theta_round: Tensor,
    batches: Iterable[tuple[Tensor, Tensor]],
    *,
    round_: int = 0,
    inner_state: InnerState | None = None,
    placement: Placement | None = None,
) -> Tensor:
    """Δ = θ_round − θ_local after one inner step per batch, from θ_round, single-stage model
    (`model_config` at the vocabulary θ_round holds: the definition's, or grown).

    `round_` puts the learning-rate schedule where the replica's was (it is a function of the
    round: DiLoCo.schedule_step); with the replica's `inner_state` (AdamW moments at the
    round's start) the replay is exact. `placement`: where and in what precision to replay
    (default: CPU fp32, the verifier's; a replay matching the receipt's precision lands closer).
    """
    if theta_round.ndim != 1:
        raise SpotCheckError(f"θ_round has shape {tuple(theta_round.shape)}, the model needs a flat vector")
    try:  # the vocabulary θ holds: the definition's, or grown with the tokenizer (node.vocab)
        model_config = stage_config(model_config, 0, 1, theta_round.numel())
    except ValueError as exc:
        raise SpotCheckError(f"θ_round has shape {tuple(theta_round.shape)}: {exc}") from None
    model = build_stage(model_config, 0, 1)
    copy_into_parameters(theta_round.float(), model.parameters())
    diloco = DiLoCo(model, diloco_config, placement=placement)
    diloco.round = round_
    if inner_state is not None:
        try:
            install_inner_state(diloco, inner_state)
        except ValueError as exc:
            raise SpotCheckError(str(exc)) from None
    for inputs, labels in batches:
        diloco.inner_step(inputs, labels)
    return diloco.pseudo_gradient()


def compare_deltas(claimed: Tensor, replayed: Tensor, cfg: SpotCheckConfig | None = None) -> SpotCheckResult:
    cfg = cfg or SpotCheckConfig()
    if claimed.shape != replayed.shape:
        return SpotCheckResult(
            ok=False,
            cosine=0.0,
            norm_ratio=0.0,
            reason=f"claimed Δ has shape {tuple(claimed.shape)}, the replay {tuple(replayed.shape)}",
        )
    a, b = claimed.double(), replayed.double()
    if not bool(torch.isfinite(a).all()):
        return SpotCheckResult(ok=False, cosine=0.0, norm_ratio=0.0, reason="claimed Δ has non-finite values")
    na, nb = float(a.norm()), float(b.norm())
    if nb == 0.0:
        ok = na == 0.0
        return SpotCheckResult(
            ok=ok,
            cosine=1.0 if ok else 0.0,
            norm_ratio=1.0 if ok else float("inf"),
            reason="replayed Δ is zero" + ("" if ok else "; claimed is not"),
        )
    cosine = float(a @ b) / (na * nb) if na > 0 else 0.0
    ratio = na / nb
    problems = []
    if cosine < cfg.min_cosine:
        problems.append(f"cosine {cosine:.4f} < {cfg.min_cosine}")
    if abs(ratio - 1.0) > cfg.norm_tolerance:
        problems.append(f"norm ratio {ratio:.4f} outside 1 ± {cfg.norm_tolerance}")
    reason = "; ".join(problems) if problems else f"cosine {cosine:.6f}, norm ratio {ratio:.4f}"
    return SpotCheckResult(ok=not problems, cosine=cosine, norm_ratio=ratio, reason=reason)
