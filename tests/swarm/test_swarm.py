"""`neuroshard-swarm` as a user runs it: real node processes on loopback, real signals.

The nodes are the real `neuroshard-node` with the `micro` model, so the rounds, not the
training, dominate the run time.
"""

from __future__ import annotations

import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from neuroshard.testing.ports import free_port_block

pytestmark = pytest.mark.xdist_group("swarms")  # one swarm at a time (scripts/test)

AGREE = re.compile(r"^\[swarm\] round (\d+): (\d+)/(\d+) nodes agree on θ hash [0-9a-f]+$")


MICRO_NODE_ARGS = ("--model-size", "micro", "--batch-size", "2", "--seq-len", "32", "--log-every", "1000")
"""What every node of these swarms is given after `--`: a model small enough that rounds dominate."""


def swarm_command(published, home: Path, *args: str, nodes: int = 3, node_args=MICRO_NODE_ARGS) -> list[str]:  # type: ignore[no-untyped-def]
    """`neuroshard-swarm` on loopback with free ports: nodes take base+i, the verifier base+nodes."""
    base = free_base_port(nodes + 1)
    return [
        sys.executable, "-m", "neuroshard.swarm.cli",
        "--home", str(home),
        "--data", str(published.directory),
        "--publisher-key", published.public_key_hex,
        "--base-port", str(base),
        "--verifier-port", str(base + nodes),
        "--threads", "1",
        *args,
        "--", *node_args,
    ]  # fmt: skip


class SwarmProcess:
    def __init__(self, published, home: Path, *args: str, nodes: int = 3, node_args=MICRO_NODE_ARGS) -> None:  # type: ignore[no-untyped-def]
        """`args` go to the swarm and must include `--nodes N` with N ≤ `nodes` (ports are kept for `nodes`)."""
        command = swarm_command(published, home, *args, nodes=nodes, node_args=node_args)
        env = {k: v for k, v in os.environ.items() if k != "NEUROSHARD_TOKEN"}
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        with self.process.stdout:
            for line in self.process.stdout:
                self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        for line in self.lines:
            if match := regex.search(line):
                return match
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
            if match := regex.search(line):
                return match
        raise AssertionError(
            f"no line matching {pattern!r} within {timeout:.0f} s:\n" + "\n".join(self.lines[-40:])
        )

    def finish(self, timeout: float) -> int:
        code = self.process.wait(timeout=timeout)
        while (line := self._queue.get(timeout=10)) is not None:
            self.lines.append(line)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


free_base_port = free_port_block
"""Kept for the tests that import it from here."""


@pytest.mark.slow
def test_swarm_agrees_every_round_and_survives_a_sigkilled_node(published, tmp_path: Path) -> None:
    rounds, h = 10, 20  # ~0.5 s per round: the kill lands well before the run ends, even on a loaded machine
    swarm = SwarmProcess(
        published, tmp_path, "--nodes", "3", "--inner-steps", str(h), "--max-steps", str(rounds * h),
        "--round-timeout", "20",
    )  # fmt: skip
    try:
        victim = int(swarm.wait_for(r"^\[swarm\] node 2: pid (\d+)", 30).group(1))
        swarm.wait_for(r"^\[swarm\] round 1: 3/3 nodes agree", 60)
        os.kill(victim, signal.SIGKILL)  # mid-round 2 or 3: it is training
        assert swarm.finish(timeout=90) == 1  # the swarm reports the node that died
    finally:
        swarm.kill()
    text = "\n".join(swarm.lines)
    print(text)  # shown by pytest when an assertion below fails
    assert "DIFFER" not in text
    assert "[swarm] node 2 exited with code -9" in text
    assert "[swarm] nodes [2] failed" in text
    # The failed node's last lines again at the end: its error need not be searched for above.
    assert re.search(r"^\[swarm\] node 2 exited with code -9; its last lines:\n\[swarm\]   \S", text, re.M)
    agreed = {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in map(AGREE.match, swarm.lines) if m}
    assert sorted(agreed) == list(range(rounds)), text[-3000:]
    assert agreed[0] == agreed[1] == (3, 3)
    assert agreed[rounds - 1] == (2, 2)
    for node in (0, 1):  # a round closed early (--round-close majority) counts as h steps
        done = re.search(rf"^\[{node}\] done at step=(\d+) round={rounds};", text, re.MULTILINE)
        assert done is not None and rounds * math.ceil(0.75 * h) <= int(done.group(1)) <= rounds * h


@pytest.mark.slow
def test_ctrl_c_stops_every_node_and_the_token_stays_off_argv(published, tmp_path: Path) -> None:
    swarm = SwarmProcess(published, tmp_path, "--nodes", "2", "--inner-steps", "10", "--round-timeout", "20")
    try:
        pids = [int(swarm.wait_for(rf"^\[swarm\] node {i}: pid (\d+)", 30).group(1)) for i in (0, 1)]
        swarm.wait_for(r"^\[swarm\] round 0: 2/2 nodes agree", 60)
        token = (tmp_path / "swarm" / "node0" / "token").read_text().strip()
        assert (tmp_path / "swarm" / "node0" / "token").stat().st_mode & 0o077 == 0
        for pid in pids:
            assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        swarm.process.send_signal(signal.SIGINT)
        assert swarm.finish(timeout=30) == 0
    finally:
        swarm.kill()
    text = "\n".join(swarm.lines)
    print(text)  # shown by pytest when an assertion below fails
    for node in (0, 1):
        # Not necessarily at the start of a line: the node's signal handler prints between the
        # text and the newline of whatever line its main thread was printing.
        assert any(line.startswith(f"[{node}] ") and "received SIGTERM" in line for line in swarm.lines)
        assert f"[swarm] node {node} exited with code 0" in text
    assert token not in text


def test_node_command_line_has_peers_but_never_the_token(tmp_path: Path) -> None:
    from neuroshard.swarm.cli import Node, build_parser, node_argv, node_token

    args = build_parser().parse_args(["--nodes", "3", "--max-steps", "40", "--", "--batch-size", "2"])
    home = tmp_path / "node1"
    token = node_token(home)
    assert node_token(home) == token and (home / "token").stat().st_mode & 0o777 == 0o600
    node = Node(1, 7421, home, "w1")
    argv = node_argv(args, node, [7420, 7421, 7422], ["--data", "/d", "--publisher-key", "ab"], threads=1)
    assert Path(argv[0]).name == "neuroshard-node"  # the script beside the interpreter
    assert argv[argv.index("--peers") + 1] == "127.0.0.1:7420,127.0.0.1:7422"
    assert argv[argv.index("--port") + 1] == "7421" and argv[-2:] == ["--batch-size", "2"]
    assert "--max-steps" in argv and token not in " ".join(argv)
    assert argv[argv.index("--disk-share") + 1] == "0.333333"  # three nodes on one disk


def test_round_results_wait_for_running_nodes_and_skip_jumpers(capsys: pytest.CaptureFixture[str]) -> None:
    from neuroshard.swarm.cli import Node, report_rounds

    nodes = [Node(i, 7420 + i, Path("."), f"w{i}") for i in range(3)]
    nodes[0].rounds = {0: "aa", 1: "bb", 2: "cc"}
    nodes[1].rounds = {0: "aa", 1: "bx"}
    nodes[2].rounds = {0: "aa", 2: "cc"}  # adopted θ_3 straight after round 0: nothing for round 1
    printed: set[int] = set()
    report_rounds(nodes, printed)
    out = capsys.readouterr().out
    assert "round 0: 3/3 nodes agree on θ hash aa" in out
    assert "round 1: θ hashes DIFFER" in out and "bb: nodes [0]" in out and "bx: nodes [1]" in out
    assert "round 2" not in out  # node 1 has not reported it yet
    nodes[1].exit_code = -9  # a dead node is not waited for
    report_rounds(nodes, printed)
    assert "round 2: 2/2 nodes agree on θ hash cc" in capsys.readouterr().out
