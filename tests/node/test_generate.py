"""Sampling text from a trained model: the sampler's cuts, streaming, and the command."""

import threading
from pathlib import Path

import pytest
import torch

from neuroshard.cli.generate import main
from neuroshard.node.diloco import DiLoCoConfig
from neuroshard.node.export import TrainedModel, export_hf
from neuroshard.node.generate import SamplingConfig, TextStream, generate, next_token, sample_text
from neuroshard.node.model import ModelConfig
from neuroshard.node.trainer import Trainer, TrainerConfig
from neuroshard.tokenizer.bpe import BYTE_OFFSET


def test_greedy_top_k_and_top_p_cuts() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
    gen = torch.Generator().manual_seed(0)
    assert next_token(logits, SamplingConfig(temperature=0), gen) == 1
    assert next_token(logits, SamplingConfig(temperature=5.0, top_k=1, top_p=None), gen) == 1
    assert next_token(logits, SamplingConfig(temperature=5.0, top_k=None, top_p=1e-6), gen) == 1
    draws = {
        next_token(logits, SamplingConfig(temperature=5.0, top_k=2, top_p=None), gen) for _ in range(200)
    }
    assert draws == {1, 2}
    # softmax([3, 2.9, 1, 0, -1]) is 0.474, 0.429, 0.064, ...: p = 0.95 keeps tokens 1, 2 and 4.
    draws = {
        next_token(logits, SamplingConfig(temperature=1.0, top_k=None, top_p=0.95), gen) for _ in range(400)
    }
    assert draws == {1, 2, 4}
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=1.5)


def test_a_character_split_across_tokens_is_printed_once_whole(published) -> None:
    stream = TextStream(published.dataset.tokenizer)
    first, second = "é".encode()
    assert stream.push(BYTE_OFFSET + ord("a")) == "a"
    assert stream.push(BYTE_OFFSET + first) == ""
    assert stream.push(BYTE_OFFSET + second) == "é"
    assert stream.push(2) == ""  # <|eos|>: nothing printed
    assert stream.flush() == ""


@pytest.fixture(scope="module")
def trained(published, tmp_path_factory: pytest.TempPathFactory) -> Trainer:  # type: ignore[no-untyped-def]
    trainer = Trainer(
        wallet_id="feedface",
        dataset=published.dataset,
        model_config=ModelConfig.named("micro", vocab_size=published.dataset.tokenizer.vocab_size),
        diloco_config=DiLoCoConfig(inner_steps=20, warmup_steps=5, total_steps=60, inner_lr=1e-2),
        config=TrainerConfig(batch_size=8, seq_len=64, max_steps=60, log_every=1000),
        checkpoint_dir=tmp_path_factory.mktemp("ckpt"),
        log=lambda line: None,
    )
    trainer.run(threading.Event())
    return trainer


def test_generation_produces_text_and_a_seed_repeats_it(published, trained: Trainer) -> None:
    tokenizer = published.dataset.tokenizer
    cfg = SamplingConfig(max_new_tokens=40, temperature=0.8, seed=3)
    pieces: list[str] = []
    text = sample_text(trained.model, tokenizer, "def ", cfg, max_seq_len=64, on_text=pieces.append)
    assert len(text.strip()) >= 10 and "".join(pieces) == text
    assert sample_text(trained.model, tokenizer, "def ", cfg, max_seq_len=64) == text
    # Past max_seq_len the context is cropped rather than refused.
    long = list(generate(trained.model, tokenizer.encode("x = 1\n" * 30), cfg, max_seq_len=64))
    assert len(long) > 0


def test_greedy_generation_equals_transformers_on_the_exported_model(
    published, trained: Trainer, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = published.dataset.tokenizer
    config = trained.model.config
    export_hf(tmp_path, TrainedModel(config, dict(trained.model.state_dict()), tokenizer.sha256), tokenizer)
    prompt = tokenizer.encode("import os\n")
    ours = list(
        generate(
            trained.model,
            prompt,
            SamplingConfig(max_new_tokens=12, temperature=0),
            max_seq_len=64,
            stop_ids=(),
        )
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert out[0, len(prompt) :].tolist() == ours


def test_the_command_streams_the_prompt_and_its_continuation(
    published, trained: Trainer, capsys, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    argv = ["--checkpoint", str(trained.checkpoint_file), "--tokenizer", str(published.directory)]
    argv += ["--prompt", "class ", "--seed", "1", "--max-new-tokens", "30", "--home", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("class ") and len(out.strip()) > len("class ") + 5
