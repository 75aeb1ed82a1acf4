"""What the evaluator keeps of a measured majority model (issue 14): its round file, which
`neuroshard-export --checkpoint ROUND` turns into a Hugging Face folder with our logits (one
stage and two stages assembled), and every K evaluations a text sample for the dashboard
(SQLite and PostgreSQL).

The fetched models are put straight into the evaluator's pending set (the fetch over the peer
plane is tests/verifier/test_evaluator.py's); from there the real judge, measure and keep run."""

import time
from pathlib import Path

import pytest
import torch
from conftest import PublishedData
from safetensors import safe_open
from safetensors.torch import save_file
from sqlalchemy import select
from tests_support import majority_stages

from neuroshard.cli.export import main as export_main
from neuroshard.cli.verifier import build_config, build_parser
from neuroshard.node.diloco import flat_parameters
from neuroshard.node.generate import SamplingConfig, sample_text
from neuroshard.node.model import Transformer
from neuroshard.node.model_file import round_models
from neuroshard.node.wallet import Wallet
from neuroshard.testing.verifier import small_network
from neuroshard.verifier import models as m
from neuroshard.verifier.background import JobContext
from neuroshard.verifier.db import Database
from neuroshard.verifier.evaluate import stage_hash
from neuroshard.verifier.evaluator import Evaluator, EvaluatorConfig, Fetched, models_dir_for
from neuroshard.verifier.network import NetworkDefinition

OPERATOR = Wallet.from_token("evaluator-keeps-operator")
PROMPT = "The "
SAMPLING = SamplingConfig(max_new_tokens=12, temperature=0.8, top_k=50, top_p=0.95, seed=3)


def _network(stages: int) -> NetworkDefinition:
    return small_network(
        model={"size": "micro", "vocab_size": 512},
        stages={"count": stages},
        training={"batch_size": 4, "seq_len": 32},
        evaluation={"every_rounds": 1},
    )


def _evaluator(
    db: Database, network: NetworkDefinition, published: PublishedData, models: Path | None, **config: object
) -> Evaluator:
    held_out = published.dataset.source.fetch(published.dataset.manifest.shard(0))
    return Evaluator(
        JobContext(db=db, network=network, operator=OPERATOR, log=lambda line: None),
        config=EvaluatorConfig(
            max_batches=2,
            models_dir=models,
            sample_prompt=PROMPT,
            sampling=SAMPLING,
            data_checks=None,
            **config,
        ),  # type: ignore[arg-type]
        held_out=lambda: held_out,
        tokenizer=lambda: published.dataset.tokenizer,
    )


def _settle(db: Database, evaluator: Evaluator, round_: int, stages: list[Transformer]) -> None:
    """Round round_ − 1 of every stage settled with these stages' hashes as its majority, and
    the stages fetched at round round_ waiting in the evaluator."""
    fetched = []
    with db.write() as s:
        for i, stage in enumerate(stages):
            h = stage_hash(stage)
            s.add(m.Round(stage=i, round=round_ - 1, majority_hash=h, votes=3, agreeing=3, synced=0,
                          sync_checked=0, settled_at=time.time()))  # fmt: skip
            theta = flat_parameters(stage.parameters())
            fetched.append(Fetched(stage=i, round=round_, theta_hash=h, theta=theta, wallet_id="w" * 20))
    evaluator.pending[round_] = tuple(fetched)


def _kept_round(database_url: str, published: PublishedData, models: Path, num_stages: int) -> Path:
    """Round 2 of a `num_stages`-stage run measured and kept: the path of its round file."""
    network = _network(num_stages)
    db = Database(database_url)
    evaluator = _evaluator(db, network, published, models, sample_every=0)
    _settle(db, evaluator, 2, majority_stages(network, seed=5))
    evaluator.run_once()
    db.dispose()
    return models / "round-00000002.safetensors"


def _hf_logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return hf(input_ids=ids).logits


@pytest.mark.parametrize("num_stages", [1, 2])
def test_a_measured_round_exports_with_our_logits(
    num_stages: int, database_url: str, published: PublishedData, tmp_path: Path
) -> None:
    network = _network(num_stages)
    models = tmp_path / "home" / "models" / "run"
    db = Database(database_url)
    evaluator = _evaluator(db, network, published, models, sample_every=0)
    stages = majority_stages(network, seed=num_stages)
    _settle(db, evaluator, 4, stages)
    evaluator.run_once()
    with db.read() as s:
        assert [e.round for e in s.scalars(select(m.Evaluation))] == [4]
        assert s.scalars(select(m.TextSample)).all() == []  # sample_every=0: none
    db.dispose()
    assert round_models(models) == [4]
    # A round number; the tokenizer is found beside the round files (no --tokenizer given).
    out = tmp_path / "hf"
    home = tmp_path / "home"
    assert (
        export_main(["--checkpoint", "4", "--models", str(models), "--home", str(home), "--out", str(out)])
        == 0
    )
    ids = torch.tensor([published.dataset.tokenizer.encode("It is a truth universally acknowledged")[:24]])
    with torch.no_grad():
        ours = stages[-1](stages[0](ids)) if num_stages == 2 else stages[0](ids)
    assert (ours - _hf_logits(out, ids)).abs().max().item() <= 1e-4
    # "latest" under --home: the run directory measured last.
    latest = tmp_path / "hf-latest"
    assert export_main(["--checkpoint", "latest", "--home", str(home), "--out", str(latest)]) == 0
    assert (latest / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_round_files_are_bounded_and_an_earlier_runs_are_replaced(
    database_url: str, published: PublishedData, tmp_path: Path
) -> None:
    network = _network(1)
    models = tmp_path / "models"
    db = Database(database_url)
    evaluator = _evaluator(db, network, published, models, sample_every=0, keep_models=2)
    for r in (1, 2, 3):
        _settle(db, evaluator, r, majority_stages(network, seed=r))
        evaluator.run_once()
    assert round_models(models) == [2, 3]
    assert not [p for p in models.iterdir() if p.name.endswith(".tmp")], "no temporary file left"
    db.dispose()
    # A verifier started over on a fresh database measures round 1 again: round files from the
    # earlier run must not pass for its newest.
    db = Database(database_url)
    with db.write() as s:
        for table in (m.Evaluation, m.Round):
            for row in s.scalars(select(table)):
                s.delete(row)
    evaluator = _evaluator(db, network, published, models, sample_every=0, keep_models=2)
    _settle(db, evaluator, 1, majority_stages(network, seed=9))
    evaluator.run_once()
    assert round_models(models) == [1]
    db.dispose()


def test_a_round_judged_after_a_later_one_is_not_kept_and_deletes_nothing(
    database_url: str, published: PublishedData, tmp_path: Path
) -> None:
    """Pipeline stages settle out of order: round 10 may be judged after round 12. Keeping it
    would delete round 12's file as an earlier run's."""
    network = _network(2)
    models = tmp_path / "models"
    db = Database(database_url)
    evaluator = _evaluator(db, network, published, models, sample_every=0)
    for r in (12, 10):
        stages = majority_stages(network, seed=r)
        fetched = tuple(
            Fetched(
                stage=i,
                round=r,
                theta_hash=stage_hash(st),
                theta=flat_parameters(st.parameters()),
                wallet_id="w" * 20,
            )
            for i, st in enumerate(stages)
        )
        evaluator._keep(r, fetched, stages)
    assert round_models(models) == [12]
    db.dispose()


def test_a_round_file_with_reshaped_tensors_is_refused(
    database_url: str, published: PublishedData, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """θ hashes cover values, not shapes: a (3C, C) matrix stored as (C, 3C) hashes the same."""
    models = tmp_path / "models"
    path = _kept_round(database_url, published, models, num_stages=1)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    name = next(k for k, t in tensors.items() if t.dim() == 2 and t.shape[0] != t.shape[1])
    tensors[name] = tensors[name].reshape(tensors[name].shape[1], tensors[name].shape[0]).contiguous()
    save_file(tensors, str(path), meta)
    argv = ["--models", str(models), "--home", str(tmp_path), "--out", str(tmp_path / "o")]
    assert export_main(["--checkpoint", "2", *argv]) == 2
    assert "the model needs" in capsys.readouterr().err
    assert not (tmp_path / "o" / "model.safetensors").exists()


def test_a_damaged_round_file_or_a_missing_round_is_refused(
    database_url: str, published: PublishedData, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    models = tmp_path / "models"
    path = _kept_round(database_url, published, models, num_stages=2)
    argv = ["--models", str(models), "--home", str(tmp_path), "--out", str(tmp_path / "o")]
    assert export_main(["--checkpoint", "7", *argv]) == 2
    assert "round 7 is not kept" in capsys.readouterr().err
    raw = bytearray(path.read_bytes())
    raw[-8:] = b"\x00\x00\x80\x7f" * 2  # the last two weights (of norm.weight, stage 1) become +inf
    path.write_bytes(bytes(raw))
    assert export_main(["--checkpoint", "2", *argv]) == 2
    assert "the file is damaged" in capsys.readouterr().err
    path.write_bytes(bytes(raw[: len(raw) // 2]))  # cut short
    assert export_main(["--checkpoint", "2", *argv]) == 2
    assert "not a safetensors file" in capsys.readouterr().err
    assert not (tmp_path / "o" / "model.safetensors").exists()


def test_a_sample_is_stored_every_k_evaluations(
    database_url: str, published: PublishedData, tmp_path: Path
) -> None:
    network = _network(1)
    db = Database(database_url)
    evaluator = _evaluator(db, network, published, None, sample_every=2)
    expected = {}
    for r in range(1, 6):
        stages = majority_stages(network, seed=10 + r)
        _settle(db, evaluator, r, stages)
        evaluator.run_once()
        expected[r] = sample_text(
            stages[0], published.dataset.tokenizer, PROMPT, SAMPLING, max_seq_len=network.model.max_seq_len
        )
    with db.read() as s:
        assert [e.round for e in s.scalars(select(m.Evaluation).order_by(m.Evaluation.round))] == [
            1,
            2,
            3,
            4,
            5,
        ]
        samples = s.scalars(select(m.TextSample).order_by(m.TextSample.round)).all()
        # The first evaluation, then every second one: rounds 1, 3, 5.
        assert [x.round for x in samples] == [1, 3, 5]
        assert [x.text for x in samples] == [expected[1], expected[3], expected[5]]
        assert {(x.prompt, x.max_new_tokens, x.seed) for x in samples} == {(PROMPT, 12, 3)}
    assert any(expected[r] for r in (1, 3, 5)), "the model generated some text"
    # A restarted evaluator keeps the pace from the database: one more evaluation is not enough.
    evaluator = _evaluator(db, network, published, None, sample_every=2)
    _settle(db, evaluator, 6, majority_stages(network, seed=16))
    evaluator.run_once()
    with db.read() as s:
        assert max(s.scalars(select(m.TextSample.round))) == 5
    db.dispose()


# --- neuroshard-verifier's flags --------------------------------------------------------------

CLI_NETWORK = """
name = "cli"
[model]
size = "tiny"
vocab_size = 512
[data]
manifest_url = "http://127.0.0.1:1/"
publisher_key = "%s"
""" % ("ab" * 32)


def test_the_verifier_keeps_models_under_its_home_and_samples_as_told(tmp_path: Path) -> None:
    network = tmp_path / "network.toml"
    network.write_text(CLI_NETWORK)
    base = ["--network", str(network), "--home", str(tmp_path), "--init-operator-key"]
    config = build_config(build_parser().parse_args([*base, "--keep-models", "5", "--sample-every", "2"]))
    evaluation = config.live_evaluation
    assert evaluation is not None
    assert evaluation.models_dir == models_dir_for(tmp_path, config.network)
    assert evaluation.models_dir.parent == tmp_path / "models"
    assert (evaluation.keep_models, evaluation.sample_every) == (5, 2)
    with pytest.raises(ValueError, match="keep_models must be ≥ 1"):
        build_config(build_parser().parse_args([*base, "--keep-models", "0"]))
    with pytest.raises(ValueError, match="sample_every"):
        build_config(build_parser().parse_args([*base, "--sample-every", "-1"]))


def test_a_sample_spelling_nul_is_stored_on_every_database(
    database_url: str, published: PublishedData, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Byte token 10 is the byte 0x00, which a model may well emit; PostgreSQL's text type refuses
    NUL, so it is stored as U+FFFD like any other undecodable byte."""
    network = _network(1)
    db = Database(database_url)
    evaluator = _evaluator(db, network, published, None, sample_every=1)
    stages = majority_stages(network, seed=21)
    natural = sample_text(stages[0], published.dataset.tokenizer, PROMPT, SAMPLING, max_seq_len=64)
    monkeypatch.setattr("neuroshard.verifier.evaluator.sample_text", lambda *a, **k: natural + "\x00end")
    _settle(db, evaluator, 1, stages)
    evaluator.run_once()
    with db.read() as s:
        assert [x.text for x in s.scalars(select(m.TextSample))] == [natural + "\N{REPLACEMENT CHARACTER}end"]
    db.dispose()
