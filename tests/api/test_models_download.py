"""The verifier's kept majority models over its API (issue 14): GET /api/training/models lists
them, GET /api/training/models/{round} streams a round file, and `neuroshard-export --verifier
URL --checkpoint ROUND` downloads one, checks each stage's hash against the verifier's settled
majority and writes a Hugging Face folder with our logits."""

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from tests_support import majority_stages

from neuroshard.api import reads
from neuroshard.api.app import create_app
from neuroshard.cli.export import main as export_main
from neuroshard.node.model import Transformer
from neuroshard.node.model_file import StageProvenance, round_model_path, save_round_model
from neuroshard.node.wallet import Wallet
from neuroshard.testing.api import Harness, start_verifier_process, test_config
from neuroshard.testing.ports import free_port
from neuroshard.testing.verifier import ManualClock, small_network
from neuroshard.tokenizer import BPETokenizer
from neuroshard.verifier import models as m
from neuroshard.verifier.db import Database
from neuroshard.verifier.evaluate import stage_hash
from neuroshard.verifier.evaluator import EvaluatorConfig, models_dir_for
from neuroshard.verifier.network import NetworkDefinition, load_network


def _keep(models: Path, round_: int, stages: list[Transformer], network: NetworkDefinition, tokenizer: BPETokenizer) -> list[StageProvenance]:  # fmt: skip
    provenance = [StageProvenance(s, round_ + s, stage_hash(stage)) for s, stage in enumerate(stages)]
    save_round_model(models, round_, network.model, stages, provenance, tokenizer, keep=3)
    return provenance


@pytest.fixture
def models_harness(database_url: str, tmp_path: Path) -> Iterator[Harness]:
    clock = ManualClock()
    evaluation = EvaluatorConfig(poll_s=3600, models_dir=tmp_path / "models")
    config = test_config(database_url, clock, live_evaluation=evaluation)
    with TestClient(create_app(config)) as client:
        yield Harness(client, clock, config)


def test_the_kept_rounds_are_listed_and_served_whole(
    models_harness: Harness, published, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    h = models_harness
    assert h.client.get("/api/training/models").json() == {"models": []}
    network = small_network(model={"size": "micro", "vocab_size": 512}, stages={"count": 2})
    tokenizer = published.dataset.tokenizer
    provenance = _keep(tmp_path / "models", 5, majority_stages(network, 1), network, tokenizer)
    h.clock.advance(10)  # the listing is re-rendered once stale
    listing = h.client.get("/api/training/models").json()["models"]
    path = round_model_path(tmp_path / "models", 5)
    assert listing == [
        {
            "round": 5,
            "bytes": path.stat().st_size,
            "tokenizer_sha256": tokenizer.sha256,
            "stages": [{"stage": p.stage, "round": p.round, "theta_hash": p.theta_hash} for p in provenance],
        }
    ]
    reply = h.client.get("/api/training/models/5")
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/octet-stream"
    assert reply.content == path.read_bytes()
    assert reply.headers["content-length"] == str(path.stat().st_size)
    again = h.client.get("/api/training/models/5", headers={"If-None-Match": reply.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    tok = h.client.get("/api/training/models/5/tokenizer.json")
    assert tok.status_code == 200 and BPETokenizer.from_bytes(tok.content).sha256 == tokenizer.sha256
    missing = h.client.get("/api/training/models/4")
    assert missing.status_code == 404 and "kept: 5" in missing.json()["detail"]
    assert h.client.get("/api/training/models/-1").status_code == 422


def test_a_verifier_without_evaluation_keeps_none(harness: Harness) -> None:
    assert harness.client.get("/api/training/models").json() == {"models": []}
    reply = harness.client.get("/api/training/models/1")
    assert reply.status_code == 404 and "keeps none" in reply.json()["detail"]


def _settle(url: str, provenance: list[StageProvenance], majorities: list[str]) -> None:
    """Each stage's round R_s − 1 settled on the given majority (one vote; written directly)."""
    db = Database(url)
    db.upgrade()
    now = time.time()
    voter = Wallet.from_token("models-download-voter")
    with db.write() as s:
        s.add(m.Wallet(wallet_id=voter.wallet_id, public_key=voter.public_key_hex, reputation=0.5,
                       status=m.STATUS_ACTIVE, registered_at=now, software_version="0.1.0"))  # fmt: skip
        s.flush()
        for p, majority in zip(provenance, majorities, strict=True):
            s.add(m.HashVote(stage=p.stage, round=p.round - 1, wallet_id=voter.wallet_id, result_hash=majority,
                             base_hash="0" * 64))  # fmt: skip
            s.add(m.Round(stage=p.stage, round=p.round - 1, majority_hash=majority, votes=1, agreeing=1,
                          synced=0, sync_checked=0, settled_at=now))  # fmt: skip
    db.dispose()


@pytest.mark.slow
def test_export_downloads_a_round_from_a_verifier(published, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    url = f"sqlite:///{tmp_path / 'verifier.sqlite3'}"
    port = free_port()
    process = start_verifier_process(tmp_path, url, port, network_toml=_TWO_STAGES)
    try:
        network = load_network(tmp_path / "network.toml")
        models = models_dir_for(tmp_path, network)  # where the verifier process keeps its round files
        stages = majority_stages(network, 2)
        provenance = _keep(models, 7, stages, network, published.dataset.tokenizer)
        lie = majority_stages(network, 3)  # a round file whose stage 1 is not what the verifier settled on
        lying = _keep(models, 8, [stages[0], lie[1]], network, published.dataset.tokenizer)
        unsettled = _keep(models, 9, stages, network, published.dataset.tokenizer)  # nobody settled it
        majorities = [p.theta_hash for p in provenance] + [lying[0].theta_hash, provenance[1].theta_hash]
        _settle(url, [*provenance, *lying], majorities)
        del unsettled
        time.sleep(5.5)  # past the read cache's max-age: the listing shows the new files
        home = tmp_path / "user"  # nothing on the user's machine: everything comes from the verifier
        base = ["--verifier", f"http://127.0.0.1:{port}", "--home", str(home)]
        out = tmp_path / "hf"
        assert export_main(["--checkpoint", "7", *base, "--out", str(out)]) == 0
        refused = export_main(["--checkpoint", "8", *base, "--out", str(tmp_path / "no")])
        err = capsys.readouterr().err
        unchecked = export_main(["--checkpoint", "latest", *base, "--out", str(tmp_path / "no")])
        unlisted = capsys.readouterr().err
        assert export_main(["--checkpoint", "6", *base, "--out", str(tmp_path / "no")]) == 2
        missing = capsys.readouterr().err
    finally:
        process.terminate()
        process.wait(timeout=10)
    assert refused == 2 and "settled round 8 of stage 1 on" in err, err
    assert unchecked == 2 and "does not list round 8 of stage 0 as settled" in unlisted, unlisted
    assert not (tmp_path / "no").exists()
    assert "round 6 is not kept" in missing and "kept: 7, 8, 9" in missing
    ids = torch.tensor([published.dataset.tokenizer.encode("It is a truth universally acknowledged")[:24]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        ours = stages[1](stages[0](ids))
        assert (ours - hf(input_ids=ids).logits).abs().max().item() <= 1e-4
    assert (out / "tokenizer.json").is_file()


_TWO_STAGES = """
name = "test"
[model]
size = "micro"
vocab_size = 512
[stages]
count = 2
[training]
batch_size = 4
seq_len = 32
[data]
manifest_url = "http://127.0.0.1:1/"
publisher_key = "%s"
""" % ("ab" * 32)


def test_head_on_a_round_file_answers_its_headers_without_reading_it(
    models_harness: Harness, published, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HEAD is routed as GET (api.cache.HeadAsGet), which would stream the whole file and drop it."""
    network = small_network(model={"size": "micro", "vocab_size": 512}, stages={"count": 2})
    _keep(tmp_path / "models", 5, majority_stages(network, 1), network, published.dataset.tokenizer)
    path = round_model_path(tmp_path / "models", 5)
    streamed: list[int] = []
    real = reads.StreamingResponse

    def recording(content, *args, **kwargs):  # type: ignore[no-untyped-def]
        streamed.append(1)
        return real(content, *args, **kwargs)

    monkeypatch.setattr(reads, "StreamingResponse", recording)
    reply = models_harness.client.head("/api/training/models/5")
    assert reply.status_code == 200 and reply.content == b""
    assert reply.headers["content-length"] == str(path.stat().st_size)
    assert streamed == []
    assert models_harness.client.get("/api/training/models/5").content == path.read_bytes()
    assert streamed == [1]
