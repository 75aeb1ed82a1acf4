"""`neuroshard-swarm`: N `neuroshard-node` processes on loopback training one stage together.

Builds (once) the embedded default data set under --home, gives every node its own
wallet token (kept under HOME/swarm/nodeI/token, mode 0600, handed over through
NEUROSHARD_TOKEN — never argv, where `ps` would show it), its own home and checkpoints,
the same data set, a port and every other node as a bootstrap peer. Prints each node's
lines prefixed with its index, and after every round whether all running nodes hold the
same θ hash. Ctrl-C (or SIGTERM) stops every node: SIGTERM (each saves a checkpoint),
then SIGKILL for any still running after the grace period.

    neuroshard-swarm --nodes 3 --inner-steps 20 --max-steps 200
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

from neuroshard.data import load_or_create_signing_key

from ..embedded import ensure_default_dataset
from ..wallet import TOKEN_ENV, Wallet
from .swarm_verifier import SwarmVerifier, network_tables, start_swarm_verifier
from .wire import ENCODINGS

PROG = "neuroshard-swarm"
ROUND_DONE = re.compile(r"^p2p round=\d+ .*; θ_(\d+) ([0-9a-f]+) ")
"""A node's per-round report line (`RoundReport.line`): θ_N's hash, the result of round N-1."""
STOP_GRACE_S = 15.0
"""How long a node gets after SIGTERM to finish its step and write a checkpoint before SIGKILL."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nodes", type=int, required=True, help="number of node processes")
    p.add_argument("--max-steps", type=int, help="inner steps per node (default: run until Ctrl-C)")
    p.add_argument("--inner-steps", type=int, default=20, help="H: inner steps per outer round")
    p.add_argument("--base-port", type=int, default=7420, help="node i listens on base-port + i")
    p.add_argument("--home", type=Path, default=Path.home() / ".neuroshard", help="state directory")
    p.add_argument("--data", type=Path, help="published data set (default: the embedded one under --home)")
    p.add_argument("--publisher-key", help="hex public key that signed --data's manifest")
    p.add_argument("--encoding", choices=ENCODINGS, default="int8", help="pseudo-gradient encoding")
    p.add_argument(
        "--round-timeout", type=float, default=60.0, help="seconds a node waits for the others' contributions"
    )
    p.add_argument("--threads", type=int, help="torch threads per node (default: cores / nodes, at least 1)")
    p.add_argument(
        "--node-command",
        # The node script installed beside this interpreter, so a venv works without activation.
        default=shlex.quote(str(Path(sys.executable).with_name("neuroshard-node"))),
        help="command that starts one node (development and tests: e.g. 'python my_entry.py')",
    )
    p.add_argument(
        "--verifier-port", type=int, default=8000, help="port of the swarm's verifier (API, dashboard)"
    )
    p.add_argument("--no-verifier", action="store_true", help="start no verifier; nodes report to nobody")
    p.add_argument(
        "--verifier-db", help="the verifier's database URL (default: SQLite under HOME/swarm/verifier)"
    )
    p.add_argument(
        "--eval-every", type=int, default=1, help="rounds between the verifier's held-out measurements"
    )
    p.add_argument("node_args", nargs=argparse.REMAINDER, help="after --: extra flags passed to every node")
    return p


@dataclass
class Node:
    index: int
    port: int
    home: Path
    wallet_id: str
    process: subprocess.Popen[str] | None = None
    exit_code: int | None = None
    stopped_by_us: bool = False
    rounds: dict[int, str] = field(default_factory=dict)


def _log(line: str) -> None:
    print(line, flush=True)


def node_token(home: Path) -> str:
    """The node's token: created once (random, mode 0600) so a restarted swarm keeps its wallets."""
    path = home / "token"
    if path.exists():
        return path.read_text(encoding="utf-8").strip()
    home.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path.read_text(encoding="utf-8").strip()


def _data_flags(args: argparse.Namespace) -> list[str]:
    if args.data is not None:
        if not args.publisher_key:
            raise SystemExit(f"{PROG}: error: --data needs --publisher-key")
        return ["--data", str(args.data), "--publisher-key", args.publisher_key]
    dataset = ensure_default_dataset(args.home, _log)
    key, _ = load_or_create_signing_key(args.home / "publisher.key")
    return ["--data", dataset.location, "--publisher-key", bytes(key.verify_key).hex()]


def node_argv(
    args: argparse.Namespace, node: Node, ports: list[int], data: list[str], threads: int
) -> list[str]:
    peers = ",".join(f"127.0.0.1:{p}" for p in ports if p != node.port)
    extra = [a for a in args.node_args if a != "--"]
    return [
        *shlex.split(args.node_command),
        *data,
        "--home", str(node.home),
        "--checkpoint-dir", str(node.home / "checkpoints"),
        "--inner-steps", str(args.inner_steps),
        *(["--max-steps", str(args.max_steps)] if args.max_steps is not None else []),
        "--threads", str(threads),
        "--host", "127.0.0.1",
        "--port", str(node.port),
        "--peers", peers,
        "--encoding", args.encoding,
        "--round-timeout", str(args.round_timeout),
        *extra,
    ]  # fmt: skip


def _pump(index: int, stream: IO[str], lines: queue.Queue[tuple[int, str | None]]) -> None:
    with stream:
        for line in stream:
            lines.put((index, line.rstrip("\n")))
    lines.put((index, None))


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def report_rounds(nodes: list[Node], printed: set[int], *, final: bool = False) -> None:
    """Print each round once every running node reported it (at the end: whatever was reported)."""
    running = [n for n in nodes if n.exit_code is None]
    rounds = sorted({r for n in nodes for r in n.rounds} - printed)
    for r in rounds:
        holders = [n for n in nodes if r in n.rounds]
        # A node that adopted a later state skipped this round: it has nothing to report for it.
        if not final and any(r not in n.rounds and max(n.rounds, default=-1) < r for n in running):
            break
        hashes: dict[str, list[int]] = {}
        for n in holders:
            hashes.setdefault(n.rounds[r], []).append(n.index)
        if len(hashes) == 1:
            (h,) = hashes
            _log(f"[swarm] round {r}: {len(holders)}/{len(holders)} nodes agree on θ hash {h}")
        else:
            detail = "; ".join(f"{h}: nodes {ids}" for h, ids in hashes.items())
            _log(f"[swarm] round {r}: θ hashes DIFFER — {detail}")
        printed.add(r)


def terminate(nodes: list[Node]) -> None:
    """SIGTERM every running node: each finishes its step and writes a checkpoint."""
    for n in nodes:
        if n.process is not None and n.process.poll() is None:
            n.stopped_by_us = True
            n.process.send_signal(signal.SIGTERM)


def kill_stragglers(nodes: list[Node]) -> None:
    for n in nodes:
        if n.process is not None and n.process.poll() is None:
            _log(f"[swarm] node {n.index} did not stop within {STOP_GRACE_S:.0f} s; SIGKILL")
            n.stopped_by_us = True
            n.process.kill()


def consume(
    nodes: list[Node], lines: queue.Queue[tuple[int, str | None]], printed: set[int], deadline: float | None
) -> bool:
    """Print node lines and round results until every node's output ended (True) or the deadline (False)."""
    while any(n.exit_code is None and n.process is not None for n in nodes):
        timeout = None if deadline is None else deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            return False
        try:
            index, line = lines.get(timeout=timeout)
        except queue.Empty:
            return False
        node = nodes[index]
        if line is None:
            assert node.process is not None
            node.exit_code = node.process.wait()
            _log(f"[swarm] node {index} exited with code {node.exit_code}")
        else:
            _log(f"[{index}] {line}")
            match = ROUND_DONE.search(line)
            if match:
                node.rounds[int(match.group(1)) - 1] = match.group(2)
        report_rounds(nodes, printed)
    return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nodes < 1:
        return _fail(f"--nodes must be >= 1, got {args.nodes}")
    if shutil.which(shlex.split(args.node_command)[0]) is None:
        return _fail(f"node command {args.node_command!r} not found")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.nodes)
    data = _data_flags(args)
    try:
        verifier = None if args.no_verifier else _start_verifier(args, data)
    except (RuntimeError, ValueError, OSError) as exc:
        return _fail(f"verifier: {exc}")
    if verifier is not None:
        data = [*data, *verifier.node_flags()]
    ports = [args.base_port + i for i in range(args.nodes)]
    nodes = []
    for i, port in enumerate(ports):
        home = args.home / "swarm" / f"node{i}"
        nodes.append(Node(i, port, home, Wallet.from_token(node_token(home)).wallet_id))

    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
    printed: set[int] = set()
    try:
        for node in nodes:
            start_node(args, node, ports, data, threads, lines)
        consume(nodes, lines, printed, deadline=None)
    except _Stop as exc:
        _log(f"[swarm] {exc}: stopping {sum(n.exit_code is None for n in nodes)} node(s)")
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends the swarm at once
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        terminate(nodes)
        if not consume(nodes, lines, printed, deadline=time.monotonic() + STOP_GRACE_S):
            kill_stragglers(nodes)
            consume(nodes, lines, printed, deadline=time.monotonic() + 5.0)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        terminate(nodes)  # only reached with nodes alive if something above failed
        kill_stragglers(nodes)
        if verifier is not None:
            verifier.stop()
    report_rounds(nodes, printed, final=True)
    failed = [n.index for n in nodes if n.exit_code not in (0, None) and not n.stopped_by_us]
    if failed:
        _log(f"[swarm] nodes {failed} failed")
        return 1
    return 0


def _start_verifier(args: argparse.Namespace, data: list[str]) -> SwarmVerifier:
    """One verifier for the swarm, defined by what the nodes would train (swarm_verifier)."""
    from ..cli import build_parser as node_parser  # the node's flags and defaults, one definition

    node = node_parser().parse_args([a for a in args.node_args if a != "--"])
    tables = network_tables(
        node,
        inner_steps=args.inner_steps,
        data_dir=data[1],
        publisher_key=data[3],
        every_rounds=args.eval_every,
    )
    verifier = start_swarm_verifier(
        args.home / "swarm" / "verifier", tables, args.verifier_port, args.verifier_db
    )
    _log(
        f"[swarm] verifier {verifier.url}/ (dashboard; API {verifier.url}/api/training/verify), log {verifier.log_path}"
    )
    return verifier


def start_node(
    args: argparse.Namespace,
    node: Node,
    ports: list[int],
    data: list[str],
    threads: int,
    lines: queue.Queue[tuple[int, str | None]],
) -> None:
    env = {**os.environ, TOKEN_ENV: node_token(node.home)}
    # Own session: the terminal's Ctrl-C reaches only the swarm, which then stops the nodes
    # in order (SIGTERM, checkpoint, exit) instead of every process dying at once.
    node.process = subprocess.Popen(
        node_argv(args, node, ports, data, threads),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env=env,
        start_new_session=True,
    )
    assert node.process.stdout is not None
    threading.Thread(target=_pump, args=(node.index, node.process.stdout, lines), daemon=True).start()
    _log(f"[swarm] node {node.index}: pid {node.process.pid}, port {node.port}, wallet {node.wallet_id}")


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
    sys.exit(main())
