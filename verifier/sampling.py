"""Which receipts a spot check picks: a fixed share that no replica can predict.

A replica that could tell which of its rounds will be checked would lie in the others, so
the pick must depend on something only the verifier holds. It is the operator's Ed25519
signature over (check, wallet, stage, round), hashed to 64 bits and compared with the rate.
Ed25519 signatures are deterministic (RFC 8032, section 5.1.6), so a verifier makes the same
picks after a restart, and the operator could later publish a signature to show that a pick
was fair. Without the operator's key, a pick looks random.

A receipt is stored before it is sampled. When a replica learns it was picked, its claim
for that round is already signed and committed, so the knowledge comes too late to help it.
"""

from __future__ import annotations

import hashlib

from neuroshard.node.wallet import Wallet

_CONTEXT = "neuroshard/spot-check-sample/v1"


def sampled(operator: Wallet, check: str, wallet_id: str, stage: int, round_: int, rate: float) -> bool:
    """Whether spot check `check` ("data", "replay") picks this receipt; about `rate` of them are."""
    return draw(operator, check, wallet_id, stage, round_) < rate * 2**64


def draw(operator: Wallet, check: str, *fields: object) -> int:
    """A 64-bit number for (check, fields) that nobody without the operator's key can predict:
    the operator's signature over them, hashed. Sorting by it orders things as a fair lottery."""
    text = ":".join([_CONTEXT, check, *map(str, fields)])
    signature = operator.sign(text.encode())
    return int.from_bytes(hashlib.sha256(signature).digest()[:8], "big")
