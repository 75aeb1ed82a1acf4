"""The relay's small pieces: the never-dialled address, the state object's framing, the CLI flags."""

from __future__ import annotations

import pytest

from neuroshard.cli.node_flags import build_parser, network_config_from_args
from neuroshard.node.p2p.plane import PeerPlaneConfig
from neuroshard.node.p2p.relay import decode_state_object, encode_state_object, is_relay, relay_address
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.peer import StateInfo
from neuroshard.protocol.refusal import Refused


def test_a_relay_address_parses_as_an_address_but_is_never_a_dialable_one() -> None:
    wallet = Wallet.from_token("nat").public_key_hex
    address = relay_address(wallet)
    assert address.endswith(".relay.invalid:1") and is_relay(address)
    assert (
        not is_relay("127.0.0.1:7420") and not is_relay("relay.invalid.example.com:80") and not is_relay(None)
    )


def test_the_state_object_round_trips_and_refuses_bad_framing() -> None:
    wallet = Wallet.from_token("holder")
    info = StateInfo.create(wallet, stage=0, round=3, theta_hash="a" * 64, momentum_hash="", numel=10)
    body = b"\x00" * 40
    got_info, got_body = decode_state_object(encode_state_object(info, body))
    assert got_info == info and got_body == body
    for bad in (b"", b"\x00\x00", b"\x00\x00\xff\xff" + b"{}", b"\x00\x00\x00\x02{}" + body):
        with pytest.raises(Refused):
            decode_state_object(bad)


def parse(*argv: str) -> PeerPlaneConfig:
    """The peer plane `neuroshard-node` builds from these flags (neuroshard.cli.node)."""
    config = network_config_from_args(build_parser().parse_args(list(argv)), reporting=False, pipeline=False)
    assert config is not None
    return config


def test_relay_without_a_port_listens_nowhere_and_with_one_serves_as_well() -> None:
    behind_nat = parse("--relay", "s3://stage/run1", "--relay-endpoint", "http://127.0.0.1:9000")
    assert not behind_nat.listen and behind_nat.relay is not None
    assert (behind_nat.relay.bucket, behind_nat.relay.prefix) == ("stage", "run1")
    direct = parse("--relay", "s3://stage/run1", "--port", "7421")
    assert direct.listen and direct.port == 7421
    assert parse("--port", "7421").relay is None
    with pytest.raises(ValueError, match="s3://"):
        parse("--relay", "https://stage/run1")
    with pytest.raises(ValueError, match="relay bucket"):
        PeerPlaneConfig(listen=False)


def test_the_port_a_node_opens_follows_what_it_is_for() -> None:
    """No peers and no verifier: none; a verifier to serve: any free port; a pipeline stage or
    peers: the default port; --relay without --port: none (the bucket carries everything)."""
    args = build_parser().parse_args
    assert network_config_from_args(args([]), reporting=False, pipeline=False) is None
    served = network_config_from_args(args([]), reporting=True, pipeline=False)
    assert served is not None and (served.port, served.listen) == (0, True)
    staged = network_config_from_args(args(["--stages", "2"]), reporting=False, pipeline=True)
    assert staged is not None and (staged.port, staged.listen) == (PeerPlaneConfig().port, True)
    peered = network_config_from_args(args(["--peers", "127.0.0.1:1"]), reporting=True, pipeline=False)
    assert peered is not None and (peered.port, peered.listen) == (0, True)
    relayed = network_config_from_args(args(["--relay", "s3://stage/run1"]), reporting=True, pipeline=False)
    assert relayed is not None and not relayed.listen


def test_a_pipeline_stage_behind_nat_opens_no_port() -> None:
    """A stage > 0 replica with --relay and no --port takes its micro-batches through the bucket
    (node.p2p.mailbox): its peer plane listens nowhere, as a data-parallel replica's does."""
    args = build_parser().parse_args(["--stages", "2", "--stage", "1", "--relay", "s3://stage/run1"])
    staged = network_config_from_args(args, reporting=False, pipeline=True)
    assert staged is not None and not staged.listen and staged.relay is not None


class _Bucket:
    """Just what RelayControl.fetch_state reads: no state object ever, and a holder's status."""

    def __init__(self, status: bytes) -> None:
        self.status = status
        self.wallet = Wallet.from_token("joiner").public_key_hex
        self.wants: list[str] = []

    async def fetch(self, wallet: str, name: str, *, max_bytes: int, wait_s: float = 0.0) -> bytes | None:
        import asyncio

        if name == "ctl/status":
            return self.status
        await asyncio.sleep(wait_s)
        return None

    async def put_shared(self, name: str, data: bytes) -> None:
        self.wants.append(name)


def test_a_reader_stops_waiting_for_a_state_once_its_holder_moved_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import time

    from neuroshard.node.p2p import relay

    monkeypatch.setattr(relay, "STATE_WAIT_SLICE_S", 0.05)
    holder = Wallet.from_token("holder")
    moved = StateInfo.create(holder, stage=0, round=8, theta_hash="a" * 64, momentum_hash="", numel=10)
    bucket = _Bucket(moved.to_json())
    control = relay.RelayControl(bucket, 0, log=lambda line: None)  # type: ignore[arg-type]
    started = time.monotonic()
    got = asyncio.run(control.fetch_state(holder.public_key_hex, 7, 1 << 20, wait_s=600.0))
    assert got is None and time.monotonic() - started < 5.0  # not the 600 s it was told it may wait
    assert bucket.wants == [f"_want/{holder.public_key_hex}/7/{bucket.wallet}"]
    # A holder still at the asked round is waited for (here until the deadline).
    bucket.status = StateInfo.create(
        holder, stage=0, round=7, theta_hash="a" * 64, momentum_hash="", numel=10
    ).to_json()
    started = time.monotonic()
    assert asyncio.run(control.fetch_state(holder.public_key_hex, 7, 1 << 20, wait_s=0.3)) is None
    assert time.monotonic() - started >= 0.25
