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

Sources: a node's checkpoint (the model is named by its fingerprint among the presets), a
model file (`save_model_file`: safetensors of a whole model's weights with its ModelConfig), or
a round: the verifier keeps the majority model of its latest measured rounds, stages assembled,
as round files in HOME/models (`save_round_model`; verifier.evaluator writes them), and
`--checkpoint 12` (or `latest`) exports round 12's. A round file names every stage's round and
majority θ hash; each stage's weights are re-hashed against it before use.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
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
from .diloco import tensor_sha256
from .model import MODEL_SIZES, ModelConfig, Transformer, build_stage

PROG = "neuroshard-export"
MODEL_FILE_FORMAT = "neuroshard-model"
MODELS_DIR = "models"
"""HOME/models/RUN: the round files of the verifier's majority models, a directory per run."""
_ROUND_FILE = re.compile(r"^round-(\d{8,})\.safetensors$")
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
    path: Path,
    config: ModelConfig,
    state: Mapping[str, Tensor],
    tokenizer_sha256: str,
    *,
    extra: Mapping[str, str] | None = None,
) -> None:
    """A whole model as one safetensors file with its ModelConfig and tokenizer hash in the header
    (plus `extra` header entries), written atomically: a temporary file beside it, fsync, rename."""
    metadata = {
        **(extra or {}),
        "format": MODEL_FILE_FORMAT,
        "model_config": json.dumps(config.to_dict(), sort_keys=True),
        "tokenizer_sha256": tokenizer_sha256,
    }
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        save_file(tensors, str(tmp), metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)


# ----- the verifier's majority models, by round -----


@dataclass(frozen=True)
class StageProvenance:
    """Where one stage of an assembled majority model comes from."""

    stage: int
    round: int
    """The stage's own round R_s: its weights are θ_{R_s}, the result of its round R_s − 1."""
    theta_hash: str
    """The settled majority hash of that result (node.diloco.tensor_sha256 of the flat θ)."""


def round_model_path(directory: Path, round_: int) -> Path:
    return directory / f"round-{round_:08d}.safetensors"


def round_tokenizer_path(directory: Path, sha256: str) -> Path:
    """Beside the round files, the tokenizer each names, by content (a run's tokenizer may grow)."""
    return directory / f"tokenizer-{sha256}.json"


def round_models(directory: Path) -> list[int]:
    """The rounds whose majority model `directory` holds, oldest first."""
    if not directory.is_dir():
        return []
    found = (_ROUND_FILE.match(p.name) for p in directory.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


def save_round_model(
    directory: Path,
    round_: int,
    config: ModelConfig,
    stages: Sequence[nn.Module],
    provenance: Sequence[StageProvenance],
    tokenizer: BPETokenizer,
    *,
    keep: int,
) -> Path:
    """Write the assembled majority model of `round_` (stage 0's round) and its tokenizer, and
    keep only the newest `keep` round files. Each stage's weights must hash to its provenance's
    majority hash."""
    if keep < 1:
        raise ValueError(f"keep must be ≥ 1 round file, got {keep}")
    if [p.stage for p in provenance] != list(range(len(stages))):
        raise ValueError(f"provenance names stages {[p.stage for p in provenance]} for {len(stages)} stages")
    for stage, origin in zip(stages, provenance, strict=True):
        got = _stage_hash(stage.state_dict(), config, origin.stage, len(stages))
        if got != origin.theta_hash:
            raise ValueError(f"stage {origin.stage} hashes to {got[:16]}…, not {origin.theta_hash[:16]}…")
    directory.mkdir(parents=True, exist_ok=True)
    if not round_tokenizer_path(directory, tokenizer.sha256).exists():
        tokenizer.save(round_tokenizer_path(directory, tokenizer.sha256))
    path = round_model_path(directory, round_)
    extra = {"round": str(round_), "stages": json.dumps([vars(p) for p in provenance])}
    save_model_file(path, config, assemble_stages(stages), tokenizer.sha256, extra=extra)
    # Rounds only grow within a run: a file past this round is an earlier run's (a database
    # started over beside the same directory), and must not outlive this run's newest.
    kept = [r for r in round_models(directory) if r <= round_]
    for old in [r for r in round_models(directory) if r > round_] + kept[:-keep]:
        round_model_path(directory, old).unlink(missing_ok=True)
    return path


def _stage_hash(state: Mapping[str, Tensor], config: ModelConfig, stage: int, num_stages: int) -> str:
    """The θ hash replicas of this stage vote with, from whole-model (or stage) tensors by name:
    the stage's parameters flattened in parameter order (node.diloco.flat_parameters)."""
    with torch.device("meta"):
        names = [n for n, _ in build_stage(config, stage, num_stages).named_parameters()]
    missing = [n for n in names if n not in state]
    if missing:
        raise ValueError(f"stage {stage} of {num_stages} lacks {missing[:4]} ({len(missing)} tensors)")
    return tensor_sha256(torch.cat([state[n].detach().to("cpu", torch.float32).flatten() for n in names]))


def latest_models_dir(home: Path) -> Path:
    """The run directory under HOME/models (one per run definition, verifier.evaluator) whose
    newest round file is the most recent: the run the verifier on this HOME measured last."""
    root = home / MODELS_DIR
    runs = [d for d in root.iterdir() if d.is_dir() and round_models(d)] if root.is_dir() else []
    if not runs:
        raise ValueError(
            f"no verifier round files under {root}: a verifier with this HOME keeps the majority "
            "model of its latest measured rounds there (or give --models DIR)"
        )
    return max(runs, key=lambda d: round_model_path(d, round_models(d)[-1]).stat().st_mtime)


def load_round_model(directory: Path, which: str) -> TrainedModel:
    """The majority model of round `which` (a number, or "latest") from the verifier's round
    files, every stage re-hashed against the majority hash the file names."""
    rounds = round_models(directory)
    if not rounds:
        raise ValueError(f"{directory} holds no round files (round-NNNNNNNN.safetensors)")
    round_ = rounds[-1] if which == "latest" else int(which)
    if round_ not in rounds:
        raise ValueError(f"round {round_} is not kept in {directory}; kept: {', '.join(map(str, rounds))}")
    path = round_model_path(directory, round_)
    model = _from_model_file(path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    try:
        provenance = [StageProvenance(**p) for p in json.loads(meta["stages"])]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: no valid stage provenance in the header ({exc})") from None
    for origin in provenance:
        got = _stage_hash(model.state_dict, model.config, origin.stage, len(provenance))
        if got != origin.theta_hash:
            raise ValueError(
                f"{path}: stage {origin.stage} hashes to {got[:16]}…, the file says the majority "
                f"{origin.theta_hash[:16]}…; the file is damaged"
            )
    return model


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


def is_round(source: str) -> bool:
    """Whether a --checkpoint value names a round of the verifier's ("12", "latest"), not a file."""
    return source == "latest" or source.isdigit()


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
        required=True,
        help="a node checkpoint (HOME/checkpoints/WALLET-stage0.pt), a whole-model .safetensors file, "
        "or a round number (or 'latest') of the verifier's majority models (see --models)",
    )
    p.add_argument(
        "--models",
        type=Path,
        help=f"the verifier's round files, for a round --checkpoint (default: the run under "
        f"HOME/{MODELS_DIR}/ measured last)",
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
    candidates = [*args.tokenizer, args.home / "data" / "default"]
    if is_round(args.checkpoint) and not Path(args.checkpoint).exists():
        models = args.models or latest_models_dir(args.home)
        model = load_round_model(models, args.checkpoint)
        if model.tokenizer_sha256 is not None:  # the verifier keeps it beside the round files
            candidates.append(round_tokenizer_path(models, model.tokenizer_sha256))
    else:
        model = load_trained_model(Path(args.checkpoint), model_size=args.model_size)
    tokenizer = find_tokenizer(model, candidates)
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
