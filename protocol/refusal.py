"""`Refused`: the one error for a message or request that is not accepted, on every boundary.

A refusal is a short machine-readable `code` and a sentence (`detail`) naming the value, what
was expected and where it sat. It carries no HTTP status: the servers choose the status from
the code, each in its adapter (``neuroshard.node.p2p.auth.STATUS`` for the peer plane,
``neuroshard.api.refusals.STATUS`` for the verifier), and clients map a status back to a code
where the reply carries none. Bookkeeping code (parsers, ledgers, stores) only says *why*.

Codes shared by both sides (others are local to one server and listed in its table):

- ``malformed``      not the schema: bad JSON, unknown or missing fields, wrong types, bad hex
- ``invalid``        well-formed, but a value is out of range or inconsistent
- ``unsigned``       a request without its signature headers
- ``bad_auth``       signature headers of the wrong shape
- ``stale``          a request timestamp outside the freshness window
- ``bad_signature``  a signature that does not verify
- ``replayed``       a nonce this wallet already used inside the window
- ``busy``           the receiver cannot take it now (retry later)
- ``too_large``      a body over the route's limit
- ``unknown_wallet`` a wallet the receiver does not know (not registered)
"""

from __future__ import annotations

MALFORMED = "malformed"
INVALID = "invalid"
UNSIGNED = "unsigned"
BAD_AUTH = "bad_auth"
STALE = "stale"
BAD_SIGNATURE = "bad_signature"
REPLAYED = "replayed"
BUSY = "busy"
TOO_LARGE = "too_large"
UNKNOWN_WALLET = "unknown_wallet"

MAX_DETAIL_CHARS = 2000


class Refused(ValueError):
    """A message or request the receiver will not take: `code` says why for machines, `detail` for people.

    `retry_after_s`: when the refuser said how long to wait before asking again (rate limits)."""

    def __init__(self, code: str, detail: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.retry_after_s = retry_after_s

    def __repr__(self) -> str:
        return f"Refused({self.code!r}, {self.detail[:80]!r})"


def malformed(detail: str) -> Refused:
    """Not the schema (bad JSON, unknown or missing fields, wrong types, bad hex)."""
    return Refused(MALFORMED, detail)


def invalid(detail: str) -> Refused:
    """Well-formed, but a value is out of range or inconsistent."""
    return Refused(INVALID, detail)
