"""How the long-running commands end their process: every thread of ours done, then out without
the interpreter's teardown.

A node or verifier runs torch on threads besides the main one (the checkpoint writer, the
round-log hasher, the verifier's evaluator and replay checker, uvicorn's worker threads). A
thread that ran torch code may still be tearing down its native thread-local state after
`Thread.join` has returned, and if the main thread is by then finalizing the interpreter, that
teardown takes the GIL of a dying interpreter: the process dies of SIGSEGV or SIGABRT after its
work is done (PyTorch issue 117762, still open). CI saw it once: `neuroshard-node --max-steps 120`
printed its last line and exited with -11.

`run_command` lets Python's exit run as far as it is safe: the non-daemon threads are joined
(thread pools such as the segment writer's and the bucket's uploads finish what they hold),
then the exit hooks registered while the command ran, and then, before the interpreter starts
finalizing, the process ends with `os._exit`. Everything a command promises is durable before
that point: checkpoints are written atomically and joined, database commits come before their
acknowledgements. Hooks registered before the command started (at import: torch's, and the one
that runs `weakref.finalize` objects at exit) do not run; nothing of ours relies on them.

The verifier's servers are stopped by signals, which uvicorn raises again after its graceful
shutdown: `stop_signals_exit` turns them into an ordinary exit, so it ends this way too. A fatal
signal in any thread prints every thread's Python stack to stderr (faulthandler), so a crash
leaves more than an exit code.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import NoReturn


@contextlib.contextmanager
def stop_signals_exit() -> Iterator[None]:
    """While inside (on the main thread): SIGTERM and SIGINT raise SystemExit(0). A server that
    takes the signals over while it serves and raises the one it caught again after its graceful
    shutdown (uvicorn does) then ends through `run_command`, with status 0 as a stopped node
    does, instead of dying at the signal before any of it; one that arrives before the server
    took them over stops the command the same way."""

    def stop(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(0)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def exit_status(code: object) -> int:
    """The status `sys.exit(code)` gives the process: None is 0, an int is itself, anything else
    is printed to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _end(status: list[int]) -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing more to say there
            stream.flush()
    os._exit(status[0])


def run_command(main: Callable[[], int]) -> NoReturn:
    """Run a console command's `main` and end the process with its status as described above.
    An exception other than SystemExit propagates as usual (traceback, status 1, normal teardown):
    that path is already a failure, and its traceback matters more."""
    faulthandler.enable()
    # Exit hooks run last-registered first: registered before main runs, this one runs after every
    # hook main registers, and after Python has joined the non-daemon threads (done before any hook).
    status = [1]
    atexit.register(_end, status)
    try:
        try:
            status[0] = exit_status(main())
        except SystemExit as exc:  # argparse's refusals, sys.exit in main
            status[0] = exit_status(exc.code)
    except BaseException:
        atexit.unregister(_end)
        raise
    sys.exit(status[0])
