"""`neuroshard-adversary`: a `neuroshard-node` that attacks, to test the defences. TESTING ONLY.

It takes every flag of `neuroshard-node` (the same parser, one definition) plus the attack flags
below, and runs the node's own composition root (neuroshard.cli.node) with adversarial parts
in place of honest ones, through the same constructors: a round that commits forged
contributions (adversary.contributions), a cheating owner (adversary.owners), or a trainer that
misreports its work (adversary.work_lies). The honest node has no attack flags and no hooks.

    neuroshard-adversary --token T --peers 127.0.0.1:7420 --attack sign_flip
    neuroshard-swarm --nodes 5 --byzantine 1 --attack scale   # starts this for the last node
"""

from __future__ import annotations

import argparse

from neuroshard.cli import node, node_flags
from neuroshard.cli.process import run_command
from neuroshard.node.outer.round import OuterRound, RoundFactory

from . import owners, work_lies
from .attacks import ATTACKS
from .contributions import AttackConfig, Attacker, forging_rounds, warning

PROG = "neuroshard-adversary"
OWNER_ROUNDS: dict[str, type[OuterRound]] = {
    "wrong_aggregate": owners.WrongAggregate,
    "equivocator": owners.Equivocator,
    "withholder": owners.Withholder,
    "mismatched_part": owners.MismatchedPart,
}


def build_parser() -> argparse.ArgumentParser:
    """`neuroshard-node`'s parser with one more group: what this node does wrong."""
    p = node_flags.build_parser(prog=PROG, description=__doc__)
    g = p.add_argument_group("attack (TESTING ONLY: this node is a Byzantine attacker)")
    how = g.add_mutually_exclusive_group(required=True)
    how.add_argument("--attack", choices=ATTACKS, help="send forged contributions of this kind")
    how.add_argument(
        "--owner-attack",
        choices=sorted(OWNER_ROUNDS),
        help="cheat as an owner of parts instead (adversary/owners.py): a wrong aggregate, two signed "
        "aggregates, a withheld part, or a Δ object that does not match its signed root",
    )
    how.add_argument(
        "--work-lie",
        choices=work_lies.WORK_LIES,
        help="misreport this node's work (adversary/work_lies.py) to exercise the replay spot checks",
    )
    g.add_argument("--attack-param", type=float, help="the attack's strength (adversary/contributions.py)")
    g.add_argument("--attack-seed", type=int, default=0, help="seed of the attack's noise")
    return p


def roles_from_args(args: argparse.Namespace) -> node.Roles:
    """The adversarial parts the flags name, for the node's composition root."""
    if args.work_lie is not None:
        return node.Roles(trainer=work_lies.TRAINERS[args.work_lie], banner=work_lies.warning(args.work_lie))
    if args.owner_attack is not None:
        owner = OWNER_ROUNDS[args.owner_attack]

        def owner_rounds(theta_round: object) -> RoundFactory:
            return owner

        return node.Roles(
            rounds=owner_rounds,
            needs_peers=True,
            banner=f"WARNING: ATTACK MODE owner {args.owner_attack}: this node cheats in the parts it owns, "
            "for testing the round's fraud proofs",
        )
    attacker = attacker_from_args(args)
    return node.Roles(rounds=forging_rounds(attacker), banner=warning(attacker), needs_peers=True)


def attacker_from_args(args: argparse.Namespace) -> Attacker:
    """The attacker the flags ask for. Its idea of the outer step (from which the realistic attacks
    read earlier aggregates back) is the one the flags give the node: with --join, give the
    network's --inner-steps (or --outer-lr) and --outer-warmup-rounds too, since the outer lr's
    default depends on H and a network.toml that names no warm-up ramps over 3 rounds."""
    try:
        diloco = node_flags.diloco_config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"neuroshard-adversary: error: {exc}") from None
    return Attacker(
        AttackConfig(
            name=args.attack,
            param=args.attack_param,
            seed=args.attack_seed,
            # The outer step the node runs (its lr tuned for H when --outer-lr is not given).
            outer_lr=diloco.outer_step_lr,
            outer_momentum=diloco.outer_momentum,
            outer_warmup_rounds=diloco.outer_warmup_rounds,
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return node.main(argv, parser=parser, roles=roles_from_args(args))


def command() -> None:
    """The console script: `main`, then the process ends as neuroshard.cli.process says (never returns)."""
    run_command(main)


if __name__ == "__main__":
    command()
