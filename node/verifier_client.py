"""The node's side of the verifier: the signed run definition, registration, heartbeats, receipts.

`neuroshard-node --join http://verifier:8000` first fetches GET /api/network and checks
the operator's signature (`fetch_network`) against a pinned key (--operator-key) or, on
first contact, trusts the served key and remembers it under HOME/verifiers/ so a later
swap is refused (trust on first use). Then a `VerifierClient` thread registers the wallet,
heartbeats, reads GET /api/peers?stage= for discovery and submits the round receipts
(node.receipt) queued by the training thread.

The verifier is a witness, not a dependency: every call here runs on the tracker's own
thread, failures are logged once per outage and retried, receipts wait in a bounded queue
(the oldest is dropped when it is full), and training never waits for any of it.

Requests are signed exactly like peer requests (protocol.signing), and their bodies are the
protocol's messages (protocol.reports). The token is never sent: only signatures. A refusal
comes back as ``Refused`` with the verifier's code (its reply's ``error``; for a reply without
one, a code from the HTTP status); an unreachable verifier as `VerifierUnreachable`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from typing import Any, TypeAlias

from neuroshard.protocol import refusal
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.reports import HeartbeatRequest, Receipt, RegisterRequest
from neuroshard.protocol.roster import MemberList, RosterError, solve_pow
from neuroshard.protocol.signing import sign_request

from .network_definition import (
    NETWORK_SIGNATURE_HEADER,
    OPERATOR_HEADER,
    NetworkDefinition,
    NetworkError,
    verify_network,
)
from .wallet import Wallet

Log = Callable[[str], None]
Progress = Callable[[], tuple[int, int]]
"""(round, inner steps in the round): what a heartbeat reports."""

_KEY = re.compile(r"[0-9a-f]{64}")


class VerifierUnreachable(NetworkError):
    """No answer from the verifier (and no saved definition to fall back on): worth retrying."""


Body: TypeAlias = RegisterRequest | HeartbeatRequest | Receipt

CODE_OF_STATUS = {401: refusal.BAD_AUTH, 403: "forbidden", 404: "not_found", 409: "conflict",
                  413: refusal.TOO_LARGE, 422: refusal.INVALID, 429: "rate_limited"}  # fmt: skip
"""The code of a refusal whose reply names none (a route FastAPI itself refused, an older verifier)."""
RECEIPT_REFUSED_FOR_GOOD = frozenset(
    {
        refusal.MALFORMED, refusal.INVALID, refusal.UNSIGNED, refusal.BAD_AUTH, refusal.STALE,
        refusal.BAD_SIGNATURE, refusal.REPLAYED, refusal.UNKNOWN_WALLET, "wallet_refused", "key_mismatch",
        "wrong_stage", "conflict", "forbidden",
    }
)  # fmt: skip
"""Refusals after which resending the same receipt cannot help: it is dropped."""
NOT_REGISTERED = frozenset({refusal.UNKNOWN_WALLET, "wallet_refused", "forbidden"})
"""Refusals that say this wallet must register (again) before its receipts can go."""


def _refusal(method: str, path: str, status: int, body: bytes, retry: str | None) -> Refused:
    code, detail = CODE_OF_STATUS.get(status, f"http_{status}"), body.decode("utf-8", "replace")
    try:
        reply = json.loads(body)
    except ValueError:
        reply = None
    if isinstance(reply, dict):
        code = reply["error"] if isinstance(reply.get("error"), str) else code
        detail = str(reply.get("detail", detail))
    return Refused(
        code,
        f"{method} {path}: HTTP {status}: {detail}",
        retry_after_s=float(retry) if retry and retry.isdigit() else None,
    )


def _base(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise NetworkError(f"--join needs an http(s):// URL, got {url!r}")
    return url.rstrip("/")


def _request(
    url: str, path: str, *, method: str = "GET", body: bytes | None = None, headers: dict[str, str] | None = None,
    timeout_s: float = 10.0, max_bytes: int = 1 << 20,
) -> tuple[bytes, Message]:  # fmt: skip
    request = urllib.request.Request(url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.read(max_bytes), reply.headers  # case-insensitive: servers lower-case names
    except urllib.error.HTTPError as exc:
        raise _refusal(method, path, exc.code, exc.read(2000), exc.headers.get("Retry-After")) from None
    except (OSError, ValueError) as exc:  # URLError, timeouts, refused connections, bad URLs
        raise VerifierUnreachable(f"{method} {path}: {exc}") from None


def checked_member_list(raw: bytes, stage: int, operator_key: str, network: str, *, now: float) -> MemberList:
    """A member list read from the verifier, checked: signed by the operator for this network,
    unexpired, of this stage. Raises Refused (malformed) or RosterError."""
    members = MemberList.from_json(raw)
    members.verify(operator_key, network=network, now=now)
    if members.stage != stage:
        raise RosterError(f"a member list of stage {members.stage}, not {stage}")
    return members


def fetch_member_list(
    url: str, stage: int, operator_key: str, network: str, *, timeout_s: float = 10.0
) -> MemberList:
    """GET the stage's member list once, checked (`checked_member_list`). Raises Refused,
    RosterError or VerifierUnreachable."""
    raw, _ = _request(_base(url), f"/api/stages/{stage}/members", timeout_s=timeout_s)
    return checked_member_list(raw, stage, operator_key, network, now=time.time())


def fetch_network(
    url: str, *, operator_key: str | None, known_keys: Path | None, log: Log, timeout_s: float = 10.0
) -> tuple[NetworkDefinition, str]:
    """GET /api/network, checked against `operator_key` (hex) or the key remembered for this URL.

    Returns (definition, operator public key hex). With neither a pinned key nor a
    remembered one, the served key is trusted and remembered (in `known_keys`, if given).
    The verified definition is saved there too: a node restarted while its verifier is
    down trains by the saved copy (signature checked again) instead of not at all.
    Raises NetworkError on a bad signature, a key that changed, or no answer and no copy.
    """
    base = _base(url)
    remembered = _remembered_key(known_keys, base)
    expected = operator_key or remembered
    try:
        body, headers = _request(base, "/api/network", timeout_s=timeout_s)
    except (Refused, VerifierUnreachable) as exc:
        saved = _saved_definition(known_keys, base, expected)
        if saved is None:
            raise VerifierUnreachable(f"cannot fetch the network definition from {base}: {exc}") from None
        log(f"verifier {base} unreachable ({exc}); training by its definition saved in {known_keys}")
        return saved, expected or ""
    served = headers.get(OPERATOR_HEADER, "")
    if expected is None:
        if not _KEY.fullmatch(served):
            raise NetworkError(f"{base} sent no valid {OPERATOR_HEADER} header")
        expected = served
        log(f"verifier {base}: trusting operator key {served} on first use")
    elif served and served != expected:
        where = "pinned with --operator-key" if operator_key else f"remembered in {known_keys}"
        raise NetworkError(
            f"{base} is signed by operator key {served[:16]}…, not the key {expected[:16]}… {where}"
        )
    if not _KEY.fullmatch(expected):
        raise NetworkError(f"operator key must be 64 lower-case hex characters, got {expected!r}")
    signature = headers.get(NETWORK_SIGNATURE_HEADER, "")
    definition = verify_network(body, signature, bytes.fromhex(expected))
    if known_keys is not None:  # only once the signature verified: a forgery is never remembered
        known_keys.mkdir(parents=True, exist_ok=True)
        if remembered is None:
            _key_file(known_keys, base).write_text(expected + "\n", encoding="ascii")
        copy = {"body": body.decode("utf-8"), "signature": signature}
        _definition_file(known_keys, base).write_text(json.dumps(copy), encoding="utf-8")
    return definition, expected


def _saved_definition(known_keys: Path | None, base: str, key: str | None) -> NetworkDefinition | None:
    if known_keys is None or key is None or not _definition_file(known_keys, base).exists():
        return None
    try:
        saved = json.loads(_definition_file(known_keys, base).read_text(encoding="utf-8"))
        return verify_network(saved["body"].encode("utf-8"), saved["signature"], bytes.fromhex(key))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable or tampered with: as good as none


def _definition_file(known_keys: Path, base: str) -> Path:
    return _key_file(known_keys, base).with_suffix(".network.json")


def _key_file(known_keys: Path, base: str) -> Path:
    return known_keys / (re.sub(r"[^A-Za-z0-9.\-]+", "_", base.split("://", 1)[1]) + ".operator")


def _remembered_key(known_keys: Path | None, base: str) -> str | None:
    if known_keys is None:
        return None
    path = _key_file(known_keys, base)
    return path.read_text(encoding="ascii").strip() if path.exists() else None


OPEN_MEMBERS_EVERY_S = 60.0
"""Seconds between member-list reads while the stage's policy is ``open`` (every wallet counts:
the list only says whether the operator changed the policy)."""


@dataclass(kw_only=True)
class VerifierClientConfig:
    url: str
    """Base URL of the verifier, e.g. http://127.0.0.1:8000."""
    address: str
    """host:port of this node's peer server (registered as http://host:port)."""
    stage: int = 0
    next_stage: bool = False
    """Also discover the replicas of stage + 1: a pipeline stage sends its micro-batches there."""
    neighbour_stages: tuple[int, ...] = ()
    """Stages whose member lists are read beside this one's (`on_neighbours`): a pipeline replica's
    neighbours, whose membership decides whom it sends micro-batches to and takes them from."""
    neighbours_every_s: float = 15.0
    """Seconds between reads of the neighbours' lists, one GET per stage (a cached read at the
    verifier, up to its few seconds' cache age): a wallet newly named there waits up to that, plus
    `p2p.pipeline.OUTSIDER_RETRY_S`, before this replica works with it."""
    software_version: str = "0.1.0"
    queue_size: int = 1024
    """Receipts kept while the verifier is unreachable (~1 KB each); the oldest is dropped beyond."""
    retry_s: float = 5.0
    """Pause after a failed call before the next attempt."""
    peers_every_s: float = 15.0
    """Seconds between peer-list reads (GET /api/peers?stage=) for discovery."""
    heartbeat_s: float = 30.0
    """Seconds between heartbeats until the verifier says otherwise (its TTL / 3)."""
    timeout_s: float = 10.0
    members_every_s: float = 5.0
    """Seconds between reads of the stage's signed member list (GET /api/stages/{stage}/members)."""
    members_waiting_s: float = 3.0
    """The same while this wallet is not admitted: a probationer (or a wallet that just registered)
    learns of its admission within seconds. The list is a cached read at the verifier."""
    operator_key: str | None = None
    """The verifier's (operator's) public key, hex: member lists signed by any other key are refused.
    None: member lists are not read (nothing could check them)."""
    network: str | None = None
    """The run's name (NetworkDefinition.name): what member lists and the registration proof of work
    are bound to."""
    receipt_splay: float = 0.5
    """A receipt waits before it is sent: this fraction of the time since the previous receipt was
    queued (about a round), times a share in [0, 1) fixed by the wallet and round (`splay_share`);
    the first receipt goes at once (the time before it holds the node's start and its joining, not
    a round).
    The replicas of a stage end their rounds at nearly the same time; without the wait a thousand
    receipts reach the verifier together and queue for its cores (bench/bench_verifier_writes.py,
    1,000 nodes ending each round within its first quarter: receipt p99 after the first round
    33–39 ms sent at once, 23–27 ms with the splay, on a quiet machine). 0 sends each at once (a
    node with its own embedded verifier: node.reporting). Receipts go oldest first, and an older
    one still waiting goes no later than a newer one is due, so after a long round (a stall) its
    long wait ends with the next round's receipt. Stopping the node sends what waits."""
    receipt_splay_max_s: float = 60.0
    """The most any receipt waits for the splay. Its window follows the time before it, so a stalled
    round makes it long; the next receipt's due time then cuts it short (above), which keeps a
    receipt well inside the 3 rounds of replay material a node keeps (node.replay)."""

    def __post_init__(self) -> None:
        self.url = _base(self.url)
        if (
            self.queue_size < 1
            or min(
                self.retry_s,
                self.peers_every_s,
                self.heartbeat_s,
                self.timeout_s,
                self.members_every_s,
                self.members_waiting_s,
                self.neighbours_every_s,
            )
            <= 0
        ):
            raise ValueError(f"VerifierClientConfig: queue_size must be ≥ 1 and every period > 0, got {self}")
        if not 0 <= self.receipt_splay <= 1 or self.receipt_splay_max_s < 0:
            raise ValueError(
                f"VerifierClientConfig: receipt_splay must be in [0, 1] and receipt_splay_max_s ≥ 0, "
                f"got {self.receipt_splay} and {self.receipt_splay_max_s}"
            )


def splay_share(public_key_hex: str, round_: int) -> float:
    """The share in [0, 1) of its splay window a wallet's receipt for `round_` waits: a hash of both,
    so a stage's receipts spread evenly over the window and a node's wait is reproducible."""
    digest = hashlib.sha256(f"neuroshard/receipt-splay\n{public_key_hex}\n{round_}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


class VerifierClient:
    """A thread that keeps this replica registered and its receipts delivered; never blocks training."""

    def __init__(
        self,
        config: VerifierClientConfig,
        wallet: Wallet,
        log: Log,
        *,
        progress: Progress = lambda: (0, 0),
        on_peers: Callable[[list[str]], None] | None = None,
        on_members: Callable[[MemberList], None] | None = None,
        on_neighbours: Callable[[MemberList], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.wallet = wallet
        self._log = log
        self._progress = progress
        self._on_peers = on_peers
        self._on_members = on_members
        self._members_failing = False
        self.members: MemberList | None = None
        """The newest valid member list of this replica's stage (epoch order; an older one replayed
        to this node is refused)."""
        self._on_neighbours = on_neighbours
        self.neighbour_members: dict[int, MemberList] = {}
        """The same for each of `config.neighbour_stages`."""
        self._neighbours_failing: set[int] = set()
        self._clock = clock
        self._queue: deque[tuple[float, Receipt]] = deque()
        """(monotonic time it may be sent, receipt), oldest first."""
        self._last_queued: float | None = None
        """When the previous receipt was queued: the splay's window is a share of the time since."""
        self._flushing = threading.Event()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registered = False
        self.delivered = 0
        """Receipts the verifier acknowledged (2xx: committed)."""
        self.dropped = 0
        """Receipts given up on: queue overflow, or refused by the verifier (4xx)."""
        self._failing = False

    # --- the training thread's side ---------------------------------------------------------

    def submit(self, receipt: Receipt) -> None:
        """Queue a receipt (node.receipt) for delivery after its splay (`receipt_splay`); returns at once."""
        now = time.monotonic()
        with self._lock:
            since = 0.0 if self._last_queued is None else now - self._last_queued
            window = min(self.config.receipt_splay * since, self.config.receipt_splay_max_s)
            self._last_queued = now
            due = now + window * splay_share(self.wallet.public_key_hex, receipt.round)
            # Sent oldest first, so an older receipt still waiting (a long round's long window)
            # goes no later than this one is due: nothing waits behind another past its own time.
            for i, (waiting_due, waiting) in enumerate(self._queue):
                if waiting_due > due:
                    self._queue[i] = (due, waiting)
            if len(self._queue) >= self.config.queue_size:
                _, old = self._queue.popleft()
                self.dropped += 1
                self._log(f"tracker: receipt queue full; dropped the receipt of round {old.round}")
            self._queue.append((due, receipt))
        self._wake.set()

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("VerifierClient already started")
        self._thread = threading.Thread(target=self._run, name="tracker", daemon=True)
        self._thread.start()

    def stop(self, flush_s: float = 5.0) -> None:
        """Try to deliver what is queued for up to `flush_s`, then end the thread: within `flush_s`
        plus a second in all, so a verifier that stopped answering cannot hold a node's exit for a
        request timeout more (the thread is a daemon; a receipt still in flight is not acknowledged)."""
        if self._thread is None:
            return
        deadline = time.monotonic() + flush_s
        self._flushing.set()  # what waits for its splay goes now
        while self.pending() and self.registered and time.monotonic() < deadline and self._thread.is_alive():
            self._wake.set()
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        self._thread = None

    # --- the tracker thread -----------------------------------------------------------------

    def _post(self, path: str, doc: Body) -> dict[str, Any]:
        body = doc.to_json()
        headers = sign_request(self.wallet, "POST", path, body, self._clock())
        headers["Content-Type"] = "application/json"
        raw, _ = _request(self.config.url, path, method="POST", body=body, headers=headers,
                          timeout_s=self.config.timeout_s)  # fmt: skip
        reply = json.loads(raw)
        return reply if isinstance(reply, dict) else {}

    def _register(self) -> None:
        cfg = self.config
        doc = RegisterRequest.checked(
            address=f"http://{cfg.address}", stage=cfg.stage, software_version=cfg.software_version
        )
        try:
            ack = self._post("/api/register", doc)
        except Refused as exc:
            if exc.code != "pow_required":
                raise
            ack = self._post("/api/register", dataclasses.replace(doc, pow_nonce=self._proof_of_work()))
        interval = ack.get("heartbeat_interval_s")
        if isinstance(interval, int | float) and interval > 0:
            self.config.heartbeat_s = float(interval)
        if not self.registered:
            self._log(
                f"tracker: registered with {cfg.url} as {self.wallet.wallet_id} (stage {cfg.stage}, "
                f"reputation {ack.get('reputation')})"
            )
        self.registered = True

    def _proof_of_work(self) -> int:
        """The registration proof of work the verifier asks a new wallet for (GET /api/admission):
        about 2^bits sha256 hashes, once per wallet and network."""
        raw, _ = _request(self.config.url, "/api/admission", timeout_s=self.config.timeout_s)
        terms = json.loads(raw)
        bits, network = terms.get("pow_bits"), terms.get("network")
        if not isinstance(bits, int) or not isinstance(network, str):
            raise VerifierUnreachable("the verifier's admission terms name no proof of work")
        self._log(f"tracker: registering a new wallet needs a proof of work of {bits} bits; solving it")
        started = time.monotonic()
        nonce = solve_pow(network, self.wallet.public_key_hex, bits)
        self._log(f"tracker: proof of work solved in {time.monotonic() - started:.1f} s")
        return nonce

    def _members(self) -> None:
        """Read the stage's member list; keep and hand on the newest one signed by the operator key."""
        cfg = self.config
        if cfg.operator_key is None or cfg.network is None or self._on_members is None:
            return
        try:
            members = self._newer_list(cfg.stage, self.members)
        except Refused as exc:
            if exc.code != "not_found":
                raise
            self._log(f"tracker: {cfg.url} serves no member lists ({exc}); every live peer counts")
            self._on_members = None  # an older verifier: stop asking
            return
        if members is not None:
            self.members = members
            self._on_members(members)

    def _read_neighbours(self) -> float:
        """Read the member lists of the pipeline neighbours (`config.neighbour_stages`) and hand on
        the newest of each; returns the seconds until the next read. A stage whose list cannot be
        read this time is logged, and the others are read all the same."""
        cfg = self.config
        if not cfg.neighbour_stages or self._on_neighbours is None:
            return math.inf
        if cfg.operator_key is None or cfg.network is None or self._on_members is None:
            return math.inf  # no key to check lists with, or a verifier that serves none
        for stage in cfg.neighbour_stages:
            try:
                members = self._newer_list(stage, self.neighbour_members.get(stage))
            except (Refused, VerifierUnreachable) as exc:
                if stage not in self._neighbours_failing:  # once an outage
                    self._log(f"tracker: stage {stage}'s member list not read: {exc}")
                self._neighbours_failing.add(stage)
                continue
            self._neighbours_failing.discard(stage)
            if members is not None:
                self.neighbour_members[stage] = members
                self._on_neighbours(members)
        return cfg.neighbours_every_s

    def _newer_list(self, stage: int, known: MemberList | None) -> MemberList | None:
        """`stage`'s member list, read and checked, when it is newer than `known`; None when it is
        not, or is refused (logged). Raises Refused and VerifierUnreachable from the read."""
        cfg = self.config
        assert cfg.operator_key is not None and cfg.network is not None
        raw, _ = _request(cfg.url, f"/api/stages/{stage}/members", timeout_s=cfg.timeout_s)
        try:
            members = checked_member_list(raw, stage, cfg.operator_key, cfg.network, now=self._clock())
            newer = members.newer_than(known)
        except (Refused, RosterError) as exc:
            self._log(f"tracker: stage {stage}'s member list refused: {exc}")
            return None
        return members if newer else None

    def _read_members(self) -> float:
        """`_members`, its failures logged once per outage; returns the seconds until the next read:
        soon while this wallet is not admitted, rarely under an ``open`` policy (nothing to wait for)."""
        try:
            self._members()
            self._members_failing = False
        except (Refused, VerifierUnreachable) as exc:
            if not self._members_failing:
                self._log(f"tracker: member list not read: {exc}")
            self._members_failing = True
        members = self.members
        if members is not None and members.policy == "open":
            return OPEN_MEMBERS_EVERY_S
        admitted = members is not None and self.wallet.public_key_hex in members.admitted
        return self.config.members_every_s if admitted else self.config.members_waiting_s

    def _heartbeat(self) -> None:
        round_, steps = self._progress()
        beat = HeartbeatRequest.checked(stage=self.config.stage, round=round_, steps_in_round=steps)
        self._post("/api/heartbeat", beat)

    def _peers(self) -> None:
        stages = [self.config.stage, self.config.stage + 1] if self.config.next_stage else [self.config.stage]
        peers: list[Any] = []
        for stage in stages:
            raw, _ = _request(self.config.url, f"/api/peers?stage={stage}", timeout_s=self.config.timeout_s)
            peers += json.loads(raw)
        own = f"http://{self.config.address}"
        addresses = [
            p["address"].split("://", 1)[1].rstrip("/")
            for p in peers
            if isinstance(p, dict) and isinstance(p.get("address"), str) and p["address"].rstrip("/") != own
        ]
        if self._on_peers is not None and addresses:
            self._on_peers(addresses)

    def _deliver(self) -> float:
        """Send queued receipts oldest first until the queue is empty, the oldest is not due yet, or
        a call fails; returns the seconds until the oldest is due (inf when none waits)."""
        while not self._stop.is_set():
            with self._lock:
                if not self._queue:
                    return math.inf
                due, receipt = self._queue[0]
            wait = due - time.monotonic()
            if wait > 0 and not self._flushing.is_set():
                return wait
            try:
                self._post("/api/receipts", receipt)
            except Refused as exc:
                if exc.code in RECEIPT_REFUSED_FOR_GOOD:
                    # Refused for good (or not registered: re-register, then the next receipts go).
                    self.registered = self.registered and exc.code not in NOT_REGISTERED
                    with self._lock:
                        if self._queue and self._queue[0][1] is receipt:
                            self._queue.popleft()
                            self.dropped += 1
                    self._log(f"tracker: receipt of round {receipt.round} refused: {exc}")
                    if exc.code in NOT_REGISTERED:
                        return math.inf
                    continue
                raise
            with self._lock:
                if self._queue and self._queue[0][1] is receipt:
                    self._queue.popleft()
            self.delivered += 1
        return math.inf

    def _ok(self) -> None:
        if self._failing:
            self._log(f"tracker: {self.config.url} reachable again")
        self._failing = False

    def _failed(self, exc: Exception) -> float:
        if not self._failing:
            self._log(f"tracker: {exc}; training goes on, retrying every {self.config.retry_s:.0f} s")
        self._failing = True
        retry = exc.retry_after_s if isinstance(exc, Refused) else None
        return max(retry or 0.0, self.config.retry_s)

    def _run(self) -> None:
        next_beat = next_peers = next_members = next_neighbours = 0.0
        while not self._stop.is_set():
            pause = 1.0
            now = time.monotonic()
            try:
                if not self.registered:
                    self._register()
                    next_beat = now + self.config.heartbeat_s
                elif now >= next_beat:
                    self._heartbeat()
                    next_beat = now + self.config.heartbeat_s
                if now >= next_peers:
                    self._peers()
                    next_peers = now + self.config.peers_every_s
                due_in = self._deliver()
                self._ok()
                pause = max(0.05, min(min(next_beat, next_peers, next_members) - time.monotonic(), due_in))
            except Refused as exc:
                if exc.code == refusal.UNKNOWN_WALLET:
                    self.registered = False
                pause = self._failed(exc)
            except Exception as exc:  # a bug here must not end reporting for good, nor training
                pause = self._failed(exc)
            if now >= next_members:  # after the receipts (they are due first), and even when
                next_members = now + self._read_members()  # registration was refused
            if now >= next_neighbours:
                next_neighbours = now + self._read_neighbours()
            pause = min(pause, max(0.05, min(next_members, next_neighbours) - time.monotonic()))
            self._wake.wait(pause)
            self._wake.clear()
