"""End to end on loopback: `neuroshard-swarm` starts a real verifier process and three real
`neuroshard-node` processes that join it; the verifier's own measurements turn
`training_verified` true while the nodes train, and receipts and agreeing hashes are stored
(SQLite, and PostgreSQL when NEUROSHARD_TEST_DATABASE_URL is set).

`test_attacker_is_refused_while_the_honest_swarm_is_verified` adds a fourth node that sends
sign-flipped pseudo-gradients (`neuroshard-swarm --byzantine 1 --attack sign_flip`): the
honest replicas reject it every round and say so in their receipts, so its reputation falls
until the verifier refuses it, while the honest nodes keep agreeing and get verified.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import PublishedData
from sqlalchemy import func, select

from neuroshard.testing.ports import free_port_block
from neuroshard.verifier import models as m
from neuroshard.verifier.db import Database

pytestmark = pytest.mark.xdist_group("swarms")  # one swarm at a time (scripts/test)

SWARM = str(Path(sys.executable).parent / "neuroshard-swarm")
NODES = 3
VERIFY_TIMEOUT_S = 150.0


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())


def _node_ports_avoiding(port: int, nodes: int = NODES + 1) -> int:
    """A base port whose node ports do not include `port` (the verifier's, an ephemeral one)."""
    while (base := free_port_block(nodes)) <= port < base + nodes:
        pass
    return base


def _start_swarm(
    published: PublishedData,
    home: Path,
    database_url: str,
    verifier_port: int,
    *swarm_args: str,
    nodes: int = NODES,
    node_args: tuple[str, ...] = (),
) -> subprocess.Popen[str]:
    argv = [
        SWARM,
        "--nodes", str(nodes),
        "--home", str(home),
        "--data", str(published.directory),
        "--publisher-key", published.public_key_hex,
        "--inner-steps", "10",
        "--max-steps", "100000",  # stopped by the test once verified
        "--base-port", str(_node_ports_avoiding(verifier_port)),
        "--verifier-port", str(verifier_port),
        "--verifier-db", database_url,
        "--threads", "1",
        *swarm_args,
        "--", "--model-size", "micro", "--seq-len", "32", "--batch-size", "8", "--log-every", "50",
        *node_args,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "NEUROSHARD_TOKEN"}
    with (home / "swarm.out").open("w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )


def _wait_for(
    what: str,
    read: Callable[[], dict[str, Any]],
    done: Callable[[dict[str, Any]], bool],
    swarm: subprocess.Popen[str],
    out: Path,
) -> dict[str, Any]:
    """Poll the verifier with `read` every second until `done`, the swarm dies, or the timeout."""
    deadline = time.monotonic() + VERIFY_TIMEOUT_S
    value: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if swarm.poll() is not None:
            raise AssertionError(f"swarm exited with {swarm.returncode}:\n{out.read_text()[-4000:]}")
        try:
            value = read()
        except OSError:
            value = {}
        if done(value):
            return value
        time.sleep(1.0)
    raise AssertionError(f"{what} not within {VERIFY_TIMEOUT_S:.0f} s: {value}\n{out.read_text()[-4000:]}")


def _failure_report(out: str) -> str:
    """The swarm's last lines, and every non-step line of the nodes it says failed (their own error
    is otherwise cut off by the others' progress lines)."""
    failed = re.findall(r"nodes \[([0-9, ]+)\] failed", out)
    nodes = {n.strip() for group in failed for n in group.split(",")}
    own = [line for line in out.splitlines() if any(line.startswith(f"[{n}] ") for n in nodes)]
    own = [line for line in own if " step=" not in line and "] step=" not in line]
    return "\n".join([*own[-80:], "--- last lines ---", out[-3000:]])


def _wait_verified(url: str, swarm: subprocess.Popen[str], out: Path) -> dict[str, Any]:
    return _wait_for(
        "verified", lambda: _get(f"{url}/api/training/verify"),
        lambda v: bool(v.get("training_verified")), swarm, out,
    )  # fmt: skip


@pytest.mark.slow
def test_honest_swarm_is_verified_by_measurement(
    published: PublishedData, database_url: str, tmp_path: Path
) -> None:
    port = free_port_block(1)
    url = f"http://127.0.0.1:{port}"
    swarm = _start_swarm(published, tmp_path, database_url, port)
    try:
        verdict = _wait_verified(url, swarm, tmp_path / "swarm.out")
        nodes = _get(f"{url}/api/nodes")
        history = _get(f"{url}/api/training/history")
    finally:
        swarm.send_signal(signal.SIGINT)
        code = swarm.wait(timeout=60)
    out = (tmp_path / "swarm.out").read_text()
    assert code == 0, _failure_report(out)

    # The verdict comes from the verifier's own held-out measurements, which fell.
    assert verdict["evaluations"] >= 3 and verdict["loss_drop"] > verdict["required_drop"] > 0
    assert verdict["global_loss"] < verdict["initial_loss"]
    assert verdict["hash_agreement_rate"] == 1.0 and verdict["active_nodes"] == NODES
    assert len(nodes) == NODES and all(n["status"] == "active" for n in nodes), nodes
    assert all(n["reputation"] >= 0.5 for n in nodes), nodes  # honest nodes never lose reputation
    assert history["evaluations"], history

    db = Database(database_url)
    try:
        with db.read() as s:
            receipts = s.scalar(select(func.count()).select_from(m.Receipt)) or 0
            per_wallet = dict(
                s.execute(select(m.Receipt.wallet_id, func.count()).group_by(m.Receipt.wallet_id)).all()
            )
            settled = s.scalars(select(m.Round).where(m.Round.stage == 0)).all()
            evaluations = s.scalars(select(m.Evaluation).order_by(m.Evaluation.round)).all()
            # Every receipt names the data it read and the majority it voted for.
            spans = s.scalars(select(m.Receipt.data_spans)).all()
    finally:
        db.dispose()
    assert set(per_wallet) == {n["wallet_id"] for n in nodes} and min(per_wallet.values()) >= 3
    assert receipts == sum(per_wallet.values())
    # The honest nodes' hashes agree in every settled round (the round cut short by the SIGINT
    # that ends the test never settles: no later receipts). A round can settle on two votes
    # while the third node is still registering; the late vote is then judged alone.
    votes = [(r.round, r.votes, r.agreeing) for r in settled]
    assert len(settled) >= 3 and all(r.agreeing == r.votes >= 2 for r in settled), votes
    # A round settles once most replicas reported a later one (ledger.settle_rounds): with rounds
    # of a second on a loaded machine, the slowest node's receipt sometimes comes after that and
    # is judged alone (reputations above show it was judged honest). Most rounds have every vote.
    # The share judged alone rose from ~2% to 8-27% of rounds in the CI runs of 2026-11-25
    # (not explained yet: see that day's closing note); this bound keeps it from growing unseen.
    assert sum(r.votes == NODES for r in settled) >= 0.6 * len(settled), votes
    # Every measured round's majority hash is one all three nodes voted for.
    assert {e.round for e in evaluations} <= {r.round + 1 for r in settled}
    # No node trained on the held-out shard (0): it is excluded from every assignment.
    assert all(span[0] != 0 for spans_of_receipt in spans for span in spans_of_receipt)
    before_stop = out[: out.index("[swarm] SIGINT")]
    assert "[swarm] verifier http://127.0.0.1:" in before_stop and "DIFFER" not in before_stop


def _wait_refused(url: str, wallet_id: str, swarm: subprocess.Popen[str], out: Path) -> dict[str, Any]:
    return _wait_for(
        "attacker refused", lambda: _get(f"{url}/api/nodes/{wallet_id}")["node"],
        lambda n: n.get("status") == "refused", swarm, out,
    )  # fmt: skip


def _attacker_wallet(out: str) -> str:
    line = next(x for x in out.splitlines() if x.startswith(f"[swarm] node {NODES}:") and "ATTACKER" in x)
    return line.split("wallet ")[1].split(",")[0].strip()


@pytest.mark.slow
def test_attacker_is_refused_while_the_honest_swarm_is_verified(
    published: PublishedData, database_url: str, tmp_path: Path
) -> None:
    port = free_port_block(1)
    url = f"http://127.0.0.1:{port}"
    out_path = tmp_path / "swarm.out"
    swarm = _start_swarm(
        published,
        tmp_path,
        database_url,
        port,
        "--byzantine", "1", "--attack", "sign_flip",
        nodes=NODES + 1,
        # All four start in the same warm-up, and the first round waits for the others.
        node_args=("--min-peers", str(NODES)),
    )  # fmt: skip
    try:
        verdict = _wait_verified(url, swarm, out_path)
        attacker = _attacker_wallet(out_path.read_text())
        refused = _wait_refused(url, attacker, swarm, out_path)
        nodes = _get(f"{url}/api/nodes")
    finally:
        swarm.send_signal(signal.SIGINT)
        code = swarm.wait(timeout=60)
    out = out_path.read_text()
    assert code == 0, _failure_report(out)

    assert verdict["training_verified"] and verdict["global_loss"] < verdict["initial_loss"]
    # Refused for what the honest majority reported about its contributions, not for its hash:
    # it aggregates the honest set like everyone else and ends each round on the same θ.
    assert refused["reputation"] < 0.2 and "rejected" in (refused["status_reason"] or ""), refused
    honest = [n for n in nodes if n["wallet_id"] != attacker]
    # An honest node refused or marked down here has failed twice (once in CI, with "contribution
    # rejected ... cos(Δ, reference) = -0.78"): say which one and why, with the rounds' log lines.
    standing = "\n".join(
        f"{n['wallet_id']} {n['status']} {n['reputation']:.2f} {n['status_reason']}" for n in honest
    )
    rounds = "\n".join(line for line in out.splitlines() if " step=" not in line)[-6000:]
    assert len(honest) == NODES and all(n["status"] == "active" for n in honest), f"{standing}\n{rounds}"
    assert all(n["reputation"] >= 0.5 for n in honest), f"{standing}\n{rounds}"
    # The swarm compares the honest nodes' θ every round: they never differed.
    before_stop = out[: out.index("[swarm] SIGINT")]
    assert "honest nodes agree on θ hash" in before_stop and "DIFFER" not in before_stop
    # The verifier refuses the attacker's writes from then on, and the attacker's log says so.
    assert f"[{NODES}] tracker: receipt of round" in out and f"wallet {attacker} is refused" in out


@pytest.mark.slow
def test_pipeline_swarm_is_tracked_and_verified_on_the_assembled_model(
    published: PublishedData, database_url: str, tmp_path: Path
) -> None:
    """`neuroshard-swarm --nodes 4 --stages 2`: two stages of two replicas join one verifier,
    which judges hash agreement per stage and measures the model assembled from both stages'
    majority weights; that measured loss falls."""
    port = free_port_block(1)
    url = f"http://127.0.0.1:{port}"
    swarm = _start_swarm(published, tmp_path, database_url, port, "--stages", "2", nodes=4)
    out = tmp_path / "swarm.out"
    try:
        verdict = _wait_verified(url, swarm, out)
        both_settled = _wait_for(
            "per-stage agreement", lambda: _get(f"{url}/api/training/global"),
            lambda g: all(s["hash_agreement_rate"] is not None for s in g.get("stages", [])), swarm, out,
        )  # fmt: skip
        nodes = _get(f"{url}/api/nodes")
    finally:
        swarm.send_signal(signal.SIGINT)
        code = swarm.wait(timeout=60)
    text = out.read_text()
    assert code == 0, _failure_report(text)
    assert verdict["evaluations"] >= 3 and verdict["loss_drop"] > verdict["required_drop"] > 0
    assert verdict["global_loss"] < verdict["initial_loss"]
    assert verdict["active_nodes"] == 4
    stages = both_settled["stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    assert all(s["replicas_alive"] == 2 and s["hash_agreement_rate"] == 1.0 for s in stages), stages
    assert stages[0]["majority_hash"] != stages[1]["majority_hash"]  # different layers, judged apart
    assert sorted(n["stage"] for n in nodes) == [0, 0, 1, 1], nodes

    db = Database(database_url)
    try:
        with db.read() as s:
            by_stage = dict(s.execute(select(m.Receipt.stage, func.count()).group_by(m.Receipt.stage)).all())
            later_spans = s.scalars(select(m.Receipt.data_spans).where(m.Receipt.stage == 1)).all()
            evaluations = s.scalars(select(m.Evaluation)).all()
            data_checks = s.execute(
                select(m.ReputationEvent.stage, m.ReputationEvent.reason).where(
                    m.ReputationEvent.reason.contains("data check")
                )
            ).all()
    finally:
        db.dispose()
    # Both stages send receipts; only stage 0 reads data, and only its data is checked (and holds).
    assert by_stage.get(0, 0) >= 4 and by_stage.get(1, 0) >= 4, by_stage
    assert all(spans == [] for spans in later_spans)
    # A quarter of the receipts are sampled (verifier.sampling); verification takes ~15 rounds of
    # two drivers, so a run with no stage-0 check at all has odds of about 0.75**30.
    assert data_checks and {stage for stage, _ in data_checks} == {0}, data_checks
    assert all("passed" in reason for _, reason in data_checks), data_checks
    assert all(n["reputation"] >= 0.5 for n in nodes), nodes
    assert len(evaluations) >= 3
    assert "evaluator:" in (tmp_path / "swarm" / "verifier" / "verifier.log").read_text()
