"""Newcomers behind a flood of idle keys on a full probation list, with the real verifier objects.

A stage's verifier (SQLite, the real ``verifier.ledger`` and ``verifier.members``) holds one
admitted member and `--idle` probationers that registered first and never do anything (a flood,
or honest churn: people who tried once and left), then `--newcomers` honest wallets. A newcomer
sends heartbeats (its node runs) and does rounds only while the stage's member list names it (in
a pipeline its neighbours work only with listed wallets); once named it does every round with
the majority. Each turn the member reports `lead_rounds` + 2 rounds, the named newcomers vote in
them, and the housekeeping step (`members.next_turn`) runs after `probation_turn_s`.

Side by side, on the same wallets: the list as it is (places kept for turns, those alive at a
turn's start ahead of idle keys, progress that decays); the same with a flood that keeps every
key alive (a heartbeat from each before each turn: what an attacker must pay to hold places);
and the list before 2026-12-07 (every probationer ranked by progress, then by age: that ranking,
applied here to the same standings, `by_age`). Printed: the turns until each newcomer is first
named, and how many are named at the end. Expected: in the first turn that starts after they
register (idle keys take only the places nobody alive wants); with a flood kept alive, within
⌈N / P⌉ turns, N the wallets waiting for the P places that rotate (round-robin); before: never.

    .venv/bin/python bench/sim_probation_turns.py                 # 1,000 idle + 20 newcomers, 60 turns: ~30 s
    .venv/bin/python bench/sim_probation_turns.py --quick         # 40 idle + 4 newcomers, 16 places, 12 turns
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from common import parse_with_quick

from neuroshard.node.wallet import Wallet
from neuroshard.protocol.reports import HeartbeatRequest, Receipt, RegisterRequest
from neuroshard.protocol.signing import SignedBy, new_nonce
from neuroshard.verifier import ledger, members
from neuroshard.verifier.db import Database
from neuroshard.verifier.members import MembershipConfig
from neuroshard.verifier.reputation import ReputationConfig

NETWORK = "probation-turns-sim"
OPERATOR = Wallet.from_token("turns-sim-operator")
START = 1_700_000_000.0
TURN_S = 3600.0


def signed(wallet: Wallet, now: float) -> SignedBy:
    return SignedBy(public_key_hex=wallet.public_key_hex, timestamp=now, nonce=new_nonce())


def receipt(round_: int) -> Receipt:
    doc: dict[str, Any] = {
        "stage": 0, "round": round_, "inner_steps": 4, "start_step": 4 * round_, "tokens": 256,
        "data": [{"shard_id": 0, "offset_start": 0, "offset_end": 8}], "losses": [5.0] * 4,
        "base_hash": f"{round_ - 1:064x}" if round_ else "0" * 64, "result_hash": f"{round_:064x}",
        "delta_digest": "d" * 64,
    }  # fmt: skip
    return Receipt.from_obj(doc)


class Stage:
    """One stage's verifier state on its own SQLite file."""

    def __init__(self, path: Path, membership: MembershipConfig) -> None:
        self.db = Database(f"sqlite:///{path}")
        self.db.upgrade()
        self.cfg = ledger.LedgerConfig(
            reputation=ReputationConfig(), num_stages=1, nonce_window_s=60, membership=membership,
            network_name=NETWORK,
        )  # fmt: skip
        self.now = START
        self.next_round = 0

    def register(self, wallets: list[Wallet]) -> None:
        req = RegisterRequest(address="http://127.0.0.1:9000", stage=0, software_version="0.1.0")
        with self.db.write() as s:
            for w in wallets:
                ledger.register(s, signed(w, self.now), req, now=self.now, cfg=self.cfg)

    def rounds(self, n: int, genesis: Wallet, voters: list[Wallet]) -> None:
        for _ in range(n):
            doc = receipt(self.next_round)
            for w in [*voters, genesis]:
                with self.db.write() as s:
                    ledger.submit_receipt(
                        s, signed(w, self.now), doc, body_sha256=doc.result_hash, now=self.now, cfg=self.cfg
                    )
            with self.db.write() as s:
                ledger.settle_rounds(s, 0, now=self.now, cfg=self.cfg)
            self.next_round += 1

    def listed(self, by_age: bool) -> set[str]:
        with self.db.read() as s:
            if by_age:
                return by_age_ranking(members.standings(s, 0), self.cfg.membership.max_probation_listed)
            doc = members.member_list(
                s, 0, self.cfg.membership, network=NETWORK, signer=OPERATOR, now=self.now
            )
        return set(doc.probation)

    def beat(self, wallets: list[Wallet]) -> None:
        """Heartbeats from `wallets`' nodes, just before the next turn is due."""
        req = HeartbeatRequest(stage=0, round=self.next_round, steps_in_round=0)
        with self.db.write() as s:
            for w in wallets:
                ledger.heartbeat(s, signed(w, self.now), req, now=self.now + TURN_S - 1.0, cfg=self.cfg)

    def turn(self) -> str:
        self.now += TURN_S
        with self.db.write() as s:
            return members.next_turn(s, 0, self.cfg.membership, now=self.now, alive_s=self.cfg.peer_ttl_s)


def by_age_ranking(rows: list[members.Standing], places: int) -> set[str]:
    """The list's probationers before 2026-12-07: furthest along first, then the longest waiting."""
    waiting = sorted(
        (r for r in rows if r.status != "admitted"),
        key=lambda r: (-r.streak, -r.checks_passed, r.since, r.public_key),
    )
    return {r.public_key for r in waiting[:places]}


def run(
    label: str, membership: MembershipConfig, idle: int, newcomers: int, turns: int, workdir: Path
) -> dict[str, Any]:
    by_age, flood_alive = label == "by age", label == "flood alive"
    stage = Stage(workdir / f"{label.replace(' ', '_')}.sqlite", membership)
    genesis = Wallet.from_token("turns-sim-genesis")
    flood = [Wallet.from_token(f"turns-sim-idle-{i}") for i in range(idle)]
    honest = [Wallet.from_token(f"turns-sim-new-{i}") for i in range(newcomers)]
    started = time.perf_counter()
    stage.register([genesis, *flood])
    stage.rounds(1, genesis, [])
    stage.now += 60.0  # the newcomers register a minute after the flood
    stage.register(honest)
    first_named: dict[str, int] = {}
    per_turn = membership.lead_rounds + members.TURN_ROUNDS
    outcomes: list[str] = []
    for t in range(turns):
        named = stage.listed(by_age)
        for w in honest:
            if w.public_key_hex in named:
                first_named.setdefault(w.public_key_hex, t)
        working = [w for w in honest if w.public_key_hex in named]
        stage.rounds(per_turn, genesis, working)
        stage.beat([*honest, *flood] if flood_alive else honest)
        outcomes.append(stage.turn())
    named_at_end = len({w.public_key_hex for w in honest} & stage.listed(by_age))
    waits = sorted(first_named.values())
    return {
        "list": label,
        "idle": idle,
        "newcomers": newcomers,
        "turns": turns,
        "named_ever": len(first_named),
        "named_at_end": named_at_end,
        "turns_to_first_named_median": statistics.median(waits) if waits else None,
        "turns_to_first_named_max": max(waits) if waits else None,
        "turns_started": outcomes.count("started"),
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=int, default=1000, help="idle probationers registered first")
    parser.add_argument("--newcomers", type=int, default=20, help="honest wallets registered after them")
    parser.add_argument("--turns", type=int, default=60, help="turns simulated")
    parser.add_argument("--places", type=int, default=256, help="max_probation_listed")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object per list as the last lines"
    )
    args = parse_with_quick(parser, idle=40, newcomers=4, turns=12, places=16)
    now = MembershipConfig(policy="probation", probation_turn_s=TURN_S, max_probation_listed=args.places)
    before = replace(now, probation_turns=0.0)  # no turns: its list is `by_age_ranking`
    kept = math.ceil(now.probation_turns * now.max_probation_listed)
    waiting = args.idle + args.newcomers
    print(
        f"{args.idle} idle probationers, then {args.newcomers} newcomers; {now.max_probation_listed} places, "
        f"{kept} of them kept for turns; {args.turns} turns; expected: named in turn 1 (the first that "
        f"starts after they register) while the flood is idle; kept alive, ≈ N / P turns, P the places "
        f"progress leaves: {waiting / now.max_probation_listed:.1f} (none with progress) to "
        f"{waiting / kept:.1f} (progress holding all it may)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        results = [
            run(label, cfg, args.idle, args.newcomers, args.turns, Path(tmp))
            for label, cfg in (("turns", now), ("flood alive", now), ("by age", before))
        ]
    for r in results:
        med = r["turns_to_first_named_median"]
        print(
            f"{r['list']:>11}: {r['named_ever']}/{r['newcomers']} newcomers named within {r['turns']} turns "
            f"(median turn {med if med is not None else '—'}, last {r['turns_to_first_named_max'] if med is not None else '—'}); "
            f"{r['named_at_end']} named at the end; {r['turns_started']} turns started; {r['seconds']} s"
        )
    if args.json:
        for r in results:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
