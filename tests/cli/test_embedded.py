"""The verifier a node embeds: one SQLite database per run definition; --fresh starts a new one
and keeps the old."""

import socket
from pathlib import Path

import pytest

from neuroshard.cli.embedded import start_embedded_verifier
from neuroshard.testing.ports import free_port
from neuroshard.testing.verifier import small_network


def _run(home: Path, *, fresh: bool = False, **tables: dict[str, object]) -> list[str]:
    lines: list[str] = []
    server = start_embedded_verifier(
        home=home, network=small_network(**tables), port=free_port(), log=lines.append, fresh=fresh
    )
    server.stop()
    return lines


def test_one_database_per_definition_and_fresh_keeps_the_old_one(tmp_path: Path) -> None:
    _run(tmp_path)
    (first,) = tmp_path.glob("verifier-*.sqlite3")
    _run(tmp_path)  # same definition: same database
    assert list(tmp_path.glob("verifier-*.sqlite3")) == [first]
    _run(tmp_path, diloco={"inner_steps": 8, "warmup_steps": 0, "total_steps": 1000})
    assert len(list(tmp_path.glob("verifier-*.sqlite3"))) == 2  # another run, another database
    lines = _run(tmp_path, fresh=True)
    assert first.exists() and any("kept as" in line for line in lines)
    kept = [p for p in tmp_path.glob(f"{first.stem}.*.sqlite3")]
    assert len(kept) == 1 and kept[0].stat().st_size > 0


def test_a_taken_port_is_one_clear_error_and_nothing_on_stderr(tmp_path: Path, capfd) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    lines: list[str] = []
    try:
        with pytest.raises(
            OSError, match=rf"could not listen on 127\.0\.0\.1:{port}: .*address already in use"
        ):
            start_embedded_verifier(home=tmp_path, network=small_network(), port=port, log=lines.append)
    finally:
        taken.close()
    assert capfd.readouterr().err == ""
    assert not any("already in use" in line for line in lines)  # the caller logs the one line
