"""`neuroshard-swarm --stages 2`: real node processes, two pipeline stages of two replicas each."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.swarm.test_swarm import SwarmProcess

pytestmark = pytest.mark.xdist_group("swarms")  # one swarm at a time (scripts/test)

STAGE_AGREE = re.compile(r"^\[swarm\] stage (\d) round (\d+): (\d+)/(\d+) nodes agree on θ hash [0-9a-f]+$")
LOSS = re.compile(r"^\[(\d+)\] step=(\d+) round=\d+ loss=([0-9.]+)")


def run_two_stages(  # type: ignore[no-untyped-def]
    published, home: Path, *args: str, nodes: int, rounds: int, h: int, timeout: float
) -> tuple[SwarmProcess, str]:
    """A swarm of `nodes` micro-model replicas over two stages (even nodes drive, odd ones hold
    stage 1), run to `rounds` rounds of H = `h`; its output, which must hold no disagreement."""
    swarm = SwarmProcess(
        published, home, "--nodes", str(nodes), "--stages", "2", "--inner-steps", str(h),
        "--max-steps", str(rounds * h), "--round-timeout", "30", *args,
        nodes=nodes,
        node_args=(
            "--model-size", "micro", "--batch-size", "4", "--seq-len", "32",
            "--log-every", str(h), "--inner-lr", "1e-2", "--warmup-steps", "2",
        ),
    )  # fmt: skip
    try:
        assert swarm.finish(timeout=timeout) == 0
    finally:
        swarm.kill()
    text = "\n".join(swarm.lines)
    print(text)  # shown by pytest when an assertion fails
    assert "DIFFER" not in text and "Traceback" not in text
    return swarm, text


@pytest.mark.slow
def test_swarm_with_two_stages_trains_through_the_pipeline_and_each_stage_agrees(
    published, tmp_path: Path
) -> None:
    rounds, h = 6, 10
    swarm, text = run_two_stages(published, tmp_path, nodes=4, rounds=rounds, h=h, timeout=150)
    for i, stage in enumerate((0, 1, 0, 1)):
        assert f"[swarm] node {i}: pid" in text and f"stage {stage}, wallet" in text
    agreed = {
        (int(m[1]), int(m[2])): (int(m[3]), int(m[4])) for m in map(STAGE_AGREE.match, swarm.lines) if m
    }
    for stage in (0, 1):
        for r in range(rounds):
            assert agreed.get((stage, r)) == (2, 2), f"stage {stage} round {r}: {agreed.get((stage, r))}"
    for driver in (0, 2):
        assert f"[{driver}] done at step={rounds * h} round={rounds}" in text
        assert re.search(rf"^\[{driver}\] pipeline: told [12]/[12] stage 1 replica\(s\) this one sends no more$",
                         text, re.M)  # fmt: skip
    # The drivers' signed ends, not a SIGTERM from the launcher, end stage 1.
    assert "SIGTERM" not in text
    for replica in (1, 3):
        assert re.search(
            rf"^\[{replica}\] ending: [12] replica\(s\) of stage 0 sent a signed end", text, re.M
        )
        assert re.search(rf"^\[{replica}\] done at step=\d+ round=\d+ \(stage 1\)", text, re.M)
    # Stage 1 nodes hold the head: the loss they log falls; so does the drivers' (remote) loss.
    for node in (0, 1, 2, 3):
        losses = [float(m[3]) for m in map(LOSS.match, swarm.lines) if m and int(m[1]) == node]
        assert len(losses) >= rounds - 1, f"node {node} logged {losses}"
        assert losses[-1] < losses[0] - 0.3, f"node {node}: loss {losses[0]:.3f} -> {losses[-1]:.3f}"


@pytest.mark.slow
def test_an_allowlist_pipeline_sends_micro_batches_only_between_listed_replicas(
    published, tmp_path: Path
) -> None:
    """Six replicas over two stages, the operator's roster naming nodes 0-4: node 5, a stage-1
    replica off the list, is refused at registration, and no driver offers it a micro-batch (each
    replica reads its neighbours' member lists); the listed ones train and agree as in an open run."""
    rounds, h = 4, 10
    _, text = run_two_stages(
        published,
        tmp_path,
        "--admission",
        "allowlist",
        "--roster",
        "5",
        nodes=6,
        rounds=rounds,
        h=h,
        timeout=240,
    )
    for driver in (0, 2, 4):
        assert re.search(rf"^\[{driver}\] membership: pipeline neighbours of stage 1: 2 admitted, 0 on probation "
                         r"\(allowlist, verifier epoch \d+\); no others$", text, re.M)  # fmt: skip
        assert f"[{driver}] done at step={rounds * h} round={rounds}" in text
    for replica in (1, 3):
        assert re.search(
            rf"^\[{replica}\] membership: pipeline neighbours of stage 0: 3 admitted", text, re.M
        )
    # Node 5 trained on nothing: it never logs a step.
    assert not re.search(r"^\[5\] step=", text, re.M) and re.search(r"^\[[13]\] step=", text, re.M)
