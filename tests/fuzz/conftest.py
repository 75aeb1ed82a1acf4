"""Counts for the fuzz tests: inputs tried and how each decoder answered, per decoder.

Every test in tests/fuzz takes the session's `tally` and records one outcome per generated
input: "2xx" (accepted: the input happened to be valid), "4xx" (refused the way the protocol
says: a protocol Refused or an HTTP 4xx), "5xx" (anything else: an
unexpected exception or an HTTP 5xx; each test also fails on it). The table is printed at
the end of the run, so `pytest tests/fuzz -q` gives the figures for bench/RESULTS.md.
"""

from collections import Counter
from collections.abc import Iterator

import pytest

OUTCOMES = ("2xx", "4xx", "5xx")


class Tally:
    def __init__(self) -> None:
        self.counts: dict[str, Counter[str]] = {}

    def add(self, decoder: str, status: int) -> None:
        """One input answered with HTTP-like `status` (an exception-based decoder maps its refusal
        to the status it would answer with, and an unexpected exception to 500)."""
        outcome = "2xx" if status < 400 else "4xx" if status < 500 else "5xx"
        self.counts.setdefault(decoder, Counter())[outcome] += 1

    def lines(self) -> list[str]:
        rows = [f"{'decoder':<50} {'tried':>7} {'2xx':>7} {'4xx':>7} {'5xx':>5}"]
        total: Counter[str] = Counter()
        for decoder in sorted(self.counts):
            c = self.counts[decoder]
            total.update(c)
            rows.append(f"{decoder:<50} {sum(c.values()):>7} {c['2xx']:>7} {c['4xx']:>7} {c['5xx']:>5}")
        rows.append(
            f"{'all':<50} {sum(total.values()):>7} {total['2xx']:>7} {total['4xx']:>7} {total['5xx']:>5}"
        )
        return rows


_TALLY = Tally()


@pytest.fixture(scope="session")
def tally() -> Iterator[Tally]:
    yield _TALLY


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _TALLY.counts:
        terminalreporter.section("fuzz: inputs tried and answers, per decoder")
        for line in _TALLY.lines():
            terminalreporter.write_line(line)
