"""Owners and contributors that cheat the partitioned round (module docstring of the package).

- ``WrongAggregate``: signs an aggregate of its own making for the parts it owns (a scaled one).
- ``Equivocator``: publishes one claim, then replaces it with a second, different signed claim
  once some replicas have read the first (an S3 object overwritten; an HTTP server answering
  differently): two signed claims for one part.
- ``SplitEquivocator``: signs an honest and a forged claim for each part it owns and publishes
  both (the forged one as ``claim-b``) for a carrier that answers each reader with one or the
  other, or with nothing (an HTTP server picking by who asks; tests route readers).
- ``Withholder``: commits and contributes, but never publishes the aggregates it owns.
- ``MismatchedPart``: publishes a Δ object whose parts do not match the root it signed.
"""

from __future__ import annotations

import asyncio

import torch

from neuroshard.node.outer.reduce import anchored_delta_object, decode_part, delta_object, encode_part
from neuroshard.node.outer.round import OuterRound
from neuroshard.node.outer.state import Held
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.identity import sha256_hex
from neuroshard.protocol.round import AggregateClaim


def forge_claim(wallet: Wallet, held: Held, j: int, scale: float) -> tuple[AggregateClaim, bytes]:
    """A second claim for part j, signed by `wallet`: the same fields as its honest claim, naming
    `scale` × the honest aggregate; with the forged aggregate's bytes."""
    honest = held.claims[j]
    a, b = held.bounds[j]
    forged = encode_part(decode_part(held.aggregates[j], honest.encoding, b - a) * scale, honest.encoding)
    fields = {
        k: v for k, v in honest.to_obj().items() if k not in ("wallet", "signature", "aggregate_sha256")
    }
    return AggregateClaim.create(wallet, **fields, aggregate_sha256=sha256_hex(forged)), forged


class WrongAggregate(OuterRound):
    """Honest everywhere but in the parts it owns: it publishes -3 × the true aggregate."""

    scale = -3.0

    async def _reduce(self, held: Held, j: int, replaces: str) -> None:
        await super()._reduce(held, j, replaces)
        claim, forged = forge_claim(self.wallet, held, j, self.scale)
        await self.store.publish(self._agg_name(held.inp, j, claim.aggregate_sha256), forged)
        await self.store.publish(self._name(held.inp, "claim", j), claim.to_json())
        held.claims[j], held.aggregates[j] = claim, forged


class Equivocator(OuterRound):
    """Publishes its honest claim, waits (`delay_s` by default), then overwrites it with a forged one."""

    delay_s = 0.05

    async def _before_switch(self, j: int) -> None:
        """When the claim of part j is overwritten: after `delay_s` (a test may wait for a reader)."""
        await asyncio.sleep(self.delay_s)

    async def _after_switch(self, j: int) -> None:
        """Called once the second claim of part j is published."""

    async def _reduce(self, held: Held, j: int, replaces: str) -> None:
        await super()._reduce(held, j, replaces)
        second, forged = forge_claim(self.wallet, held, j, 2.0)

        async def switch() -> None:
            await self._before_switch(j)
            await self.store.publish(self._agg_name(held.inp, j, second.aggregate_sha256), forged)
            await self.store.publish(self._name(held.inp, "claim", j), second.to_json())
            await self._after_switch(j)

        held.tasks = getattr(held, "tasks", [])
        held.tasks.append(asyncio.create_task(switch()))


class SplitEquivocator(OuterRound):
    """Two signed claims per owned part, both aggregates published (by hash); which claim a reader
    gets is the carrier's choice: ``claim/j`` is the honest one, ``claim-b/j`` the forged one."""

    async def _reduce(self, held: Held, j: int, replaces: str) -> None:
        await super()._reduce(held, j, replaces)
        second, forged = forge_claim(self.wallet, held, j, 2.0)
        await self.store.publish(self._agg_name(held.inp, j, second.aggregate_sha256), forged)
        await self.store.publish(self._name(held.inp, "claim-b", j), second.to_json())


class Withholder(OuterRound):
    """Never publishes the aggregates of the parts it owns (its own contribution stays honest)."""

    async def _reduce_owned(self, held: Held) -> None:
        return None


class MismatchedPart(OuterRound):
    """Signs the root of its honest Δ, then publishes a Δ object with every part negated."""

    async def _scatter(self, held: Held) -> None:
        if held.inp.anchor is not None:
            forged, _, _ = anchored_delta_object(
                -held.inp.delta, held.bounds, self.config.encoding, held.inp.anchor
            )
        else:
            forged, _ = delta_object(-held.inp.delta, held.bounds, self.config.encoding)
        held.delta_bytes = forged
        await self.store.publish(self._name(held.inp, "delta"), forged)


def flip_sign(delta: torch.Tensor) -> torch.Tensor:
    """A contribution attack for the simulator: -4 × the honest Δ (caught by per-part screening)."""
    return -4.0 * delta
