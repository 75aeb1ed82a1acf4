from pathlib import Path

import pytest

from neuroshard.cli.verifier import build_config, build_parser, main, startup_warnings

NETWORK = """
name = "cli"
[model]
size = "tiny"
vocab_size = 512
[data]
manifest_url = "http://127.0.0.1:1/"
publisher_key = "%s"
""" % ("ab" * 32)


@pytest.fixture
def network_file(tmp_path: Path) -> Path:
    path = tmp_path / "network.toml"
    path.write_text(NETWORK)
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse errors
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    return code, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_network_flag_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run([], capsys)
    assert code == 2
    assert "--network" in one_line(err)


def test_missing_network_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["--network", str(tmp_path / "nope.toml"), "--home", str(tmp_path)], capsys)
    assert code == 2
    assert "cannot read network definition" in one_line(err)


def test_missing_operator_key_points_at_the_fix(
    network_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run(["--network", str(network_file), "--home", str(tmp_path)], capsys)
    assert code == 2
    assert "--init-operator-key" in one_line(err)


def test_bad_database_url(network_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--network",
        str(network_file),
        "--home",
        str(tmp_path),
        "--init-operator-key",
        "--db",
        "mysql://x/y",
    ]
    code, err = run(argv, capsys)
    assert code == 2
    assert "only sqlite and postgresql" in one_line(err)


def test_bad_port(network_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(
        ["--network", str(network_file), "--home", str(tmp_path), "--init-operator-key", "--port", "0"],
        capsys,
    )
    assert code == 2
    assert "--port" in one_line(err)
    code, err = run(["--network", str(network_file), "--port", "eighty"], capsys)
    assert code == 2
    assert "invalid int value" in one_line(err)


def test_flags_become_the_config(network_file: Path, tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["--network", str(network_file), "--home", str(tmp_path), "--init-operator-key", "--peer-ttl", "30"]
    )
    config = build_config(args)
    assert config.network.name == "cli"
    assert config.database_url == f"sqlite:///{tmp_path / 'verifier.sqlite3'}"
    assert config.peer_ttl_s == 30
    assert (tmp_path / "operator.key").stat().st_mode & 0o777 == 0o600
    again = build_config(build_parser().parse_args(["--network", str(network_file), "--home", str(tmp_path)]))
    assert again.operator.public_key_hex == config.operator.public_key_hex


def test_sqlite_refuses_several_workers(
    network_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--network", str(network_file), "--home", str(tmp_path), "--init-operator-key", "--workers", "2"]
    code, err = run(argv, capsys)
    assert code == 2
    line = one_line(err)
    assert "--workers 2 needs PostgreSQL" in line and "SQLite" in line
    assert not (tmp_path / "verifier.sqlite3").exists(), "refused before touching the database"
    code, err = run([*argv[:-1], "0"], capsys)
    assert code == 2 and "--workers must be in 1..64, got 0" in one_line(err)


def test_replay_budget_flag(network_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--network", str(network_file), "--home", str(tmp_path), "--init-operator-key"]
    config = build_config(build_parser().parse_args([*base, "--replay-budget", "2.5", "--replay-rate", "0"]))
    assert config.replay_checks is not None and config.replay_checks.budget is not None
    assert config.replay_checks.budget.replicas == 2.5
    assert build_config(build_parser().parse_args(base)).replay_checks.budget is None  # type: ignore[union-attr]
    code, err = run([*base, "--replay-budget", "0"], capsys)
    assert code == 2 and "--replay-budget must be > 0 replicas, got 0.0" in one_line(err)


def test_keep_fraud_gb_flag(network_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--network", str(network_file), "--home", str(tmp_path), "--init-operator-key"]
    default = build_config(build_parser().parse_args(base)).replay_checks
    assert default is not None and default.keep_fraud_bytes == 8 << 30
    config = build_config(build_parser().parse_args([*base, "--keep-fraud-gb", "0.5"])).replay_checks
    assert config is not None and config.keep_fraud_bytes == 1 << 29
    code, err = run([*base, "--keep-fraud-gb", "0"], capsys)
    assert code == 2 and "--keep-fraud-gb must be > 0, got 0.0" in one_line(err)


def test_relay_flags(network_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--network", str(network_file), "--home", str(tmp_path), "--init-operator-key"]
    assert build_config(build_parser().parse_args(base)).replay_checks.relay is None  # type: ignore[union-attr]
    flags = [
        "--relay",
        "s3://stage/run1",
        "--relay-endpoint",
        "http://127.0.0.1:9000",
        "--relay-region",
        "eu-1",
    ]
    config = build_config(build_parser().parse_args([*base, *flags])).replay_checks
    assert config is not None and config.relay is not None
    relay = config.relay
    assert (relay.bucket, relay.prefix, relay.endpoint_url, relay.region) == (
        "stage", "run1", "http://127.0.0.1:9000", "eu-1"
    )  # fmt: skip
    code, err = run([*base, "--relay", "https://stage/run1"], capsys)
    assert code == 2 and "does not start with s3://" in one_line(err)


def test_membership_flags(network_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--network", str(network_file), "--home", str(tmp_path), "--init-operator-key"]
    default = build_config(build_parser().parse_args(base))
    # An operator's verifier defaults to probation (issue 19); the swarm and the embedded verifier say "open".
    assert (default.membership.policy, default.registration_pow_bits) == ("probation", 0)
    assert default.registration_limit is not None and default.registration_limit.per_hour == 60
    assert default.membership.spot_checks_required == 1  # replays are on by default
    config = build_config(
        build_parser().parse_args(
            [
                *base,
                *("--admission", "probation", "--admission-rounds", "5", "--registration-pow-bits", "20"),
                *("--new-wallets-per-hour", "0", "--replay-rate", "0"),
            ]
        )
    )
    assert (config.membership.policy, config.membership.admission_rounds) == ("probation", 5)
    assert config.membership.spot_checks_required == 0  # no replays: none can be asked for
    assert config.registration_pow_bits == 20 and config.registration_limit is None
    code, err = run(
        [*base, "--admission", "probation", "--admission-spot-checks", "2", "--replay-rate", "0"], capsys
    )
    assert code == 2 and "needs replay spot checks" in one_line(err)
    code, err = run([*base, "--registration-pow-bits", "99"], capsys)
    assert code == 2 and "registration_pow_bits must be in [0, 40]" in one_line(err)
    code, err = run([*base, "--admission", "anyone"], capsys)
    assert code == 2 and "invalid choice" in err
    # Probation asks every probationer for a spot check: without the stage bucket, replicas behind
    # NAT cannot be asked, and the operator is told so; with it, or with no checks asked for, not.
    assert any("cannot be spot-checked" in w for w in startup_warnings(default))
    relayed = build_config(build_parser().parse_args([*base, "--relay", "s3://stage/run1"]))
    assert startup_warnings(relayed) == [] and startup_warnings(config) == []


def test_vocab_check_every_flag(
    network_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--network", str(network_file), "--home", str(tmp_path), "--init-operator-key"]
    default = build_config(build_parser().parse_args(base)).vocab_watch
    assert default is not None and default.period_s == 60
    config = build_config(build_parser().parse_args([*base, "--vocab-check-every", "5"]))
    assert config.vocab_watch is not None and config.vocab_watch.period_s == 5
    assert build_config(build_parser().parse_args([*base, "--vocab-check-every", "0"])).vocab_watch is None
    code, err = run([*base, "--vocab-check-every", "-1"], capsys)
    assert code == 2 and "--vocab-check-every must be ≥ 0 seconds, got -1.0" in one_line(err)
