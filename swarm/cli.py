"""`neuroshard-swarm`: N `neuroshard-node` processes on loopback training one stage together.

Builds (once) the embedded default data set under --home, gives every node its own
wallet token (kept under HOME/swarm/nodeI/token, mode 0600, handed over through
NEUROSHARD_TOKEN — never argv, where `ps` would show it), its own home and checkpoints,
the same data set, a port and every other node as a bootstrap peer. Prints each node's
lines prefixed with its index, and after every round whether all running nodes hold the
same θ hash. Ctrl-C (or SIGTERM) stops every node: SIGTERM (each saves a checkpoint),
then SIGKILL for any still running after the grace period.

    neuroshard-swarm --nodes 3 --inner-steps 20 --max-steps 200

With ``--stages S`` the model is cut into S pipeline stages and node i holds stage i mod S.
Stage-0 nodes read data and drive (``--max-steps`` counts their inner steps); the later
stages train on what arrives and end by themselves when every driver has sent them its signed
end (``PipelineEnd``), each telling the stage after it; one still running `END_GRACE_S` after
the last driver exited is stopped with SIGTERM (and says so).
Round results are printed per stage. The swarm's verifier defines the run with S stages and
every node joins it with its stage: hash agreement is judged per stage, and the measured
loss is that of every stage's majority weights assembled into the whole model.

With --byzantine K --attack NAME the last K nodes run `neuroshard-adversary --attack NAME` (testing
the defences): they are labelled ATTACKER in the output, and the per-round agreement line
compares the honest nodes only, saying separately whether each attacker holds the same θ.

    neuroshard-swarm --nodes 5 --byzantine 1 --attack sign_flip --inner-steps 20 --max-steps 200
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
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

from neuroshard.adversary.attacks import ATTACKS
from neuroshard.cli.node_flags import build_parser as node_parser
from neuroshard.data import load_or_create_signing_key
from neuroshard.node.embedded import ensure_default_dataset
from neuroshard.node.wallet import TOKEN_ENV, Wallet
from neuroshard.protocol.round import ENCODINGS
from neuroshard.swarm.verifier import SwarmVerifier, network_tables, start_swarm_verifier

PROG = "neuroshard-swarm"
ROUND_DONE = re.compile(r"^p2p round=\d+ .*; θ_(\d+) ([0-9a-f]+) ")
"""A node's per-round report line (`RoundReport.line`): θ_N's hash, the result of round N-1."""
STOP_GRACE_S = 15.0
"""How long a node gets after SIGTERM to finish its step and write a checkpoint before SIGKILL."""
END_GRACE_S = 60.0
"""How long the later stages get, after the last driver exited, to end on their drivers' signed
ends (their last round, a checkpoint, the end passed on) before the swarm sends SIGTERM."""
LAST_LINES = 20
"""Lines of a failed node's output repeated at the end of the swarm's."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nodes", type=int, required=True, help="number of node processes")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages; node i holds stage i mod S")
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
        "--adversary-command",
        default=shlex.quote(str(Path(sys.executable).with_name("neuroshard-adversary"))),
        help="command that starts one attacking node (the --byzantine ones)",
    )
    p.add_argument(
        "--byzantine", type=int, default=0, help="make the last K nodes attackers (neuroshard-adversary)"
    )
    p.add_argument(
        "--attack", choices=ATTACKS, help="what the --byzantine nodes send (neuroshard-adversary --attack)"
    )
    p.add_argument("--attack-param", type=float, help="the attack's strength, passed to every attacker")
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
    p.add_argument(
        "--admission",
        choices=("open", "probation", "allowlist"),
        default="open",
        help="the verifier's membership policy (neuroshard-verifier --admission; default %(default)s)",
    )
    p.add_argument(
        "--admission-rounds", type=int, help="probation: rounds with the majority before admission"
    )
    p.add_argument("--admission-spot-checks", type=int, help="probation: replay spot checks before admission")
    p.add_argument(
        "--membership-lead-rounds",
        type=int,
        help="rounds before a new member list takes effect (the verifier's default suits long rounds)",
    )
    p.add_argument(
        "--roster",
        type=int,
        metavar="K",
        help="the operator's signed roster names nodes 0..K-1: under --admission allowlist only they "
        "count (default: all nodes), under probation they are admitted at once",
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
    stage: int = 0
    attack: str | None = None
    """Set on the --byzantine nodes: the attack they run."""
    last_lines: deque[str] = field(default_factory=lambda: deque(maxlen=LAST_LINES))
    """The node's latest output, repeated at the end if it fails (its error may be far above)."""


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
    command = args.node_command if node.attack is None else args.adversary_command
    return [
        *shlex.split(command),
        *data,
        "--home", str(node.home),
        "--checkpoint-dir", str(node.home / "checkpoints"),
        "--inner-steps", str(args.inner_steps),
        *(["--max-steps", str(args.max_steps)] if args.max_steps is not None and node.stage == 0 else []),
        "--threads", str(threads),
        # Every node's segment material goes to this machine's one disk: each counts its share.
        "--disk-share", f"{1 / args.nodes:.6g}",
        "--host", "127.0.0.1",
        "--port", str(node.port),
        "--peers", peers,
        "--encoding", args.encoding,
        "--round-timeout", str(args.round_timeout),
        *(["--stages", str(args.stages), "--stage", str(node.stage)] if args.stages > 1 else []),
        # Launched together, the replicas of a stage start round 0 together: without the wait, one
        # that starts a moment late finds round 0 under way and joins by state sync instead.
        "--min-peers", str(sum(i % args.stages == node.stage for i in range(args.nodes)) - 1),
        *_attack_flags(args, node),
        *extra,
    ]  # fmt: skip


def _attack_flags(args: argparse.Namespace, node: Node) -> list[str]:
    if node.attack is None:
        return []
    param = [] if args.attack_param is None else ["--attack-param", str(args.attack_param)]
    return ["--attack", node.attack, "--attack-seed", str(node.index), *param]


def _pump(index: int, stream: IO[str], lines: queue.Queue[tuple[int, str | None]]) -> None:
    with stream:
        for line in stream:
            lines.put((index, line.rstrip("\n")))
    lines.put((index, None))


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def report_rounds(nodes: list[Node], printed: set[tuple[int, int]], *, final: bool = False) -> None:
    """Print each (stage, round) once every running node of the stage reported it (at the end:
    whatever was reported). The replicas of one stage must agree; stages hold different layers."""
    stages = sorted({n.stage for n in nodes})
    for stage in stages:
        label = "" if stages == [0] else f"stage {stage} "
        _report_stage([n for n in nodes if n.stage == stage], stage, label, printed, final)


def _report_stage(
    nodes: list[Node], stage: int, label: str, printed: set[tuple[int, int]], final: bool
) -> None:
    running = [n for n in nodes if n.exit_code is None]
    rounds = sorted({r for n in nodes for r in n.rounds} - {r for s, r in printed if s == stage})
    for r in rounds:
        holders = [n for n in nodes if r in n.rounds]
        # A node that adopted a later state skipped this round: it has nothing to report for it.
        if not final and any(r not in n.rounds and max(n.rounds, default=-1) < r for n in running):
            break
        honest = [n for n in holders if n.attack is None]
        hashes: dict[str, list[int]] = {}
        for n in honest:
            hashes.setdefault(n.rounds[r], []).append(n.index)
        who = "honest nodes" if len(honest) < len(holders) else "nodes"
        if len(hashes) == 1:
            (h,) = hashes
            _log(
                f"[swarm] {label}round {r}: {len(honest)}/{len(honest)} {who} agree on θ hash {h}"
                f"{_attackers(holders, r, h)}"
            )
        elif hashes:
            detail = "; ".join(f"{h}: nodes {ids}" for h, ids in hashes.items())
            _log(f"[swarm] {label}round {r}: θ hashes DIFFER — {detail}{_attackers(holders, r, None)}")
        printed.add((stage, r))


def _attackers(holders: list[Node], round_: int, honest_hash: str | None) -> str:
    """The attackers' side of a round line: whether each ended the round on the honest θ."""
    parts = [
        f"; ATTACKER node {n.index} ({n.attack}) "
        + ("same θ" if n.rounds[round_] == honest_hash else f"θ hash {n.rounds[round_]}")
        for n in holders
        if n.attack is not None
    ]
    return "".join(parts)


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
    nodes: list[Node],
    lines: queue.Queue[tuple[int, str | None]],
    printed: set[tuple[int, int]],
    deadline: float | None,
) -> bool:
    """Print node lines and round results until every node's output ended (True) or the deadline (False)."""
    term_at: float | None = None
    """When later-stage nodes still running get SIGTERM: END_GRACE_S after the last driver exited."""
    kill_at: float | None = None
    """When those that ignored it get SIGKILL: STOP_GRACE_S after the SIGTERM."""
    while any(n.exit_code is None and n.process is not None for n in nodes):
        now = time.monotonic()
        if term_at is not None and now >= term_at:
            term_at = None
            late = [n for n in nodes if n.exit_code is None and not n.stopped_by_us]
            if late:
                _log(f"[swarm] nodes {[n.index for n in late]} did not end {END_GRACE_S:.0f} s after "
                     "the drivers did; SIGTERM")  # fmt: skip
                terminate(late)
                kill_at = now + STOP_GRACE_S
        if kill_at is not None and now >= kill_at:
            kill_at = None
            kill_stragglers(nodes)
        if deadline is not None and now >= deadline:
            return False
        wake = [t for t in (deadline, term_at, kill_at) if t is not None]
        try:
            index, line = lines.get(timeout=None if not wake else max(0.01, min(wake) - now))
        except queue.Empty:
            continue  # a deadline, a SIGTERM or a SIGKILL is due: the top of the loop sees to it
        node = nodes[index]
        if line is None:
            assert node.process is not None
            node.exit_code = node.process.wait()
            _log(f"[swarm] node {index} exited with code {node.exit_code}")
            if (
                term_at is None
                and kill_at is None
                and all(n.exit_code is not None for n in nodes if n.stage == 0)
            ):
                # Later stages end on their drivers' signed ends; a grace before the launcher steps in.
                term_at = time.monotonic() + END_GRACE_S
        else:
            _log(f"[{index}] {line}")
            node.last_lines.append(line)
            match = ROUND_DONE.search(line)
            if match:
                node.rounds[int(match.group(1)) - 1] = match.group(2)
        report_rounds(nodes, printed)
    return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nodes < 1:
        return _fail(f"--nodes must be >= 1, got {args.nodes}")
    if not 1 <= args.stages <= args.nodes:
        return _fail(f"--stages must lie in [1, --nodes {args.nodes}], got {args.stages}")
    if not 0 <= args.byzantine < args.nodes or (args.byzantine > 0) != (args.attack is not None):
        return _fail("--byzantine K needs 0 <= K < --nodes, and --attack NAME exactly when K > 0")
    if shutil.which(shlex.split(args.node_command)[0]) is None:
        return _fail(f"node command {args.node_command!r} not found")
    if args.byzantine and shutil.which(shlex.split(args.adversary_command)[0]) is None:
        return _fail(f"adversary command {args.adversary_command!r} not found")
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
        attack = args.attack if i >= args.nodes - args.byzantine else None
        wallet_id = Wallet.from_token(node_token(home)).wallet_id
        nodes.append(Node(i, port, home, wallet_id, stage=i % args.stages, attack=attack))
    if verifier is not None and (args.admission == "allowlist" or args.roster is not None):
        listed = nodes[: args.roster if args.roster is not None else len(nodes)]
        stages: dict[int, list[str]] = {}
        for node in listed:
            stages.setdefault(node.stage, []).append(Wallet.from_token(node_token(node.home)).public_key_hex)
        try:
            verifier.install_roster(args.home / "swarm" / "verifier", "swarm", stages)
        except OSError as exc:
            verifier.stop()
            return _fail(f"verifier: the roster was not accepted: {exc}")
        _log(f"[swarm] the operator's roster names nodes {[n.index for n in listed]}")

    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
    printed: set[tuple[int, int]] = set()
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
        for n in nodes:
            if n.index in failed:
                _log(f"[swarm] node {n.index} exited with code {n.exit_code}; its last lines:")
                for line in n.last_lines:
                    _log(f"[swarm]   {line}")
        _log(f"[swarm] nodes {failed} failed")
        return 1
    return 0


def _start_verifier(args: argparse.Namespace, data: list[str]) -> SwarmVerifier:
    """One verifier for the swarm, defined by what the nodes would train (swarm.verifier)."""
    node = node_parser().parse_args([a for a in args.node_args if a != "--"])
    tables = network_tables(
        node,
        num_stages=args.stages,
        inner_steps=args.inner_steps,
        data_dir=data[1],
        publisher_key=data[3],
        every_rounds=args.eval_every,
    )
    membership = ["--admission", args.admission]
    if args.admission_rounds is not None:
        membership += ["--admission-rounds", str(args.admission_rounds)]
    if args.admission_spot_checks is not None:
        membership += ["--admission-spot-checks", str(args.admission_spot_checks)]
    if args.membership_lead_rounds is not None:
        membership += ["--membership-lead-rounds", str(args.membership_lead_rounds)]
    verifier = start_swarm_verifier(
        args.home / "swarm" / "verifier", tables, args.verifier_port, args.verifier_db, membership
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
    role = "" if node.attack is None else f", ATTACKER ({node.attack})"
    _log(
        f"[swarm] node {node.index}: pid {node.process.pid}, port {node.port}, stage {node.stage}, "
        f"wallet {node.wallet_id}{role}"
    )


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
    sys.exit(main())
