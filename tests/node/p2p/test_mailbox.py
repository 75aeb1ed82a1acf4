"""Signed POSTs through the bucket (node.p2p.mailbox): the framing, and a receiver's server fed from
a (moto) bucket, with the requests someone with write access to ``_pipe/`` could forge."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp import web

from neuroshard.node.p2p import mailbox
from neuroshard.node.p2p.auth import BODY, PEER_WALLET, PeerReply, PeerUnreachable
from neuroshard.node.p2p.bucket import BucketStore, RelayConfig
from neuroshard.node.p2p.mailbox import (
    MailboxRoutes,
    MailboxServer,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    request_path,
)
from neuroshard.node.p2p.server import NodeState, build_app
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.peer import ErrorReply
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.signing import sign_request

ECHO = "/p2p/test/echo"
OTHER = "/p2p/test/other"


def test_requests_and_replies_round_trip_and_carry_only_our_headers() -> None:
    headers = {"X-NeuroShard-Activation": "{}", "Content-Type": "application/octet-stream", "Host": "evil"}
    path, got, body = decode_request(encode_request(ECHO, headers, b"\x00\x01"))
    assert (path, body) == (ECHO, b"\x00\x01")
    assert got == {"X-NeuroShard-Activation": "{}", "Content-Type": "application/octet-stream"}
    reply = decode_reply(encode_reply(204, {"X-NeuroShard-Gradient": "g", "Set-Cookie": "x"}, b""))
    assert (reply.status, dict(reply.headers), reply.body) == (204, {"X-NeuroShard-Gradient": "g"}, b"")
    for bad in (b"", b"\x00\x00", b"\x00\x00\xff\xff{}", b"\x00\x00\x00\x02[]", b"\x00\x00\x00\x01{"):
        with pytest.raises(Refused):
            decode_request(bad)
        with pytest.raises(Refused):
            decode_reply(bad)
    with pytest.raises(Refused, match="POST"):
        decode_request(mailbox._pack({"method": "GET", "path": ECHO, "headers": {}}, b""))
    with pytest.raises(Refused, match="status"):
        decode_reply(mailbox._pack({"status": True, "headers": {}}, b""))


def test_a_busy_receiver_lists_at_a_tenth_of_the_time_between_its_requests() -> None:
    """The LIST rate follows the request rate, within [min_poll_s, max_poll_s]: a tiny model's
    0.2 s steps poll at the 50 ms floor, a model taking 2 s a micro-batch every 0.2 s."""
    timings = mailbox.MailboxTimings()
    assert mailbox.poll_interval(None, timings) == timings.min_poll_s
    assert mailbox.poll_interval(0.2, timings) == timings.min_poll_s
    assert mailbox.poll_interval(2.0, timings) == pytest.approx(0.2)
    assert mailbox.poll_interval(60.0, timings) == timings.max_poll_s


class _Echo:
    """A POST route behind the signed-request middleware: answers the body reversed, and counts."""

    def __init__(self) -> None:
        self.calls = 0

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(ECHO, self._echo, name="echo")
        app.router.add_post(OTHER, self._echo, name="other")

    def body_limit(self, route: str) -> int | None:
        return 1024 if route in ("echo", "other") else None

    async def _echo(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        return web.Response(
            body=request[BODY][::-1], headers={"X-NeuroShard-Signer": request[PEER_WALLET], "X-Other": "no"}
        )


def _bucket(endpoint: str) -> RelayConfig:
    """A fresh bucket on the tests' moto server."""
    import boto3

    name = f"mail-{time.monotonic_ns()}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return RelayConfig(url=f"s3://{name}/run", endpoint_url=endpoint, poll_interval_s=0.05, max_poll_s=0.2)


def _first_and_last() -> tuple[Wallet, Wallet, Wallet]:
    """A receiver and two senders, the first of whose names lists before the second's: taken in
    name order, the first one's requests would all go before the second's."""
    receiver, first, last = (
        Wallet.from_token(f"mailbox-{name}") for name in ("receiver", "flood-1", "honest")
    )
    assert first.public_key_hex < last.public_key_hex
    return receiver, first, last


@contextlib.asynccontextmanager
async def _receiver(
    config: RelayConfig,
    node: NodeState,
    echo: _Echo,
    log: Callable[[str], None] = print,
    timings: mailbox.MailboxTimings | None = None,
    refuses: Callable[[str], str | None] | None = None,
) -> AsyncIterator[tuple[BucketStore, MailboxServer]]:
    """`node`'s bucket store and mailbox server, its own server (with `echo`) on a loopback port."""
    store = BucketStore(config, node.wallet.public_key_hex)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    runner = web.AppRunner(build_app(node, window_s=60.0, extensions=[echo]))
    await runner.setup()
    await web.SockSite(runner, sock).start()
    routes = MailboxRoutes(routes={ECHO: 1024}, reply_bytes=1024, timeout_s=5.0, refuses=refuses)
    server = MailboxServer(
        store,
        local=f"127.0.0.1:{sock.getsockname()[1]}",
        routes=routes,
        log=log,
        timings=timings or mailbox.MailboxTimings(),
    )
    server._session = aiohttp.ClientSession()
    try:
        yield store, server
    finally:
        await server._session.close()
        await runner.cleanup()
        store.close()


@pytest.mark.usefixtures("aws_env")
def test_a_receiver_behind_nat_answers_through_the_bucket_and_forwards_nothing_forged(
    endpoint: str, make_node: Callable[..., NodeState]
) -> None:
    config = _bucket(endpoint)
    receiver, sender, other = (
        Wallet.from_token(f"mailbox-{name}") for name in ("receiver", "sender", "other")
    )
    node = make_node(receiver)
    node.clock = time.time
    echo = _Echo()

    async def scenario() -> None:
        async with _receiver(
            config, node, echo, timings=mailbox.MailboxTimings(min_poll_s=0.02, max_poll_s=0.05)
        ) as (theirs, server):
            await talk(theirs, server, BucketStore(config, sender.public_key_hex))

    async def talk(theirs: BucketStore, server: MailboxServer, ours: BucketStore) -> None:
        assert await server.pass_once() == 0  # the first pass clears what an earlier run left
        task = asyncio.create_task(server.run())

        def send(path: str = ECHO, body: bytes = b"abc") -> asyncio.Future[PeerReply]:
            return asyncio.ensure_future(
                mailbox.post(ours, sender, time.time, receiver.public_key_hex, path, body=body,
                             headers={}, max_bytes=1024, timeout_s=5.0)
            )  # fmt: skip

        async def forged(
            signer: Wallet, named: str, path: str = ECHO, headers: dict[str, str] | None = None
        ) -> PeerReply:
            """Put a request object by hand under `named`'s name and wait for the receiver's answer."""
            token = secrets.token_hex(16)  # a fresh name, as every sender's request has
            signed = headers or sign_request(signer, "POST", path, b"xyz", time.time())
            await ours.put_shared(
                request_path(receiver.public_key_hex, named, token), encode_request(path, signed, b"xyz")
            )
            raw = await theirs.fetch(
                receiver.public_key_hex, f"pipe/{named}/{token}", max_bytes=1 << 20, wait_s=5.0
            )
            await ours.delete_shared(request_path(receiver.public_key_hex, named, token))
            assert raw is not None
            return decode_reply(raw)

        try:
            # Honest: answered by the server as over HTTP, our headers carried, others dropped.
            reply = await send()
            assert (reply.status, reply.body) == (200, b"cba")
            assert (
                reply.headers["X-NeuroShard-Signer"] == sender.public_key_hex
                and "X-Other" not in reply.headers
            )
            # Several at once are served side by side.
            replies = await asyncio.gather(*(send(body=bytes([i]) * 3) for i in range(5)))
            assert [r.body for r in replies] == [bytes([i]) * 3 for i in range(5)] and echo.calls == 6
            # Signed by one wallet, put under another's name: refused before the server.
            refused = await forged(other, sender.public_key_hex)
            assert refused.status == 400 and ErrorReply.from_json(refused.body).error == "not_own"
            # A route the mailbox does not take, though the server has it: refused before the server.
            refused = await forged(sender, sender.public_key_hex, OTHER)
            assert refused.status == 404 and echo.calls == 6
            # A signed request put again (its nonce already used): the server's replay check answers.
            signed = sign_request(sender, "POST", ECHO, b"xyz", time.time())
            assert (await forged(sender, sender.public_key_hex, headers=signed)).status == 200
            assert (await forged(sender, sender.public_key_hex, headers=signed)).status == 409
            # A body tampered with after signing fails the signature there.
            tampered = sign_request(sender, "POST", ECHO, b"other", time.time())
            assert (await forged(sender, sender.public_key_hex, headers=tampered)).status == 401
            assert echo.calls == 7
            # Answers whose request is gone are deleted: nothing is left under the receiver's prefix.
            deadline = time.monotonic() + 10.0  # a few of the receiver's passes (more on a loaded machine)
            while True:
                left, _ = await theirs.list_under(f"{receiver.public_key_hex}/pipe/")
                waiting, _ = await theirs.list_under("_pipe/")
                if (left == [] and waiting == []) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert left == [] and waiting == []
            # Nobody answers: the sender gives up after its timeout with PeerUnreachable.
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            with pytest.raises(PeerUnreachable, match="no readable answer"):
                await mailbox.post(ours, sender, time.time, receiver.public_key_hex, ECHO, body=b"x",
                                   headers={}, max_bytes=1024, timeout_s=0.3)  # fmt: skip
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            ours.close()

    asyncio.run(scenario())


def test_merged_routes_leave_a_request_unread_only_when_every_extension_refuses_its_sender() -> None:
    def refusing(*wallets: str) -> Callable[[str], str | None]:
        return lambda sender: f"{sender} refused" if sender in wallets else None

    pipe = MailboxRoutes(routes={ECHO: 10}, reply_bytes=5, timeout_s=1.0, refuses=refusing("a", "b"))
    other = MailboxRoutes(routes={OTHER: 20}, reply_bytes=7, timeout_s=3.0, refuses=refusing("a"))
    merged = MailboxRoutes.merged([pipe, other])
    assert (dict(merged.routes), merged.reply_bytes, merged.timeout_s) == ({ECHO: 10, OTHER: 20}, 7, 3.0)
    assert merged.refuses is not None
    assert [merged.refuses(w) for w in ("a", "b", "c")] == ["a refused", None, None]
    single = MailboxRoutes.merged([pipe]).refuses
    assert single is not None and (single("b"), single("c")) == ("b refused", None)
    # An extension that reads every sender's requests: nothing is left unread.
    assert (
        MailboxRoutes.merged([pipe, MailboxRoutes(routes={OTHER: 1}, reply_bytes=1, timeout_s=1.0)]).refuses
        is None
    )


@pytest.mark.usefixtures("aws_env")
def test_requests_from_a_sender_the_routes_refuse_are_answered_without_being_read(
    endpoint: str, make_node: Callable[..., NodeState]
) -> None:
    """A wallet off the stage's member list (the pipeline's `refuses`): its request is answered 403
    `not_a_member` by the name it was put under, never read from the bucket nor passed on; a
    member's is served as before."""
    config = _bucket(endpoint)
    receiver, member, outsider = (
        Wallet.from_token(f"mailbox-{name}") for name in ("receiver", "member", "out")
    )
    node = make_node(receiver)
    node.clock = time.time
    echo = _Echo()

    def refuses(sender: str) -> str | None:
        return None if sender == member.public_key_hex else f"{sender[:12]} is not on stage 0's member list"

    async def scenario() -> None:
        timings = mailbox.MailboxTimings(min_poll_s=0.02, max_poll_s=0.05)
        async with _receiver(config, node, echo, timings=timings, refuses=refuses) as (theirs, server):
            read: list[str] = []
            read_shared = theirs.read_shared

            async def counted(name: str, max_bytes: int) -> bytes | None:
                read.append(name)
                return await read_shared(name, max_bytes)

            theirs.read_shared = counted  # type: ignore[method-assign]
            await server.pass_once()
            task = asyncio.create_task(server.run())
            try:
                replies = {}
                for sender in (outsider, member):
                    store = BucketStore(config, sender.public_key_hex)
                    try:
                        replies[sender] = await mailbox.post(
                            store, sender, time.time, receiver.public_key_hex, ECHO, body=b"abc",
                            headers={}, max_bytes=1024, timeout_s=5.0,
                        )  # fmt: skip
                    finally:
                        store.close()
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        refused = ErrorReply.from_json(replies[outsider].body)
        assert (replies[outsider].status, refused.error) == (
            403,
            "not_a_member",
        ) and "(not read)" in refused.detail
        assert (replies[member].status, replies[member].body) == (200, b"cba") and echo.calls == 1
        assert [name for name in read if outsider.public_key_hex in name] == []
        assert len([name for name in read if member.public_key_hex in name]) == 1

    asyncio.run(scenario())


@pytest.mark.usefixtures("aws_env")
def test_a_receiver_s_inbox_stays_bounded_and_fair_whatever_is_written_to_it(
    endpoint: str, make_node: Callable[..., NodeState]
) -> None:
    """One LIST page is all a receiver reads a pass, so nothing written to its inbox may fill it
    for good or starve a sender: keys that are not ``{sender}/{token}`` are deleted unread; a
    sender's keys beyond `per_sender` are deleted; new requests are taken one per sender in turn;
    an object that breaks the framing is answered with a refusal once and not read again; an
    answered request its sender never deleted goes with its answer after `linger_s`; and what an
    earlier run left is cleared on the first pass."""
    config = _bucket(endpoint)
    receiver, flooder, honest = _first_and_last()
    node = make_node(receiver)
    node.clock = time.time
    echo = _Echo()
    lines: list[str] = []

    timings = mailbox.MailboxTimings(in_flight=2, per_sender=3, linger_s=3600.0)

    async def scenario() -> None:
        async with _receiver(config, node, echo, lines.append, timings) as (store, server):
            await flood(store, server)

    async def flood(store: BucketStore, server: MailboxServer) -> None:
        inbox = f"_pipe/{receiver.public_key_hex}/"
        h, f = honest.public_key_hex, flooder.public_key_hex

        async def put(
            wallet: Wallet, body: bytes = b"x", key: str | None = None, raw: bytes | None = None
        ) -> str:
            key = key or f"{wallet.public_key_hex}/{secrets.token_hex(16)}"
            signed = sign_request(wallet, "POST", ECHO, body, time.time())
            await store.put_shared(
                inbox + key, raw if raw is not None else encode_request(ECHO, signed, body)
            )
            return key

        async def listed() -> list[str]:
            return (await store.list_under(inbox))[0]

        async def answers() -> list[str]:
            return (await store.list_under(f"{receiver.public_key_hex}/pipe/"))[0]

        async def settle() -> None:
            await asyncio.gather(*server._busy.values())

        # What an earlier run left: its answer goes, its request is answered 503 (send it again),
        # and a name DeleteObjects' XML body cannot carry goes one delete of its own.
        left = await put(honest)
        await store.publish(f"pipe/{h}/{'0' * 32}", b"an earlier run's answer")
        await put(flooder, key="\x01junk")
        assert await server.pass_once() == 0 and await listed() == [left] and await answers() == [left]
        raw = await store.fetch(receiver.public_key_hex, f"pipe/{left}", max_bytes=1 << 20)
        assert raw is not None and decode_reply(raw).status == 503
        await store.delete_shared(inbox + left)  # its sender read the answer
        await server.pass_once()
        assert await listed() == [] and await answers() == [] and echo.calls == 0

        # Junk names (what a wildcard IAM pattern would let a wallet write) go unread.
        await put(flooder, key="-junk")
        await put(flooder, key=f"{h}/0/{f}/x")
        # A flood: 6 requests of one sender; the honest sender's one is taken in the first turn.
        flood = [await put(flooder) for _ in range(6)]
        mine = await put(honest)
        assert await server.pass_once() == 2
        assert mine in server._busy and any(k in server._busy for k in flood)
        assert any("has 6 pipeline requests here; all but 3 deleted" in line for line in lines), lines
        await settle()
        keys = await listed()
        assert len(keys) == 4 and mine in keys and not any("junk" in k or "/x" in k for k in keys)
        # Answered requests count toward the share: more from the flooder push its answered ones out.
        for _ in range(3):
            await put(flooder)
        await server.pass_once()
        await settle()
        assert sum(k.startswith(f) for k in await listed()) == 3
        assert len(await answers()) == sum(k in server._answered for k in await listed())

        # An object that breaks the framing (a header value with a line break) gets a refusal, once.
        signed = sign_request(honest, "POST", ECHO, b"x", time.time())
        bad = await put(honest, raw=encode_request(ECHO, {**signed, "X-NeuroShard-A": "a\r\nb: c"}, b"x"))
        deep = await put(honest, raw=mailbox.HEAD.pack(20000) + b"[" * 10000 + b"]" * 10000)
        for _ in range(4):
            await server.pass_once()
            await settle()
        for key in (bad, deep):
            raw = await store.fetch(receiver.public_key_hex, f"pipe/{key}", max_bytes=1 << 20)
            assert raw is not None and decode_reply(raw).status == 400
            assert key in server._answered
        calls = echo.calls
        # Answered and never collected: gone with their answers after linger_s.
        server.timings = dataclasses.replace(timings, linger_s=0.0, in_flight=8)
        assert await server.pass_once() == 0  # deleted, not taken again
        await settle()
        assert await listed() == [] and await answers() == [] and echo.calls == calls

    asyncio.run(scenario())


async def _request(store: BucketStore, receiver: Wallet, sender: Wallet, body: bytes = b"x") -> str:
    """A signed POST of `body` to ECHO that `sender` puts in `receiver`'s inbox; its name there."""
    key = f"{sender.public_key_hex}/{secrets.token_hex(16)}"
    signed = sign_request(sender, "POST", ECHO, body, time.time())
    await store.put_shared(f"_pipe/{receiver.public_key_hex}/{key}", encode_request(ECHO, signed, body))
    return key


async def _answer(store: BucketStore, receiver: Wallet, key: str) -> PeerReply | None:
    """`receiver`'s answer to the request named `key`, if it is in the bucket."""
    raw = await store.fetch(receiver.public_key_hex, f"pipe/{key}", max_bytes=1 << 20)
    return None if raw is None else decode_reply(raw)


@pytest.mark.usefixtures("aws_env")
def test_a_receiver_pages_through_a_full_inbox_and_uploads_an_answer_again_without_recomputing(
    endpoint: str, make_node: Callable[..., NodeState], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full page is followed by the next one on the next pass, so a sender whose names sort last
    is still reached; an answer whose upload failed survives passes whose page does not cover it
    and is then uploaded as it was (computing it again would meet the server's nonce check); and a
    request whose handling fails in an unforeseen way is answered 500 once."""
    from neuroshard.node.p2p.bucket import RelayError

    monkeypatch.setattr(mailbox, "MAX_LISTED", 3)
    monkeypatch.setattr(mailbox, "MAX_REMEMBERED_SENDERS", 1)  # two senders: one turn forgotten
    config = _bucket(endpoint)
    receiver, early, late = _first_and_last()
    node = make_node(receiver)
    node.clock = time.time
    echo = _Echo()

    async def scenario() -> None:
        async with _receiver(config, node, echo) as (store, server):
            await page(store, server)

    async def page(store: BucketStore, server: MailboxServer) -> None:
        inbox = f"_pipe/{receiver.public_key_hex}/"

        async def put(wallet: Wallet) -> str:
            return await _request(store, receiver, wallet)

        async def answer(key: str) -> PeerReply | None:
            return await _answer(store, receiver, key)

        publish = store.publish
        failing = {"once": True}

        async def flaky(name: str, data: bytes) -> None:
            if late.public_key_hex in name and failing.pop("once", False):
                raise RelayError("endpoint down (a test's)")
            await publish(name, data)

        assert await server.pass_once() == 0  # the first pass: nothing left from a run before
        firsts = [await put(early) for _ in range(3)]
        last = await put(late)
        store.publish = flaky  # type: ignore[method-assign]
        assert await server.pass_once() == 3 and server.clearing  # a full page: early's three
        await asyncio.gather(*server._busy.values())
        assert await server.pass_once() == 1  # the next page: late's, whose answer fails to upload
        await asyncio.gather(*server._busy.values())
        assert last in server._unsent and await answer(last) is None and echo.calls == 4
        assert await server.pass_once() == 0  # back to the first page, which does not cover late's
        assert last in server._unsent
        assert await server.pass_once() == 1  # late's page again: the answer uploaded as it was
        await asyncio.gather(*server._busy.values())
        got = await answer(last)
        assert got is not None and got.status == 200 and echo.calls == 4 and not server._unsent
        assert list(server._last_served) == [late.public_key_hex]  # early's turn, older, forgotten
        for key in firsts:
            got = await answer(key)
            assert got is not None and got.status == 200

        # Whatever goes wrong answering a request, it is answered (500), once.
        def broken(data: bytes) -> tuple[str, dict[str, str], bytes]:
            raise RuntimeError("a bug")

        monkeypatch.setattr(mailbox, "decode_request", broken)
        for key in [*firsts, last]:
            await store.delete_shared(inbox + key)
        odd = await put(late)
        for _ in range(3):
            await server.pass_once()
            await asyncio.gather(*server._busy.values())
        got = await answer(odd)
        assert got is not None and got.status == 500 and odd in server._answered

    asyncio.run(scenario())


@pytest.mark.usefixtures("aws_env")
def test_a_request_the_bucket_fails_to_hand_over_is_read_again_not_refused(
    endpoint: str, make_node: Callable[..., NodeState]
) -> None:
    """A transient bucket error reading a request (a 5xx, a body cut short) is the bucket's trouble,
    not the sender's: the request is read again on the next passes and answered as usual; one the
    bucket keeps failing is answered 503 (busy: its sender tries another replica at once) after
    READ_TRIES passes, never 400 (which costs the receiver a ban at its sender). A sender polling
    for an answer polls through such errors too."""
    from botocore.exceptions import ClientError, EndpointConnectionError, IncompleteReadError

    from neuroshard.node.p2p.bucket import transient

    assert transient(EndpointConnectionError(endpoint_url="http://x")) and transient(
        IncompleteReadError(actual_bytes=1, expected_bytes=2)
    )
    busy = ClientError(
        {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "GetObject"
    )
    denied = ClientError(
        {"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "GetObject"
    )
    assert transient(busy) and not transient(denied)
    config = _bucket(endpoint)
    receiver, sender, _ = _first_and_last()
    node = make_node(receiver)
    node.clock = time.time
    echo = _Echo()

    async def scenario() -> None:
        async with _receiver(config, node, echo) as (store, server):
            inbox = f"_pipe/{receiver.public_key_hex}/"
            get = store._get
            failures = {"left": mailbox.READ_TRIES - 1}

            async def flaky(key: str, max_bytes: int, span: tuple[int, int] | None) -> bytes | None:
                if key.startswith(store._root + inbox) and failures["left"] > 0:
                    failures["left"] -= 1
                    raise busy
                return await get(key, max_bytes, span)

            store._get = flaky  # type: ignore[method-assign]

            async def put() -> str:
                return await _request(store, receiver, sender, b"xy")

            async def answer(key: str) -> PeerReply | None:
                return await _answer(store, receiver, key)

            async def passes(n: int) -> None:
                for _ in range(n):
                    await server.pass_once()
                    await asyncio.gather(*server._busy.values())

            await server.pass_once()  # the first pass: the sweep
            key = await put()
            await passes(mailbox.READ_TRIES - 1)  # each read fails: no answer yet, nothing refused
            assert await answer(key) is None and key in server._read_failures and echo.calls == 0
            await passes(1)
            got = await answer(key)
            assert got is not None and (got.status, got.body) == (200, b"yx") and echo.calls == 1
            assert not server._read_failures

            failures["left"] = mailbox.READ_TRIES  # a bucket that keeps failing this request
            stuck = await put()
            await passes(mailbox.READ_TRIES)
            got = await answer(stuck)
            assert got is not None and got.status == 503 and echo.calls == 1
            assert not server._read_failures

            # The sender's side: a poll that meets a busy bucket polls on until the answer is there.
            failures["left"] = 0
            fails = {"left": 2}

            async def flaky_reply(key: str, max_bytes: int, span: tuple[int, int] | None) -> bytes | None:
                if "/pipe/" in key and fails["left"] > 0:
                    fails["left"] -= 1
                    raise busy
                return await get(key, max_bytes, span)

            store._get = flaky_reply  # type: ignore[method-assign]
            raw = await store.fetch(receiver.public_key_hex, f"pipe/{key}", max_bytes=1 << 20, wait_s=5.0)
            assert raw is not None and decode_reply(raw).status == 200 and fails["left"] == 0
            denied_left = {"left": 1}

            async def refusing(key: str, max_bytes: int, span: tuple[int, int] | None) -> bytes | None:
                denied_left["left"] -= 1
                raise denied

            store._get = refusing  # type: ignore[method-assign]
            t0 = time.monotonic()
            assert (
                await store.fetch(receiver.public_key_hex, f"pipe/{key}", max_bytes=1 << 20, wait_s=5.0)
                is None
            )
            assert time.monotonic() - t0 < 2.0 and denied_left["left"] == 0  # a refusal is final: one try

    asyncio.run(scenario())


@pytest.mark.usefixtures("aws_env")
def test_new_and_refused_senders_wait_behind_those_already_waiting_their_turn(
    endpoint: str, make_node: Callable[..., NodeState]
) -> None:
    """Turns go to the senders served longest ago; a sender never served here counts as served now,
    so a crowd of fresh wallets does not go ahead of a sender already taking turns, and a sender
    whose request was refused (forged, malformed) waits behind everyone for REFUSED_PASSES passes."""
    config = _bucket(endpoint)
    receiver, early, late = _first_and_last()  # early's names sort first
    crowd = [Wallet.from_token(f"mailbox-crowd-{i}") for i in range(3)]
    node = make_node(receiver)
    node.clock = time.time
    echo = _Echo()
    timings = mailbox.MailboxTimings(in_flight=1)

    async def scenario() -> None:
        async with _receiver(config, node, echo, timings=timings) as (store, server):
            await server.pass_once()  # the sweep

            async def one_pass() -> set[str]:
                await server.pass_once()
                taken = {key.partition("/")[0] for key in server._busy}
                await asyncio.gather(*server._busy.values())
                return taken

            await _request(store, receiver, late)
            assert await one_pass() == {late.public_key_hex}  # late has now had a turn
            for wallet in crowd:
                await _request(store, receiver, wallet)
            await _request(store, receiver, late)
            assert await one_pass() == {late.public_key_hex}  # served long ago beats never served
            # A request under early's name that another wallet signed is refused (400)...
            inbox = f"_pipe/{receiver.public_key_hex}/"
            forged = sign_request(late, "POST", ECHO, b"x", time.time())
            await store.put_shared(
                inbox + f"{early.public_key_hex}/{'f' * 32}", encode_request(ECHO, forged, b"x")
            )
            taken = [await one_pass() for _ in range(len(crowd) + 1)]
            assert {early.public_key_hex} in taken and early.public_key_hex in server._refused
            # ...and early then waits behind every sender with a request waiting, whatever its name.
            await _request(store, receiver, early)
            await _request(store, receiver, late)
            assert await one_pass() == {late.public_key_hex}
            assert await one_pass() == {early.public_key_hex}

    asyncio.run(scenario())
