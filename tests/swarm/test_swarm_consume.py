"""`neuroshard-swarm`'s output loop when the later stages do not end on their drivers' signed ends:
SIGTERM after END_GRACE_S, SIGKILL STOP_GRACE_S later, and no busy wait in between."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from neuroshard.swarm import cli
from neuroshard.swarm.cli import Node, consume


def _node(index: int, stage: int, code: str, lines: queue.Queue[tuple[int, str | None]]) -> Node:
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    node = Node(index=index, port=0, home=Path("."), wallet_id=f"w{index}", process=process, stage=stage)
    assert process.stdout is not None
    threading.Thread(target=cli._pump, args=(index, process.stdout, lines), daemon=True).start()
    return node


def test_a_later_stage_that_ignores_the_end_gets_sigterm_then_sigkill(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(cli, "END_GRACE_S", 0.5)
    monkeypatch.setattr(cli, "STOP_GRACE_S", 0.5)
    gets = 0
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
    real_get = lines.get

    def counted_get(*args: object, **kwargs: object) -> tuple[int, str | None]:
        nonlocal gets
        gets += 1
        return real_get(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(lines, "get", counted_get)
    ready = tmp_path / "ignoring"  # the stubborn node ignores SIGTERM from here on
    stubborn = f"import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    driver = (
        f"import os, time\nwhile not os.path.exists({str(ready)!r}): time.sleep(0.01)\nprint('driver done')"
    )
    nodes = [
        _node(0, 0, driver, lines),
        _node(1, 1, "import time; print('up', flush=True); time.sleep(60)", lines),  # ends on SIGTERM
        _node(2, 1, stubborn, lines),  # ignores SIGTERM: SIGKILL
    ]
    began = time.monotonic()
    try:
        assert consume(nodes, lines, set(), deadline=time.monotonic() + 30.0)
    finally:
        for n in nodes:
            assert n.process is not None
            if n.process.poll() is None:
                n.process.kill()
    took = time.monotonic() - began
    assert nodes[0].exit_code == 0 and all(n.stopped_by_us for n in nodes[1:])
    assert nodes[2].exit_code == -9  # SIGKILL
    assert took < 10.0
    assert gets < 200, f"{gets} queue reads in {took:.1f} s: a busy wait"
