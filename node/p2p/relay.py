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

**The verifier's challenges** travel the same way. Where it would GET ``/p2p/{route}`` from a
replica's port (a segment, a round's log, a round's replay material: ``node.p2p.replay``), the
verifier PUTs ``PREFIX/_check/{holder}/{route}`` holding its signed headers for
``GET /p2p/relay-check/{holder}/{route}``: a path no port serves (so the headers, which every
replica can read in the bucket, are no request to any replica's server) that names the holder
(so a challenge to one replica is no challenge to another), fresh within ±60 s: it writes it
again on every try. The holder LISTs
``PREFIX/_check/{itself}/`` every gossip interval (one request, whatever the stage's size), checks
each new challenge as its server checks a request (signature, freshness, a nonce not seen before,
the operator's key) and uploads what its server would have answered to
``PREFIX/{itself}/check/{route}`` (`serve_challenges`; at most CHALLENGES_PER_PASS a pass). The
verifier deletes its challenge once it has read the answer (or ends the check; a restarted verifier
deletes every challenge left), and the holder then deletes its answer (a restarted holder, on its
first pass, deletes the answers its last run left whose challenges are gone, and keeps the rest
without uploading them again). The answer is judged against
the holder's signed receipt like one over HTTP, so the bucket changes nothing about what can be
proven; a challenge not answered within the verifier's answer window (lengthened for the upload)
fails like an unreachable port (verifier.replaycheck). Only the verifier may write under
``PREFIX/_check/``: a replica that could would overwrite or delete the challenges to another (and
get it failed as silent), so the stage's set-up gives replicas write access to their own prefix and
``_want/`` alone (``bucket.py``).

Replicas with an open port join a mixed stage by being given the same ``--relay`` URL as well:
they serve their own objects over HTTP and read the relay replicas' from the bucket
(``outer.port.RoutedStore``).

**Pipeline stages** behind NAT take their micro-batches through the same bucket: the replicas of
the stage before put signed requests for them under ``_pipe/`` and read the answers back
(``mailbox.py``). A relay replica *sends* micro-batches to next-stage replicas with a port over
HTTP, as any outbound connection.
"""

from __future__ import annotations

import asyncio
import json
import re
import struct
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, runtime_checkable

from neuroshard.protocol.peer import StateInfo
from neuroshard.protocol.refusal import REPLAYED, Refused, malformed
from neuroshard.protocol.signing import FRESHNESS_WINDOW_S, NonceCache, verify_request

from ..outer.port import check_name, check_wallet, object_name
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
CHECK = "check"
"""Where a holder's answers live, under its own prefix (``{holder}/check/{route}``)."""
CHALLENGE_PREFIX = "_check"
"""Where the verifier's challenges live (``_check/{holder}/{route}``): the verifier's alone to write."""
CHALLENGE_NAME = re.compile(r"^(segment/\d{1,16}/\d{1,16}|segment-log/\d{1,16}|replay/\d{1,16})$")
"""The routes a challenge may name (node.p2p.replay); other keys are not even read."""
ROUTE_PREFIX = "/p2p/"
CHALLENGE_BYTES = 4096
"""Cap on a challenge object read (the four signed headers as JSON: ~0.3 KB)."""
CHALLENGES_PER_PASS = 4
"""New challenges answered per gossip interval (a check asks for its drawn segments and the last at once)."""
RETRY_REFUSED_S = 15.0
"""How long a challenge that could not be answered (stale, badly signed, not held) is left alone."""


@runtime_checkable
class Answerer(Protocol):
    """A server extension whose GET routes a relay replica can answer through its bucket."""

    async def answer(self, path: str, peer_wallet: str) -> bytes | None:
        """The body GET `path` serves `peer_wallet`; None for a path not its own; Refused otherwise."""


def challenge_name(path: str) -> str:
    """``/p2p/segment/3/1`` → ``segment/3/1``: the bucket name of a challenge of GET `path`;
    ValueError for a path no relay answers."""
    name = path.removeprefix(ROUTE_PREFIX)
    if not path.startswith(ROUTE_PREFIX) or not CHALLENGE_NAME.match(name):
        raise ValueError(f"{path[:60]!r} is not a route a relay answers through its bucket")
    return name


def challenge_key(holder: str, name: str) -> str:
    """Where, under the bucket's PREFIX, the verifier puts its challenge `name` to `holder`."""
    return f"{CHALLENGE_PREFIX}/{check_wallet(holder)}/{check_name(name)}"


def challenge_request(name: str, holder: str) -> str:
    """The path a challenge's signature covers: the route, and the holder it is meant for."""
    return f"{ROUTE_PREFIX}relay-check/{check_wallet(holder)}/{check_name(name)}"


def answer_name(name: str) -> str:
    """The holder's object answering challenge `name` (under its own wallet's prefix)."""
    return f"{CHECK}/{check_name(name)}"


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
        self._answered: set[str] = set()
        """Challenges answered whose challenge object is still there (the answer is kept until then)."""
        self._swept = False
        """Whether the answers an earlier run of this replica left were looked at (`serve_challenges`)."""
        self._refused: dict[str, float] = {}
        """Challenge → when it may be read again, for challenges that could not be answered."""
        self._nonces = NonceCache(FRESHNESS_WINDOW_S)
        """The verifier's nonces seen: a challenge object written again unchanged is a replay."""

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

    async def serve_challenges(self, answerers: Sequence[Answerer], clock: Callable[[], float]) -> None:
        """Answer the verifier's new challenges under ``_check/{itself}/`` (module docstring), and
        delete the answers whose challenge the verifier has removed."""
        base = f"{CHALLENGE_PREFIX}/{self.own}/"
        try:
            names, _ = await self.store.list_under(base, max_keys=MAX_LISTED)
        except RelayError as exc:
            self.log(f"bucket: cannot read the verifier's challenges: {exc}")
            return
        waiting = {n for n in names if CHALLENGE_NAME.match(n)}
        if not self._swept:
            await self._sweep(waiting)
        for name in sorted(self._answered - waiting):  # read and released by the verifier
            await self.store.delete(answer_name(name))
            self._answered.discard(name)
        now = clock()
        self._refused = {n: t for n, t in self._refused.items() if t > now and n in waiting}
        new = [n for n in sorted(waiting) if n not in self._answered and n not in self._refused]
        for name in new[:CHALLENGES_PER_PASS]:
            try:
                body = await self._answer(answerers, base, name, clock())
                await self.store.publish(answer_name(name), body)
            except Exception as exc:  # Refused, RelayError, or an answerer's own failure
                self._refused[name] = clock() + RETRY_REFUSED_S
                why = (
                    f"{exc.code}: {exc.detail}"
                    if isinstance(exc, Refused)
                    else f"{type(exc).__name__}: {exc}"
                )
                self.log(f"bucket: challenge {name} not answered: {why}")
                continue
            self._answered.add(name)
            self.log(f"bucket: answered the verifier's challenge {name} ({len(body)} bytes)")

    async def _sweep(self, waiting: set[str]) -> None:
        """Once a run: the answers an earlier run left (its `_answered` died with it). Those whose
        challenge still waits are kept and not uploaded again; the rest are deleted now rather
        than when the bucket's lifecycle rule expires them."""
        try:
            held, _ = await self.store.list_under(f"{self.own}/{CHECK}/", max_keys=MAX_LISTED)
        except RelayError as exc:
            self.log(f"bucket: cannot list the answers an earlier run left: {exc}")
            return
        self._swept = True
        for name in sorted(held):
            if name in waiting:
                self._answered.add(name)
            else:
                await self.store.delete(answer_name(name))

    async def _answer(self, answerers: Sequence[Answerer], base: str, name: str, now: float) -> bytes:
        """What this replica's server would answer the signed request in challenge `name`; Refused
        as the server would refuse it (stale, badly signed, replayed, not the verifier, not held)."""
        raw = await self.store.get_shared(base + name, CHALLENGE_BYTES)
        if raw is None:
            raise malformed("the challenge object is gone, too large or unreadable")
        try:
            headers = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise malformed(f"the challenge is not JSON: {exc}") from None
        if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
            raise malformed("the challenge is not a JSON object of header strings")
        signed = verify_request(headers, "GET", challenge_request(name, self.own), b"", now=now)
        if not self._nonces.add(signed.public_key_hex, signed.nonce, signed.timestamp, now):
            raise Refused(REPLAYED, f"nonce {signed.nonce} was already used by this wallet")
        path = ROUTE_PREFIX + name
        for answerer in answerers:
            body = await answerer.answer(path, signed.public_key_hex)
            if body is not None:
                return body
        raise Refused("unknown_route", f"no route GET {path}")
