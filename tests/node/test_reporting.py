"""The embedded default: `neuroshard-node --token T` with no --join serves the verifier API on
loopback from its own process, reports every round to it, and the verifier measures the
node's weights itself."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import PublishedData

from neuroshard.testing.ports import free_port

NODE = str(Path(sys.executable).parent / "neuroshard-node")
TOKEN = "embedded-verifier-test-token-9f2e"


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())


@pytest.mark.slow
def test_a_lone_node_serves_the_api_and_is_measured(published: PublishedData, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [NODE, "--home", str(tmp_path), "--data", str(published.directory),
            "--publisher-key", published.public_key_hex, "--model-size", "micro", "--seq-len", "32",
            "--batch-size", "8", "--inner-steps", "200", "--threads", "1", "--log-every", "1000",
            "--verifier-port", str(port)]  # fmt: skip
    env = {**{k: v for k, v in os.environ.items() if k != "NEUROSHARD_TOKEN"}, "NEUROSHARD_TOKEN": TOKEN}
    with (tmp_path / "node.out").open("w") as out:
        node = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline, verdict = time.monotonic() + 90, {}
        while time.monotonic() < deadline and node.poll() is None:
            with contextlib.suppress(OSError):
                verdict = _get(f"{url}/api/training/verify")
            if verdict.get("evaluations", 0) >= 2:
                break
            time.sleep(0.5)
        nodes = _get(f"{url}/api/nodes")
        detail = _get(f"{url}/api/nodes/{nodes[0]['wallet_id']}") if nodes else {}
        page = urllib.request.urlopen(f"{url}/", timeout=5).read().decode()
    finally:
        node.send_signal(signal.SIGTERM)
        code = node.wait(timeout=60)
    log = (tmp_path / "node.out").read_text()
    assert code == 0, log[-3000:]
    assert verdict.get("evaluations", 0) >= 2, (verdict, log[-3000:])  # measured by the verifier itself
    assert verdict["global_loss"] is not None and verdict["active_nodes"] == 1
    (only,) = nodes
    assert only["status"] == "active" and only["alive"] and only["address"].startswith("http://127.0.0.1:")
    assert detail["receipts"] >= 2, detail
    assert "<html" in page.lower()  # the dashboard
    assert f"verifier (embedded): {url}/" in log and "held-out loss" in log
    assert TOKEN not in log  # the token never reaches a log, nor the verifier's database
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


def test_no_verifier_opens_no_port(published: PublishedData, tmp_path: Path) -> None:
    out = subprocess.run(
        [NODE, "--home", str(tmp_path), "--data", str(published.directory), "--publisher-key",
         published.public_key_hex, "--model-size", "micro", "--seq-len", "32", "--batch-size", "2",
         "--inner-steps", "5", "--max-steps", "10", "--threads", "1", "--no-verifier"],
        capture_output=True, text=True, timeout=120,
        env={**{k: v for k, v in os.environ.items() if k != "NEUROSHARD_TOKEN"}, "NEUROSHARD_TOKEN": TOKEN},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "verifier (embedded)" not in out.stdout and "tracker:" not in out.stdout
    assert "peer server" not in out.stdout
    assert not list(tmp_path.glob("verifier*.sqlite3"))


def _joined_args(stage: int, tmp_path: Path) -> Any:
    from neuroshard.cli.node_flags import build_parser

    return build_parser().parse_args(
        ["--join", "http://127.0.0.1:1", "--home", str(tmp_path), "--stage", str(stage)]
    )


def test_joining_a_pipeline_takes_its_stage_count_and_checks_the_stage(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from neuroshard.cli.node_flags import run_settings
    from neuroshard.node import reporting
    from neuroshard.testing.verifier import small_network

    definition = small_network(stages={"count": 2})
    monkeypatch.setattr(reporting, "fetch_network", lambda *a, **k: (definition, "ab" * 32))
    args = _joined_args(1, tmp_path)
    assert args.stages == 1  # the flag's default: the definition decides
    run = run_settings(args, lambda line: None)
    assert run.joined is definition and run.num_stages == 2 and run.operator_key == "ab" * 32
    assert args.stages == 1  # the flags themselves are never rewritten
    with pytest.raises(ValueError, match=r"--stage 2: .* cuts the model into 2 stages"):
        run_settings(_joined_args(2, tmp_path), lambda line: None)


def test_joining_a_pipeline_takes_its_codec_and_refuses_another(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from neuroshard.cli.node_flags import build_parser, pipeline_config, run_settings
    from neuroshard.node import reporting
    from neuroshard.testing.verifier import small_network

    definition = small_network(stages={"count": 2, "codec": "hadamard4"})
    monkeypatch.setattr(reporting, "fetch_network", lambda *a, **k: (definition, "ab" * 32))
    args = _joined_args(1, tmp_path)
    assert pipeline_config(args, run_settings(args, lambda line: None)).codec == "hadamard4"
    join = ["--join", "http://127.0.0.1:1", "--home", str(tmp_path), "--stage", "1"]
    with pytest.raises(ValueError, match=r"--activation-codec int8: .* runs its pipeline in hadamard4"):
        run_settings(build_parser().parse_args([*join, "--activation-codec", "int8"]), lambda line: None)
    # Without --join: --activation-codec, else fitted43; the old --activation-dtype names a cast codec.
    alone = build_parser().parse_args(["--stages", "2", "--no-verifier"])
    assert pipeline_config(alone, run_settings(alone, lambda line: None)).codec == "fitted43"
    old = build_parser().parse_args(["--stages", "2", "--activation-dtype", "fp16", "--no-verifier"])
    assert pipeline_config(old, run_settings(old, lambda line: None)).codec == "fp16"
