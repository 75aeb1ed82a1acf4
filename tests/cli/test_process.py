"""neuroshard.cli.process: a command's process ends with main's status, after its non-daemon
threads and the exit hooks it registered, and without the interpreter's teardown (where a
thread that ran torch can crash a finished process)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from neuroshard.cli.process import run_command

    class Teardown:
        def __del__(self):
            print("torn down", flush=True)

    KEPT = Teardown()  # collected by the interpreter's teardown, if there is one

    def main():
        def late():
            time.sleep(0.3)
            with open(sys.argv[1], "w") as f:
                f.write("written")
        threading.Thread(target=late).start()  # not a daemon: the exit waits for it
        atexit.register(lambda: print("hook ran", end=" "))
        print("no newline", end=" ")
        how = sys.argv[2]
        if how == "return":
            return 3
        if how == "exit-int":
            sys.exit(2)
        sys.exit("refused: one clear line")

    run_command(main)
    """
)


def _run(tmp_path: Path, how: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "late.txt"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out), how], capture_output=True, text=True, timeout=60
    )
    return done, out


@pytest.mark.parametrize(("how", "status"), [("return", 3), ("exit-int", 2), ("exit-text", 1)])
def test_the_status_is_mains_and_threads_and_hooks_finish_first(
    tmp_path: Path, how: str, status: int
) -> None:
    done, late = _run(tmp_path, how)
    assert done.returncode == status, done.stderr
    assert late.read_text() == "written"  # the non-daemon thread was joined
    assert done.stdout == "no newline hook ran "  # buffered output flushed, the hook ran
    assert "torn down" not in done.stdout  # no interpreter teardown
    assert ("refused: one clear line" in done.stderr) == (how == "exit-text")


def test_a_fatal_signal_prints_every_threads_stack(tmp_path: Path) -> None:
    script = "import os, signal\nfrom neuroshard.cli.process import run_command\n"
    script += "run_command(lambda: os.kill(os.getpid(), signal.SIGSEGV))\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -11
    assert "Fatal Python error: Segmentation fault" in done.stderr and "<lambda>" in done.stderr


def test_a_stop_signal_raised_again_after_a_graceful_shutdown_ends_through_the_command() -> None:
    """What uvicorn does: it takes SIGTERM over while serving, restores the previous handler once
    it has stopped and raises the signal again. Inside `stop_signals_exit` that is an exit with
    status 0 through `run_command` (no teardown), not death by the signal."""
    script = textwrap.dedent(
        """
        import signal
        from neuroshard.cli.process import run_command, stop_signals_exit

        class Teardown:
            def __del__(self):
                print("torn down", flush=True)

        KEPT = Teardown()

        def serve():
            caught = []
            previous = signal.signal(signal.SIGTERM, lambda s, f: caught.append(s))
            signal.raise_signal(signal.SIGTERM)  # the stop request, while serving
            signal.signal(signal.SIGTERM, previous)  # stopped gracefully: handlers restored
            for s in caught:
                signal.raise_signal(s)
            print("after the signal")

        def main():
            with stop_signals_exit():
                serve()
            return 3

        run_command(main)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""


def test_neuroshard_verifier_stopped_by_sigterm_ends_with_status_0(published, tmp_path: Path) -> None:
    """The real thing: uvicorn shuts down gracefully on SIGTERM and raises it again; the verifier
    ends through run_command with status 0 instead of dying at the signal (-15)."""
    from neuroshard.node.model import ModelConfig
    from neuroshard.swarm.verifier import start_swarm_verifier
    from neuroshard.testing.ports import free_port

    model = ModelConfig.named("micro", vocab_size=published.dataset.tokenizer.vocab_size)
    tables = {
        "name": "process-test",
        "model": model.to_dict(),
        "diloco": {"inner_steps": 4, "warmup_steps": 1, "total_steps": 100},
        "training": {"batch_size": 2, "seq_len": 32},
        "data": {"manifest_url": str(published.directory), "publisher_key": published.public_key_hex},
        "evaluation": {"every_rounds": 1, "held_out_shard": 0},
    }
    verifier = start_swarm_verifier(tmp_path / "verifier", tables, free_port(), None)
    verifier.stop(grace_s=30.0)  # SIGTERM
    log = verifier.log_path.read_text()
    assert verifier.process.returncode == 0, log[-3000:]
    assert "Finished server process" in log and "Traceback" not in log, log[-3000:]


def test_a_stopped_embedded_verifier_leaves_the_loggers_as_it_found_them() -> None:
    """Its lines go to the node's output while it runs; once stopped, a later verifier in the same
    process (tests run many) must not print through it (CI saw a check's captured output begin with
    another test's verifier lines)."""
    import logging

    from neuroshard.cli import embedded

    lines: list[str] = []
    handler = embedded._ToNodeLog(lines.append)
    handler.started()
    for name in embedded.ROUTED:
        embedded._route_to(name, handler, logging.INFO)
    logging.getLogger("neuroshard.verifier.leader").info("routed")
    embedded._unroute()
    logging.getLogger("neuroshard.verifier.leader").info("not routed")
    assert lines == ["verifier: routed"]
    for name in embedded.ROUTED:
        logger = logging.getLogger(name)
        assert logger.propagate and not any(isinstance(h, embedded._ToNodeLog) for h in logger.handlers)
