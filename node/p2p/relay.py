"""The peer plane of a replica behind NAT: what its server would answer, read from the stage bucket.

A replica started with ``--relay s3://BUCKET/PREFIX`` and no ``--port`` accepts no connections.
Everything another replica would GET from its server it PUTs under its own prefix of the bucket
(``bucket.BucketStore``), and readers GET it from there:

| what (server route)      | object, under ``PREFIX/{wallet}/``  | written                               |
|--------------------------|-------------------------------------|---------------------------------------|
| peer list (GET /p2p/peers)  | ``ctl/peers``                    | every gossip interval (own record first, so it stays fresh) |
| status (GET /p2p/status)    | ``ctl/status``                   | whenever its state changes            |
| state (GET /p2p/state)      | ``{stage}/{round}/state``        | only when asked (below), once a round |
| round objects (GET /p2p/obj) | ``{stage}/{round}/…``            | by the round (``outer.round``)         |

State is 8 bytes per parameter (θ and the outer momentum): uploading it every round would cost four
times the round itself, and it is needed only by a replica that joins or lost the θ-hash vote. So a
reader asks first: it PUTs an empty ``PREFIX/_want/{holder}/{round}/{reader}``, and the holder,
which LISTs ``PREFIX/_want/{itself}/{its round}/`` every gossip interval (one request, whatever
the stage's size), uploads its state for that round once. Anyone with write access to ``_want``
can make a holder upload its state at most once a round; nothing else.

A relay replica's peer record carries the address ``{wallet[:16]}.relay.invalid:1``: ``.invalid`` is
reserved (RFC 2606) and never resolves, so nobody dials it by mistake, and `is_relay` tells every
reader to go to the bucket instead. Nothing read here is trusted more than over HTTP: peer records,
statuses and state are signed or hash-checked by the same code (``exchange``).

Replicas with an open port join a mixed stage by being given the same ``--relay`` URL as well:
they serve their own objects over HTTP and read the relay replicas' from the bucket
(``outer.port.RoutedStore``).
"""

from __future__ import annotations

import asyncio
import re
import struct
from collections.abc import Awaitable, Callable

from neuroshard.protocol.peer import StateInfo
from neuroshard.protocol.refusal import Refused, malformed

from ..outer.port import check_wallet, object_name
from .bucket import BucketStore, RelayError

RELAY_SUFFIX = ".relay.invalid"
PEERS_OBJECT = "ctl/peers"
STATUS_OBJECT = "ctl/status"
STATUS_BYTES = 4096
"""Cap on a status object read (a signed StateInfo is < 1 KB)."""
STATE_WAIT_SLICE_S = 5.0
"""How often a reader waiting for a requested state checks whether its holder moved on."""
WANT_PREFIX = "_want"
STATE_HEADER = struct.Struct(">I")
"""A state object: 4-byte length of the signed StateInfo JSON, the JSON, then the safetensors body."""
WALLET = re.compile(r"^[0-9a-f]{64}$")
MAX_LISTED = 1000
"""One LIST page: the most wallets discovered from the bucket per gossip interval."""


def relay_address(wallet: str) -> str:
    """The never-dialled address in a relay replica's peer record."""
    return f"{check_wallet(wallet)[:16]}{RELAY_SUFFIX}:1"


def is_relay(address: str | None) -> bool:
    return address is not None and address.rpartition(":")[0].endswith(RELAY_SUFFIX)


def encode_state_object(info: StateInfo, body: bytes) -> bytes:
    header = info.to_json()
    return STATE_HEADER.pack(len(header)) + header + body


def decode_state_object(data: bytes) -> tuple[StateInfo, bytes]:
    """(signed info, safetensors body) of a state object; Refused if it is not one."""
    if len(data) < STATE_HEADER.size:
        raise malformed("state object shorter than its header")
    (length,) = STATE_HEADER.unpack_from(data)
    end = STATE_HEADER.size + length
    if length > 64 << 10 or end > len(data):
        raise malformed(f"state object header of {length} bytes does not fit")
    return StateInfo.from_json(data[STATE_HEADER.size : end]), data[end:]


class RelayControl:
    """Reads the control objects of relay replicas, and (for a relay replica) writes its own."""

    def __init__(self, store: BucketStore, stage: int, log: Callable[[str], None]) -> None:
        self.store = store
        self.stage = stage
        self.log = log
        self._served_round = -1

    @property
    def own(self) -> str:
        return self.store.wallet

    # --- reading other replicas -----------------------------------------------------------------

    async def read(self, wallet: str, name: str, max_bytes: int, wait_s: float = 0.0) -> bytes | None:
        return await self.store.fetch(wallet, name, max_bytes=max_bytes, wait_s=wait_s)

    async def fetch_state(self, wallet: str, round_: int, max_bytes: int, wait_s: float) -> bytes | None:
        """Ask `wallet` for its state of `round_`, then wait for it; the raw state object or None."""
        name = object_name(self.stage, round_, "state")
        data = await self.store.fetch(wallet, name, max_bytes=max_bytes)
        if data is not None:
            return data
        try:
            await self.store.put_shared(f"{WANT_PREFIX}/{check_wallet(wallet)}/{round_}/{self.own}", b"")
        except RelayError as exc:
            self.log(f"bucket: cannot ask {wallet[:12]} for its state: {exc}")
            return None
        # A holder uploads the state of the round it is in when it sees the request; one that has
        # moved on never will. Wait in slices and give up once its signed status shows a later
        # round, so the caller asks again with a newer vote instead of waiting out `wait_s` (the
        # state timeout: 10 minutes by default) for an upload that cannot come.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            left = deadline - loop.time()
            data = await self.store.fetch(
                wallet, name, max_bytes=max_bytes, wait_s=max(0.0, min(STATE_WAIT_SLICE_S, left))
            )
            if data is not None or left <= STATE_WAIT_SLICE_S:
                return data
            moved = await self.status_round(wallet)
            if moved is not None and moved > round_:
                self.log(f"bucket: {wallet[:12]} moved on to round {moved} before serving round {round_}")
                return None

    async def status_round(self, wallet: str) -> int | None:
        """The round in `wallet`'s signed status in the bucket, or None if absent or not valid."""
        raw = await self.store.fetch(wallet, STATUS_OBJECT, max_bytes=STATUS_BYTES)
        try:
            info = StateInfo.from_json(raw) if raw is not None else None
        except Refused:
            return None
        if info is None or info.wallet != wallet or info.stage != self.stage or not info.signature_valid():
            return None
        return info.round

    async def wallets(self) -> list[str]:
        """Wallets with a prefix in the bucket (one LIST page): how relay replicas find each other
        when no replica with an open port is there to gossip through."""
        try:
            _, prefixes = await self.store.list_under("", delimiter="/", max_keys=MAX_LISTED)
        except RelayError as exc:
            self.log(f"bucket: cannot list the stage's wallets: {exc}")
            return []
        return [w for w in prefixes if WALLET.match(w) and w != self.own]

    # --- writing this replica's -----------------------------------------------------------------

    async def put(self, name: str, data: bytes) -> None:
        await self.store.publish(name, data)

    async def serve_wanted(
        self, round_: int, state: Callable[[], Awaitable[tuple[StateInfo, bytes]]]
    ) -> None:
        """Upload this replica's state for `round_` once, if some reader asked for it."""
        if round_ <= self._served_round:
            return
        try:
            asked, _ = await self.store.list_under(f"{WANT_PREFIX}/{self.own}/{round_}/", max_keys=1)
        except RelayError as exc:
            self.log(f"bucket: cannot read state requests: {exc}")
            return
        if not asked:
            return
        info, body = await state()
        if info.round != round_:
            return
        self._served_round = round_
        await self.store.publish(object_name(self.stage, round_, "state"), encode_state_object(info, body))
        self.log(f"bucket: state of round {round_} uploaded for a reader that asked")
