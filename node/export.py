"""`neuroshard-export`: a trained model as a Hugging Face Llama folder that standard tools load.

Our architecture (node.model) is Llama's (Touvron et al. 2023) with the same conventions, so the
export renames and splits tensors and changes no value:

- RMSNorm x / sqrt(mean(x²) + eps) · g, eps = norm_eps (HF `rms_norm_eps`), no bias anywhere.
- Rotary positions rotate channel pairs (i, i + head_dim/2) at angle pos · theta^(−2i/head_dim):
  HF's `rotate_half` convention, so q and k need no permutation (the permutation in HF's
  conversion script undoes Meta's interleaved pairs (2i, 2i+1), which we never used).
- q, k, v come from one fused (3·C, C) matrix whose rows are [q heads | k heads | v heads]:
  split into q_proj, k_proj, v_proj (all heads are key/value heads: no grouped-query attention).
- SwiGLU down(silu(gate(x)) · up(x)) is HF's LlamaMLP; untied embedding and head.

Also written: generation_config.json and the tokenizer as HF `tokenizers` JSON with our ids
(specials 0-9, bytes 10-265, merges 266+). One difference from our encoder: HF tokenizers turn
the text "<|eos|>" into the special id, ours spells it as bytes (node text never holds it).

Sources: a node's checkpoint (the model is named by its fingerprint among the presets), or a
model file (`save_model_file`: safetensors of a whole model's weights with its ModelConfig),
e.g. the verifier's majority model with its stages assembled (`assemble_stages`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from neuroshard.data.publish import TOKENIZER_NAME
from neuroshard.tokenizer import BPETokenizer
from neuroshard.tokenizer.bpe import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID

from .checkpoint import CHECKPOINT_FORMAT
from .model import MODEL_SIZES, ModelConfig, Transformer

PROG = "neuroshard-export"
MODEL_FILE_FORMAT = "neuroshard-model"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class TrainedModel:
    """A whole model's weights (our parameter names) with its config and, if known, its tokenizer."""

    config: ModelConfig
    state_dict: dict[str, Tensor]
    tokenizer_sha256: str | None

    def build(self) -> Transformer:
        model = Transformer(self.config)
        model.load_state_dict(self.state_dict)
        return model.eval()


# ----- our names → HF LlamaForCausalLM names -----


def llama_state_dict(config: ModelConfig, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Our whole-model state dict under LlamaForCausalLM's parameter names (contiguous copies)."""
    with torch.device("meta"):  # names only, nothing allocated
        expected = set(Transformer(config).state_dict())
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(
            f"not the whole model's tensors: missing {missing[:4]} ({len(missing)}), "
            f"unexpected {extra[:4]} ({len(extra)})"
        )
    c = config.dim
    out: dict[str, Tensor] = {
        "model.embed_tokens.weight": state["embedding.weight"],
        "model.norm.weight": state["norm.weight"],
        "lm_head.weight": state["head.weight"],
    }
    for i in range(config.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        qkv = state[ours + "attn.qkv.weight"]  # (3C, C): rows [q | k | v], each (C, C)
        out |= {
            hf + "self_attn.q_proj.weight": qkv[:c],
            hf + "self_attn.k_proj.weight": qkv[c : 2 * c],
            hf + "self_attn.v_proj.weight": qkv[2 * c :],
            hf + "self_attn.o_proj.weight": state[ours + "attn.proj.weight"],
            hf + "mlp.gate_proj.weight": state[ours + "mlp.gate.weight"],
            hf + "mlp.up_proj.weight": state[ours + "mlp.up.weight"],
            hf + "mlp.down_proj.weight": state[ours + "mlp.down.weight"],
            hf + "input_layernorm.weight": state[ours + "attn_norm.weight"],
            hf + "post_attention_layernorm.weight": state[ours + "mlp_norm.weight"],
        }
    return {k: v.detach().contiguous() for k, v in out.items()}


def llama_config(config: ModelConfig, dtype: str = "fp32") -> dict[str, object]:
    """config.json of LlamaForCausalLM (transformers 4.x reads rope_theta, 5.x rope_parameters)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
        "use_cache": True,
    }


def hf_tokenizer_json(tokenizer: BPETokenizer) -> str:
    """tokenizer.json for HF `tokenizers` with our ids: the engine's BPE (bytes and merges, ids 10+)
    plus the special names at ids 0-9, in the vocabulary and as special added tokens (an added
    token found in the vocabulary keeps its id there; otherwise it would be appended)."""
    doc = json.loads(tokenizer.engine.to_str())
    vocab: dict[str, int] = doc["model"]["vocab"]
    for i, name in enumerate(SPECIAL_TOKENS):
        if name in vocab:
            raise ValueError(
                f"merge id {vocab[name]} spells the special token {name!r}: HF tokenizers cannot hold both"
            )
        vocab[name] = i
    doc["added_tokens"] = [
        {
            "id": i,
            "content": name,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, name in enumerate(SPECIAL_TOKENS)
    ]
    return json.dumps(doc, ensure_ascii=False)


def export_hf(
    out: Path, model: TrainedModel, tokenizer: BPETokenizer | None, *, dtype: str = "fp32"
) -> list[Path]:
    """Write the HF Llama folder; returns the files written. Tokenizer files only with a tokenizer."""
    if tokenizer is not None and tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} ids, the model {model.config.vocab_size}: not the model's tokenizer"
        )
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(DTYPES[dtype]) for k, v in llama_state_dict(model.config, model.state_dict).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    files = {
        "config.json": llama_config(model.config, dtype),
        "generation_config.json": {
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
            "do_sample": True,
            "temperature": 0.8,
            "top_p": 0.95,
            "max_length": model.config.max_seq_len,
        },
    }
    if tokenizer is not None:
        (out / "tokenizer.json").write_text(hf_tokenizer_json(tokenizer), encoding="utf-8")
        specials = {
            "bos_token": SPECIAL_TOKENS[BOS_ID],
            "eos_token": SPECIAL_TOKENS[EOS_ID],
            "pad_token": SPECIAL_TOKENS[PAD_ID],
            "unk_token": SPECIAL_TOKENS[UNK_ID],
        }
        files["tokenizer_config.json"] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model.config.max_seq_len,
            "clean_up_tokenization_spaces": False,
            **specials,
        }
        files["special_tokens_map.json"] = specials
    for name, doc in files.items():
        (out / name).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return sorted(out.iterdir())


# ----- sources -----


def assemble_stages(stages: Sequence[nn.Module]) -> dict[str, Tensor]:
    """The whole model's state dict from its pipeline stages in order (stage 0 first). Parameter
    names carry global layer indices (node.model), so the union of the stages' is the whole one."""
    whole: dict[str, Tensor] = {}
    for s, stage in enumerate(stages):
        for name, tensor in stage.state_dict().items():
            if name in whole:
                raise ValueError(f"stage {s} holds {name!r}, already held by an earlier stage")
            whole[name] = tensor.detach().to("cpu", torch.float32)
    return whole


def save_model_file(
    path: Path, config: ModelConfig, state: Mapping[str, Tensor], tokenizer_sha256: str
) -> None:
    """A whole model as one safetensors file with its ModelConfig and tokenizer hash in the header."""
    metadata = {
        "format": MODEL_FILE_FORMAT,
        "model_config": json.dumps(config.to_dict(), sort_keys=True),
        "tokenizer_sha256": tokenizer_sha256,
    }
    save_file(
        {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}, str(path), metadata
    )


def _from_model_file(path: Path) -> TrainedModel:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != MODEL_FILE_FORMAT:
            raise ValueError(f"{path}: not a {MODEL_FILE_FORMAT} file (header format {meta.get('format')!r})")
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    config = ModelConfig.from_dict(json.loads(meta["model_config"]))
    return TrainedModel(config, state, meta.get("tokenizer_sha256"))


def _config_of_checkpoint(fingerprint: str, vocab_size: int, model_size: str | None) -> ModelConfig:
    """The ModelConfig whose architecture fingerprint the checkpoint records, among the presets."""
    names = [model_size] if model_size else list(MODEL_SIZES)
    for name in names:
        config = ModelConfig.named(name, vocab_size=vocab_size)
        if config.architecture_fingerprint() == fingerprint:
            return config
    raise ValueError(
        f"the checkpoint's model fingerprint {fingerprint[:16]}… is none of the presets "
        f"{names} (a pipeline stage's checkpoint holds part of a model: export the assembled model file)"
    )


def load_trained_model(path: Path, *, model_size: str | None = None) -> TrainedModel:
    """A node's checkpoint (single stage) or a model file, as a whole model on the CPU."""
    if path.suffix == ".safetensors":
        return _from_model_file(path)
    try:
        payload = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # the restricted unpickler raises many types
        raise ValueError(f"{path}: not a readable checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not a node checkpoint (format {CHECKPOINT_FORMAT})")
    identity, state = payload["identity"], payload["state"]
    if identity.get("stage") != 0 or "head.weight" not in state["model"]:
        raise ValueError(
            f"{path}: a pipeline stage's checkpoint holds part of the model; assemble the stages"
        )
    config = _config_of_checkpoint(identity["model_fingerprint"], int(state["vocab_size"]), model_size)
    weights = {k: v.to(torch.float32) for k, v in state["model"].items()}
    return TrainedModel(config, weights, identity.get("tokenizer_sha256"))


def find_tokenizer(model: TrainedModel, candidates: Sequence[Path]) -> BPETokenizer | None:
    """The first candidate tokenizer.json (a file or a data set directory) whose sha256 is the
    model's; ValueError if one is given but none matches, None if there are no candidates."""
    tried = []
    for candidate in candidates:
        path = candidate / TOKENIZER_NAME if candidate.is_dir() else candidate
        if not path.is_file():
            continue
        tokenizer = BPETokenizer.load(path)
        if model.tokenizer_sha256 in (None, tokenizer.sha256):
            return tokenizer
        tried.append(f"{path} ({tokenizer.sha256[:12]}…)")
    if tried:
        raise ValueError(
            f"no tokenizer matches the model's {(model.tokenizer_sha256 or '')[:12]}…; tried {', '.join(tried)}"
        )
    return None


def add_source_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="a node checkpoint (HOME/checkpoints/WALLET-stage0.pt) or a whole-model .safetensors file",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        action="append",
        default=[],
        help="tokenizer.json or a data set directory holding it (default: HOME/data/default)",
    )
    p.add_argument("--home", type=Path, default=Path.home() / ".neuroshard", help="node state directory")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), help="preset (default: found by fingerprint)")


def open_source(args: argparse.Namespace) -> tuple[TrainedModel, BPETokenizer | None]:
    model = load_trained_model(args.checkpoint, model_size=args.model_size)
    tokenizer = find_tokenizer(model, [*args.tokenizer, args.home / "data" / "default"])
    return model, tokenizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_source_arguments(p)
    p.add_argument("--out", type=Path, required=True, help="folder to write (created if missing)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="tensor type of model.safetensors")
    args = p.parse_args(argv)
    try:
        model, tokenizer = open_source(args)
        if tokenizer is None:
            raise ValueError("no tokenizer.json found: pass --tokenizer (a file or the data set directory)")
        files = export_hf(args.out, model, tokenizer, dtype=args.dtype)
    except (ValueError, OSError, KeyError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    n = sum(v.numel() for v in model.state_dict.values())
    print(f"exported {n:,} parameters ({args.dtype}) to {args.out}: {', '.join(f.name for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
