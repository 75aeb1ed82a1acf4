"""`neuroshard-verifier`: run the verification service (API + dashboard) with uvicorn.

    neuroshard-verifier --network network.toml --db postgresql://db/neuroshard \\
        --host 0.0.0.0 --port 8000 --operator-key-file /etc/neuroshard/operator.key --workers 4

--workers N > 1 runs N processes on one port (verifier.workers), PostgreSQL only; one of them
at a time runs the evaluations and spot checks (verifier.leader).

This is a composition root, one of the two modules of the package allowed to import
`neuroshard.api` (which depends on the verifier, never the other way round); the other is
cli.embedded, the same service inside a node process.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path

import torch

from neuroshard.api.app import create_app
from neuroshard.cli.parser import Parser
from neuroshard.cli.process import run_command, stop_signals_exit
from neuroshard.node.p2p.bucket import RelayConfig
from neuroshard.protocol.roster import POLICIES
from neuroshard.verifier.budget import ReplayBudget, segment_check_cost
from neuroshard.verifier.config import VerifierConfig
from neuroshard.verifier.db import DatabaseURLError, normalise_url
from neuroshard.verifier.evaluator import EvaluatorConfig, models_dir_for
from neuroshard.verifier.fraudproofs import DIRECTORY_NAME
from neuroshard.verifier.members import MembershipConfig
from neuroshard.verifier.network import NetworkError, load_network, load_operator_key
from neuroshard.verifier.ratelimit import SourceLimitConfig
from neuroshard.verifier.replaycheck import SEGMENTS_PER_CHECK, ReplayCheckConfig
from neuroshard.verifier.vocab import VocabWatchConfig
from neuroshard.verifier.workers import Supervisor, SupervisorConfig, listen

PROG = "neuroshard-verifier"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--network", type=Path, required=True, help="the run's definition (network.toml)")
    p.add_argument(
        "--home",
        type=Path,
        default=Path.home() / ".neuroshard",
        help="state directory (default ~/.neuroshard)",
    )
    p.add_argument(
        "--db", help="database URL: sqlite:///PATH or postgresql://HOST/DB (default: SQLite under --home)"
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument(
        "--operator-key-file",
        type=Path,
        help="hex Ed25519 seed of the operator key, mode 0600 (default HOME/operator.key)",
    )
    p.add_argument(
        "--init-operator-key", action="store_true", help="create the operator key file if it is missing"
    )
    p.add_argument(
        "--peer-ttl", type=float, default=90.0, help="seconds a heartbeat keeps a node live (default 90)"
    )
    p.add_argument(
        "--eval-threads",
        type=int,
        default=1,
        help="torch threads of the live held-out evaluation and the replay spot checks (default 1: they must not starve the API)",
    )
    p.add_argument("--no-evaluation", action="store_true", help="do not fetch and measure the majority model")
    p.add_argument(
        "--keep-models",
        type=int,
        default=EvaluatorConfig().keep_models,
        help="measured majority models kept under HOME/models/RUN for neuroshard-export --checkpoint ROUND "
        "(the whole model in fp32 each; default %(default)s)",
    )
    p.add_argument(
        "--sample-every",
        type=int,
        default=EvaluatorConfig().sample_every,
        help="evaluations between the text samples the dashboard shows (0: none; default %(default)s)",
    )
    p.add_argument(
        "--replay-rate",
        type=float,
        default=ReplayCheckConfig().sample_rate,
        help="share of receipts whose inner steps are replayed (spot checks; 0: none). "
        "A replay costs about what the round cost the node (default %(default)s)",
    )
    p.add_argument(
        "--segments-per-check",
        type=int,
        default=SEGMENTS_PER_CHECK,
        help="segments of a receipt's round one check replays, drawn by the operator's signature; "
        "each costs k/H of the round's work (default %(default)s)",
    )
    p.add_argument(
        "--relay",
        metavar="s3://BUCKET/PREFIX",
        help="the stage bucket of replicas behind NAT (their --relay): the spot checks of those "
        "replicas are asked and answered through it. Needs s3:GetObject and s3:ListBucket on "
        "PREFIX/*, and s3:PutObject/s3:DeleteObject on PREFIX/_check/* (where no replica may write); "
        "credentials: boto3's usual chain. "
        "Without it, relay replicas are not spot-checked",
    )
    p.add_argument(
        "--relay-endpoint", help="S3-compatible endpoint URL of --relay (MinIO, R2, ...); default AWS"
    )
    p.add_argument("--relay-region", help="the --relay bucket's region; default boto3's")
    p.add_argument(
        "--keep-fraud-gb",
        type=float,
        default=ReplayCheckConfig().keep_fraud_bytes / 2**30,
        help="GiB the kept segment fraud proofs (HOME/fraud-proofs, ~28 bytes per parameter each) may "
        "hold together; the oldest are deleted beyond it (default %(default)s)",
    )
    p.add_argument(
        "--vocab-check-every",
        type=float,
        default=VocabWatchConfig().period_s,
        help="seconds between reads of the run's manifest for a grown tokenizer, whose new ids the "
        "stages' embedding and head are scheduled to grow to (verifier.vocab; 0: never grow; "
        "default %(default)s)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes serving the port (default 1; more than 1 needs PostgreSQL)",
    )
    p.add_argument("--worker-fd", type=int, help=argparse.SUPPRESS)  # set by the parent for its workers
    p.add_argument(
        "--replay-budget",
        type=float,
        help="compute per round the verifier can spend on checks, in replicas' worth (e.g. 1 = one "
        "replica's CPU; a segment check of 4 segments costs ~0.53 of a replica's round); replaces "
        "--replay-rate: every wallet checked within a bounded number of rounds, new and "
        "low-reputation wallets more often (verifier.budget)",
    )
    g = p.add_argument_group("membership (issue 19: what a new wallet costs)")
    g.add_argument(
        "--admission",
        choices=POLICIES,
        default="probation",
        help="who counts in a stage's majority: open (every registered wallet, no Sybil defence), "
        "probation (new wallets earn admission by verified rounds) or allowlist (only the operator's "
        "roster, POST /api/admin/roster) (default %(default)s)",
    )
    g.add_argument(
        "--admission-rounds",
        type=int,
        default=MembershipConfig().admission_rounds,
        help="probation: settled rounds with the stage majority before admission (default %(default)s)",
    )
    g.add_argument(
        "--membership-lead-rounds",
        type=int,
        default=MembershipConfig().lead_rounds,
        help="rounds after a membership change before its member list takes effect: time for every "
        "replica to read it (default %(default)s; raise it for rounds shorter than ~10 s)",
    )
    g.add_argument(
        "--admission-spot-checks",
        type=int,
        help="probation: replay spot checks a probationer of any stage must pass (segment checks "
        "at later stages; default 1, 0 without replay checks: --replay-rate 0)",
    )
    g.add_argument(
        "--registration-pow-bits",
        type=int,
        default=0,
        help="hashcash a new wallet's registration must carry: ~2^bits sha256 (20 ≈ 1 s, 24 ≈ 15 s of "
        "one core; default 0: none)",
    )
    g.add_argument(
        "--new-wallets-per-hour",
        type=float,
        default=SourceLimitConfig().per_hour,
        help="new wallets one source address (IPv4, IPv6 /64) may register per hour, after a burst of "
        f"{SourceLimitConfig().capacity:g}; loopback is exempt; 0: unlimited (default %(default)s)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def _membership(args: argparse.Namespace, replays: bool) -> MembershipConfig:
    checks = args.admission_spot_checks
    if checks is None:
        checks = 1 if replays else 0  # without replays no probationer could ever pass one
    elif checks > 0 and not replays and args.admission == "probation":
        raise ValueError(
            f"--admission-spot-checks {checks} needs replay spot checks (--replay-rate or --replay-budget): "
            "without them no probationer would ever be admitted"
        )
    return MembershipConfig(
        policy=args.admission,
        admission_rounds=args.admission_rounds,
        spot_checks_required=checks,
        lead_rounds=args.membership_lead_rounds,
    )


def startup_warnings(config: VerifierConfig) -> list[str]:
    """What an operator should know about a configuration that runs but leaves someone out."""
    warnings: list[str] = []
    membership, checks = config.membership, config.replay_checks
    asks_checks = membership.policy == "probation" and membership.spot_checks_required > 0
    if asks_checks and checks is not None and checks.relay is None:
        warnings.append(
            "replicas behind NAT (--relay on the node) cannot be spot-checked without the stage "
            "bucket (--relay), so none of them can pass probation"
        )
    return warnings


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return 2


def build_config(args: argparse.Namespace) -> VerifierConfig:
    """Flags → VerifierConfig; raises NetworkError / DatabaseURLError / ValueError with one-line messages."""
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    network = load_network(args.network)
    operator = load_operator_key(
        args.operator_key_file or args.home / "operator.key", create=args.init_operator_key
    )
    url = normalise_url(args.db or f"sqlite:///{(args.home / 'verifier.sqlite3').expanduser()}")
    if not 1 <= args.workers <= 64:
        raise ValueError(f"--workers must be in 1..64, got {args.workers}")
    if args.workers > 1 and not url.startswith("postgresql"):
        raise ValueError(
            f"--workers {args.workers} needs PostgreSQL (--db postgresql://HOST/DB): SQLite lets one "
            "process write at a time, so extra workers would only wait on its lock; use --workers 1"
        )
    if args.replay_budget is not None and not args.replay_budget > 0:
        raise ValueError(f"--replay-budget must be > 0 replicas, got {args.replay_budget}")
    if args.segments_per_check < 1:
        raise ValueError(f"--segments-per-check must be ≥ 1, got {args.segments_per_check}")
    # Nodes commit to segments (issue 17): a check replays --segments-per-check of them, not a round.
    budget = (
        None
        if args.replay_budget is None
        else ReplayBudget(
            replicas=args.replay_budget,
            check_cost=segment_check_cost(
                args.segments_per_check, network.segment_k / network.diloco.inner_steps
            ),
        )
    )
    if not args.keep_fraud_gb > 0:
        raise ValueError(f"--keep-fraud-gb must be > 0, got {args.keep_fraud_gb}")
    if args.eval_threads < 1:
        raise ValueError(f"--eval-threads must be ≥ 1, got {args.eval_threads}")
    if args.new_wallets_per_hour < 0:
        raise ValueError(f"--new-wallets-per-hour must be ≥ 0, got {args.new_wallets_per_hour}")
    if not args.vocab_check_every >= 0:
        raise ValueError(f"--vocab-check-every must be ≥ 0 seconds, got {args.vocab_check_every}")
    replays = args.replay_rate > 0 or budget is not None
    return VerifierConfig(
        database_url=url,
        network=network,
        operator=operator,
        peer_ttl_s=args.peer_ttl,
        live_evaluation=None
        if args.no_evaluation
        else EvaluatorConfig(
            cache_dir=args.home / "cache",
            models_dir=models_dir_for(args.home, network),
            keep_models=args.keep_models,
            sample_every=args.sample_every,
        ),
        replay_checks=ReplayCheckConfig(
            sample_rate=args.replay_rate,
            cache_dir=args.home / "cache",
            budget=budget,
            segments_per_check=args.segments_per_check,
            fraud_proof_dir=args.home / DIRECTORY_NAME,
            keep_fraud_bytes=int(args.keep_fraud_gb * 2**30),
            relay=RelayConfig(url=args.relay, endpoint_url=args.relay_endpoint, region=args.relay_region)
            if args.relay
            else None,
        )
        if replays
        else None,
        fraud_proof_dir=args.home / DIRECTORY_NAME,
        vocab_watch=VocabWatchConfig(period_s=args.vocab_check_every) if args.vocab_check_every else None,
        membership=_membership(args, replays),
        registration_pow_bits=args.registration_pow_bits,
        registration_limit=SourceLimitConfig(per_hour=args.new_wallets_per_hour)
        if args.new_wallets_per_hour
        else None,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = build_config(args)
    except (NetworkError, DatabaseURLError, ValueError, OSError) as exc:
        return _fail(str(exc))

    import uvicorn

    # The only torch work here is the live evaluation and the replay spot checks (verifier.replaycheck).
    torch.set_num_threads(args.eval_threads)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")

    if args.worker_fd is not None:  # one of the parent's workers: serve the inherited socket
        server = uvicorn.Server(uvicorn.Config(create_app(config), log_level=args.log_level))
        with stop_signals_exit():  # the parent's SIGTERM, raised again by uvicorn once it has stopped
            server.run(sockets=[socket.socket(fileno=args.worker_fd)])
        return 0
    print(
        f"{PROG}: network {config.network.name!r}, {config.network.num_stages} stage(s); "
        f"operator key {config.operator.public_key_hex}; listening on http://{args.host}:{args.port}"
        + (f" with {args.workers} workers" if args.workers > 1 else ""),
        flush=True,
    )
    for warning in startup_warnings(config):
        print(f"{PROG}: warning: {warning}", flush=True)
    if args.workers == 1:
        with stop_signals_exit():
            uvicorn.run(create_app(config), host=args.host, port=args.port, log_level=args.log_level)
        return 0
    try:
        sock = listen(args.host, args.port)
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{args.port}: {exc}")
    given = list(sys.argv[1:] if argv is None else argv)

    def worker_argv(fd: int) -> list[str]:
        return [sys.executable, "-m", "neuroshard.cli.verifier", *given, "--worker-fd", str(fd)]

    supervisor = Supervisor(
        SupervisorConfig(workers=args.workers), worker_argv, lambda line: print(f"{PROG}: {line}", flush=True)
    )
    with sock:
        return supervisor.run(sock)


def command() -> None:
    """The console script: `main`, then the process ends as neuroshard.cli.process says (never returns)."""
    run_command(main)


if __name__ == "__main__":
    command()
