"""Export to the Hugging Face Llama format: transformers loads the folder and computes our logits."""

import threading
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from neuroshard.cli.export import main
from neuroshard.cli.generate import main as generate_main
from neuroshard.node.diloco import DiLoCoConfig
from neuroshard.node.export import export_hf, load_trained_model
from neuroshard.node.model import ModelConfig, Transformer, build_stage
from neuroshard.node.model_file import (
    StageProvenance,
    TrainedModel,
    assemble_stages,
    save_model_file,
    save_round_model,
)
from neuroshard.node.trainer import Trainer, TrainerConfig
from neuroshard.verifier.evaluate import build_from_state_dicts, stage_hash

transformers = pytest.importorskip("transformers")  # the dev extra installs it; `neuroshard[hf]` for users
tokenizers = pytest.importorskip("tokenizers")

HELD_OUT = (
    "Held-out text, not from the training corpus: naïve café façades, 3.14159 ≈ π, "
    "tabs\there, CRLF\r\nlines, emoji 🚀, and Ελληνικά.\n\n    indented code = [x ** 2 for x in range(10)]\n"
)
TOLERANCE = 1e-4


def _perturbed(model: nn.Module, seed: int) -> nn.Module:
    """Random norm gains (init is all ones) so a swapped norm would show in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    return model


def _config(vocab_size: int) -> ModelConfig:
    # 4 heads of 8 channels and an odd ffn_dim: any head split or rotary convention slip shows.
    return ModelConfig(
        vocab_size=vocab_size, dim=32, n_layers=3, n_heads=4, ffn_dim=72, max_seq_len=64, rope_theta=500.0
    )


def _hf_logits(directory: Path, ids: Tensor) -> Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        return hf(input_ids=ids).logits


def _prompt(published, length: int = 48) -> Tensor:  # type: ignore[no-untyped-def]
    ids = published.dataset.tokenizer.encode(HELD_OUT)[:length]
    assert len(ids) == length
    return torch.tensor([ids])


def test_transformers_gives_our_logits(published, tmp_path: Path) -> None:
    tokenizer = published.dataset.tokenizer
    config = _config(tokenizer.vocab_size)
    model = _perturbed(Transformer(config), 0).eval()
    export_hf(tmp_path, TrainedModel(config, dict(model.state_dict()), tokenizer.sha256), tokenizer)
    ids = _prompt(published)
    with torch.no_grad():
        ours = model(ids)
    theirs = _hf_logits(tmp_path, ids)
    assert (ours - theirs).abs().max().item() <= TOLERANCE
    assert {p.name for p in tmp_path.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
    }


def test_the_tokenizer_round_trips_through_hf_tokenizers_and_transformers(published, tmp_path: Path) -> None:
    tokenizer = published.dataset.tokenizer
    config = _config(tokenizer.vocab_size)
    export_hf(tmp_path, TrainedModel(config, dict(Transformer(config).state_dict()), None), tokenizer)
    ours = tokenizer.encode(HELD_OUT)
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert hf.encode(HELD_OUT, add_special_tokens=False).ids == ours
    assert hf.decode(ours) == tokenizer.decode(ours) == HELD_OUT
    assert [hf.token_to_id(name) for name in ("<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>")] == [0, 1, 2, 3]
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (auto.pad_token_id, auto.bos_token_id, auto.eos_token_id) == (0, 1, 2)
    assert auto(HELD_OUT, add_special_tokens=False)["input_ids"] == ours
    assert auto.decode([1, *ours, 2], skip_special_tokens=True) == HELD_OUT


@pytest.mark.parametrize("steps", [6, 8], ids=["mid-round", "at-a-round-boundary"])
def test_export_from_a_node_checkpoint(steps: int, published, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """At a round boundary the checkpoint's weights are views of its θ_round (one storage): the
    export must still write and load them."""
    vocab = published.dataset.tokenizer.vocab_size
    trainer = Trainer(
        wallet_id="feedface",
        dataset=published.dataset,
        model_config=ModelConfig.named("micro", vocab_size=vocab),
        diloco_config=DiLoCoConfig(inner_steps=4, warmup_steps=2, total_steps=20),
        config=TrainerConfig(batch_size=2, seq_len=32, max_steps=steps, log_every=100),
        checkpoint_dir=tmp_path / "ckpt",
        log=lambda line: None,
    )
    trainer.run(threading.Event())
    assert trainer.diloco.steps_in_round == steps % 4
    out = tmp_path / "hf"
    argv = ["--checkpoint", str(trainer.checkpoint_file), "--tokenizer", str(published.directory)]
    assert main([*argv, "--out", str(out), "--home", str(tmp_path)]) == 0
    ids = _prompt(published)
    with torch.no_grad():
        ours = trainer.model.eval()(ids)
    assert (ours - _hf_logits(out, ids)).abs().max().item() <= TOLERANCE
    loaded = load_trained_model(trainer.checkpoint_file)
    assert loaded.config == ModelConfig.named("micro", vocab_size=vocab)


def test_export_of_the_assembled_stages_of_a_pipeline(published, tmp_path: Path) -> None:
    """The verifier measures a pipeline's majority model as its stages run in order
    (verifier.evaluate.build_from_state_dicts); assembled and exported, HF gives the same logits."""
    tokenizer = published.dataset.tokenizer
    config = _config(tokenizer.vocab_size)
    states = [dict(_perturbed(build_stage(config, s, 2), s).state_dict()) for s in range(2)]
    stages = build_from_state_dicts(config, states)
    path = tmp_path / "majority.safetensors"
    save_model_file(path, config, assemble_stages(stages), tokenizer.sha256)
    out = tmp_path / "hf"
    assert main(["--checkpoint", str(path), "--tokenizer", str(published.directory), "--out", str(out)]) == 0
    ids = _prompt(published)
    with torch.no_grad():
        ours = stages[1](stages[0](ids))
    assert (ours - _hf_logits(out, ids)).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("num_stages", [1, 2])
def test_export_of_a_round_of_the_verifiers(num_stages: int, published, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A round file as the verifier keeps it (verifier.evaluator writes them; its own test runs
    that path): `--checkpoint ROUND` exports it and `neuroshard-generate` samples from it."""
    tokenizer = published.dataset.tokenizer
    config = _config(tokenizer.vocab_size)
    states = [
        dict(_perturbed(build_stage(config, s, num_stages), 10 + s).state_dict()) for s in range(num_stages)
    ]
    stages = build_from_state_dicts(config, states)
    provenance = [StageProvenance(s, 12, stage_hash(stage)) for s, stage in enumerate(stages)]
    home = tmp_path / "home"
    save_round_model(home / "models" / "run", 12, config, stages, provenance, tokenizer, keep=2)
    out = tmp_path / "hf"
    assert main(["--checkpoint", "latest", "--home", str(home), "--out", str(out)]) == 0
    ids = _prompt(published)
    with torch.no_grad():
        ours = stages[-1](stages[0](ids)) if num_stages == 2 else stages[0](ids)
    assert (ours - _hf_logits(out, ids)).abs().max().item() <= TOLERANCE
    capsys.readouterr()
    argv = [
        "--checkpoint",
        "12",
        "--home",
        str(home),
        "--prompt",
        "The ",
        "--max-new-tokens",
        "8",
        "--seed",
        "1",
    ]
    assert generate_main(argv) == 0
    assert capsys.readouterr().out.startswith("The ")
    # A round the verifier does not keep, or a stage whose weights are not its majority's.
    assert main(["--checkpoint", "11", "--home", str(home), "--out", str(tmp_path / "o")]) == 2
    assert "round 11 is not kept" in capsys.readouterr().err
    wrong = [*provenance[:-1], StageProvenance(num_stages - 1, 12, "0" * 64)]
    with pytest.raises(ValueError, match=f"stage {num_stages - 1} hashes to"):
        save_round_model(home / "models" / "run", 13, config, stages, wrong, tokenizer, keep=2)


def test_a_tokenizer_other_than_the_models_is_refused(published, tmp_path: Path) -> None:
    config = _config(published.dataset.tokenizer.vocab_size)
    path = tmp_path / "model.safetensors"
    save_model_file(path, config, dict(Transformer(config).state_dict()), "0" * 64)
    argv = ["--checkpoint", str(path), "--tokenizer", str(published.directory), "--out", str(tmp_path / "o")]
    assert main(argv) == 2


def test_a_stage_that_is_not_the_whole_model_is_refused() -> None:
    config = _config(300)
    with pytest.raises(ValueError, match="missing"):
        export_hf(
            Path("/nonexistent"),
            TrainedModel(config, dict(build_stage(config, 0, 2).state_dict()), None),
            None,
        )
