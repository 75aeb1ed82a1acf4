"""Every benchmark runs: each bench/*.py in its --quick mode (tiny settings, seconds long), as a
user would start it from a fresh clone. A benchmark broken by a change elsewhere fails here,
not months later when someone wants its numbers. The numbers themselves are not checked."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
BENCHMARKS = sorted(p.name for p in BENCH.glob("*.py") if p.name != "common.py")
TIMEOUT_S = 180
"""Per benchmark; the slowest quick run (a five-node swarm) takes ~20 s on 2 shared cores."""


SWARMS = {"bench_swarm_attacks.py", "bench_swarm_utilisation.py"}
"""Benchmarks that start a swarm of node processes: run one at a time with the swarm tests."""


def test_every_benchmark_is_listed() -> None:
    assert "bench_verifier.py" in BENCHMARKS and len(BENCHMARKS) >= 10
    assert set(BENCHMARKS) >= SWARMS
    assert "bench_convergence.py" in BENCHMARKS  # DiLoCo vs data parallel (issue 18)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.xdist_group("swarms")) if n in SWARMS else n for n in BENCHMARKS],
)
def test_quick_mode_runs(name: str, tmp_path: Path) -> None:
    argv = [sys.executable, str(BENCH / name), "--quick"]
    if name.startswith("bench_verifier") and not os.environ.get("NEUROSHARD_TEST_DATABASE_URL"):
        argv += ["--db", "sqlite"]  # PostgreSQL when the suite has one (CI), else a scratch file
    start = time.monotonic()
    out = subprocess.run(
        argv,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    assert out.returncode == 0, (
        f"{name} --quick exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )
    assert out.stdout.strip(), f"{name} --quick printed nothing"
    print(f"{name} --quick: {time.monotonic() - start:.1f} s")
