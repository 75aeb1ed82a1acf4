"""The swarm's verifier: one `neuroshard-verifier` process that every node of the swarm joins.

`neuroshard-swarm` writes a network.toml that says what its nodes would train anyway (the
data set, the model and DiLoCo settings of the node flags after `--`, the swarm's H),
starts the verifier on 127.0.0.1 with it, reads the operator key it serves, and hands
each node `--join URL --operator-key KEY`. The verifier's output goes to
HOME/swarm/verifier/verifier.log.
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuroshard.data import load_or_create_signing_key, open_dataset, parse_public_key
from neuroshard.node.model import ModelConfig
from neuroshard.node.network_definition import LEGACY_SEGMENTS_PER_ROUND
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.roster import Roster
from neuroshard.protocol.signing import sign_request

STARTUP_TIMEOUT_S = 60.0


@dataclass
class SwarmVerifier:
    process: subprocess.Popen[bytes]
    url: str
    operator_key: str
    log_path: Path

    def node_flags(self) -> list[str]:
        return ["--join", self.url, "--operator-key", self.operator_key]

    def install_roster(
        self, home: Path, network: str, stages: dict[int, list[str]], days: float = 7.0
    ) -> None:
        """Sign the operator's roster (protocol.roster.Roster: these wallets per stage) with the key under
        `home` and POST it to /api/admin/roster, as an operator would for an allowlist run."""
        key, _ = load_or_create_signing_key(home / "operator.key")
        operator = Wallet(key)
        roster = Roster.build(
            operator, network=network, version=1, expires_at=int(time.time() + days * 86400), stages=stages
        )
        body = roster.to_json()
        path = "/api/admin/roster"
        headers = {
            **sign_request(operator, "POST", path, body, time.time()),
            "Content-Type": "application/json",
        }
        request = urllib.request.Request(self.url + path, data=body, method="POST", headers=headers)
        with urllib.request.urlopen(request, timeout=10.0) as reply:
            reply.read()

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def to_toml(tables: dict[str, Any]) -> str:
    lines = []
    for key, value in tables.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {_toml_value(value)}")
    for key, value in tables.items():
        if isinstance(value, dict):
            lines.append(f"\n[{key}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in value.items() if v is not None]
    return "\n".join(lines) + "\n"


def network_tables(
    node: argparse.Namespace,
    *,
    num_stages: int,
    inner_steps: int,
    data_dir: str,
    publisher_key: str,
    every_rounds: int,
) -> dict[str, Any]:
    """The definition the nodes would train by on their own flags (`node` = the node parser's result)."""
    vocab = open_dataset(Path(data_dir), parse_public_key(publisher_key)).tokenizer.vocab_size
    model = ModelConfig.named(node.model_size, vocab_size=vocab)
    return {
        "name": "swarm",
        "model": model.to_dict(),
        "stages": {"count": num_stages},
        "diloco": {
            # As cli.node_flags builds DiLoCoConfig from the same flags.
            "inner_steps": inner_steps,
            "inner_lr": node.inner_lr,
            "warmup_steps": min(node.warmup_steps, node.total_steps),
            "total_steps": node.total_steps,
            # No outer_lr unless one was given: DiLoCoConfig tunes it for inner_steps.
            **({} if node.outer_lr is None else {"outer_lr": node.outer_lr}),
            "outer_momentum": node.outer_momentum,
            "outer_nesterov": node.outer_momentum > 0,
            # Named even when 0: a network.toml without it would ramp over 3 rounds.
            "outer_warmup_rounds": node.outer_warmup_rounds,
        },
        # k = H/10, named: every node of a swarm writes its segment checkpoints to this one machine's
        # disk, where a network.toml's H/40 would write four times as many.
        "training": {
            "batch_size": node.batch_size,
            "seq_len": node.seq_len,
            "segment_steps": max(1, inner_steps // LEGACY_SEGMENTS_PER_ROUND),
        },
        # Named even when off: a network.toml without it would anchor its rounds.
        "aggregation": {"anchor_floor": False if node.anchor_floor is None else node.anchor_floor},
        "data": {"manifest_url": data_dir, "publisher_key": publisher_key},
        "evaluation": {"every_rounds": every_rounds, "held_out_shard": 0},
    }


def start_swarm_verifier(
    home: Path, tables: dict[str, Any], port: int, database_url: str | None, extra_args: Sequence[str] = ()
) -> SwarmVerifier:
    """Start the verifier process on 127.0.0.1:port; returns once it answers with a signed definition."""
    home.mkdir(parents=True, exist_ok=True)
    # The operator key is made here, so the swarm knows which key its own verifier signs with
    # and cannot mistake another service on the port for it.
    key, _ = load_or_create_signing_key(home / "operator.key")
    operator = bytes(key.verify_key).hex()
    network = home / "network.toml"
    network.write_text(to_toml(tables), encoding="utf-8")
    log_path = home / "verifier.log"
    argv = [
        sys.executable, "-m", "neuroshard.cli.verifier",
        "--network", str(network),
        "--home", str(home),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--operator-key-file", str(home / "operator.key"),
        "--log-level", "info",
        *(["--db", database_url] if database_url else []),
        # A local test harness: every wallet counts unless the caller asks for a policy (a later
        # --admission in extra_args wins). An operator's verifier defaults to probation.
        "--admission", "open",
        *extra_args,
    ]  # fmt: skip
    with log_path.open("ab") as out:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the verifier exited with code {process.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"{url}/api/network", timeout=1.0) as reply:
                served = reply.headers.get("X-NeuroShard-Operator", "")
        except (OSError, http.client.HTTPException):
            # Not listening yet. On a port inside the ephemeral range a poll can even connect to
            # itself (TCP simultaneous open: source port == destination port) and read its own
            # request back as a bad status line; that socket then holds the port the verifier
            # wants. Another try, from another source port.
            time.sleep(0.1)
            continue
        if served != operator:
            process.kill()
            process.wait()
            raise RuntimeError(
                f"port {port} is taken by another service (operator key {served[:16] or 'none'}); pick --verifier-port"
            )
        return SwarmVerifier(process, url, operator, log_path)
    process.kill()
    process.wait()
    raise RuntimeError(
        f"the verifier did not answer on {url} within {STARTUP_TIMEOUT_S:.0f} s; see {log_path}"
    )
