"""`neuroshard-node --stages/--stage`: bad layouts are refused with one clear line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

NODE = str(Path(sys.executable).parent / "neuroshard-node")


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "NEUROSHARD_TOKEN"}
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--stages", "2", "--stage", "2"], "--stage 2 must lie in [0, --stages 2)"),
        (["--stages", "3", "--stage", "1"], "num_stages (3) must be between 1 and n_layers (2)"),
    ],
)
def test_bad_stage_layouts_give_one_clear_line(
    published, tmp_path: Path, flags: list[str], message: str
) -> None:
    out = _run([
        NODE, "--token", "x", "--home", str(tmp_path), "--data", str(published.directory),
        "--publisher-key", published.public_key_hex, "--model-size", "micro", "--seq-len", "32", "--port", "0", "--threads", "1",
        *flags,
    ])  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
