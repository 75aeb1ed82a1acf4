"""A trained model as a Hugging Face Llama folder that standard tools load (`neuroshard-export`, cli.export).

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
whole-model file (node.model_file), or a round of the verifier's: `--checkpoint 12` (or
`latest`) is the majority model the verifier measured at round 12, its stages assembled, read
from the verifier's round files (`--models DIR`; default: the run under HOME/models measured
last) or downloaded from its API (`--verifier URL`); either way each stage's weights are
re-hashed against the majority hash the round names before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from neuroshard.data.publish import TOKENIZER_NAME
from neuroshard.tokenizer import BPETokenizer
from neuroshard.tokenizer.bpe import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID

from .checkpoint import read_checkpoint
from .model import MODEL_SIZES, ModelConfig, Transformer
from .model_file import (
    RoundHeader,
    TrainedModel,
    latest_models_dir,
    load_model_file,
    load_round_model,
    read_round_header,
    round_model_path,
    round_tokenizer_path,
)
from .network_definition import NETWORK_SIGNATURE_HEADER, OPERATOR_HEADER, verify_network

MAX_TOKENIZER_BYTES = 64 << 20
"""A tokenizer.json of a million merges is ~30 MB; a verifier's answer past this is refused."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
        return load_model_file(path)
    payload = read_checkpoint(path)  # CheckpointMismatch is a ValueError
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


# ----- a round from a verifier's API -----


def _fetch(url: str, max_bytes: int, timeout_s: float, into: Path | None = None) -> bytes:
    """GET `url`: the body (or, with `into`, streamed to that file), refused past max_bytes."""
    request = urllib.request.Request(url, headers={"Accept": "application/json, application/octet-stream"})
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        if into is None:
            body = reply.read(max_bytes + 1)
            if len(body) > max_bytes:
                raise ValueError(f"{url}: more than {max_bytes} bytes")
            return body
        with open(into, "wb") as f:
            copied = 0
            while block := reply.read(1 << 20):
                copied += len(block)
                if copied > max_bytes:
                    raise ValueError(f"{url}: more than the {max_bytes} bytes the verifier listed")
                f.write(block)
        return b""


def download_round(verifier: str, which: str, dest: Path, *, timeout_s: float = 600.0) -> int:
    """Fetch round `which` ("latest" or a number) of the verifier's majority models into `dest`
    as a round file plus its tokenizer, and check every stage's majority hash in its header
    against the verifier's settled rounds (GET /api/training/history) where they are still
    listed there. Returns the round. The weights themselves are re-hashed by load_round_model."""
    base = verifier.rstrip("/")
    if urllib.parse.urlsplit(base).scheme not in ("http", "https"):
        raise ValueError(f"--verifier must be an http:// or https:// URL, got {verifier!r}")
    listing = json.loads(_fetch(base + "/api/training/models", 1 << 20, timeout_s))
    kept = {int(entry["round"]): int(entry["bytes"]) for entry in listing["models"]}
    if not kept:
        raise ValueError(f"{base} keeps no measured majority model yet")
    round_ = max(kept) if which == "latest" else int(which)
    if round_ not in kept:
        raise ValueError(f"round {round_} is not kept by {base}; kept: {', '.join(map(str, sorted(kept)))}")
    path = round_model_path(dest, round_)
    if not 0 < kept[round_] <= MAX_ROUND_FILE_BYTES:
        raise ValueError(
            f"{base} lists round {round_} at {kept[round_]} bytes; a round file is 1 B to "
            f"{MAX_ROUND_FILE_BYTES >> 30} GiB (an 8B-parameter model in fp32)"
        )
    _fetch(f"{base}/api/training/models/{round_}", kept[round_], timeout_s, into=path)
    header = read_round_header(path)
    if header.round != round_:
        raise ValueError(f"{base} answered round {round_} with round {header.round}'s file")
    if header.tokenizer_sha256 is not None:
        raw = _fetch(f"{base}/api/training/models/{round_}/tokenizer.json", MAX_TOKENIZER_BYTES, timeout_s)
        tokenizer = BPETokenizer.from_bytes(raw, source=f"{base}'s tokenizer")
        if tokenizer.sha256 != header.tokenizer_sha256:
            raise ValueError(
                f"{base} sent tokenizer {tokenizer.sha256[:12]}…, the model's is {header.tokenizer_sha256[:12]}…"
            )
        tokenizer.save(round_tokenizer_path(dest, tokenizer.sha256))
    _check_settled(base, header, timeout_s)
    _check_architecture(base, path, len(header.provenance), timeout_s)
    return round_


MAX_ROUND_FILE_BYTES = 40 << 30
"""The largest round file `--verifier` downloads: an 8B-parameter model in fp32, with room."""


def _check_settled(base: str, header: RoundHeader, timeout_s: float) -> None:
    """Each stage's θ_{R_s} must be listed as the settled majority result of its round R_s − 1
    among the verifier's newest 1,000 stage-rounds; a stage-round not listed there is refused
    (fail closed). This ties the file to the verifier's own ledger: a consistency check against
    the same server, not an authentication of it (use https to a verifier you trust)."""
    history = json.loads(_fetch(f"{base}/api/training/history?limit=1000", 16 << 20, timeout_s))
    majority = {(r["stage"], r["round"]): r["majority_hash"] for r in history["rounds"] if r["settled"]}
    for p in header.provenance:
        settled = majority.get((p.stage, p.round - 1))
        if settled is None:
            raise ValueError(
                f"{base} does not list round {p.round - 1} of stage {p.stage} as settled among its "
                f"newest 1,000 stage-rounds, so round {header.round}'s model cannot be checked "
                "against its majority; export a newer round"
            )
        if settled != p.theta_hash:
            raise ValueError(
                f"stage {p.stage} of round {header.round}'s model is θ {p.theta_hash[:16]}…, but "
                f"{base} settled round {p.round - 1} of stage {p.stage} on {settled[:16]}…"
            )


def _check_architecture(base: str, path: Path, num_stages: int, timeout_s: float) -> None:
    """The file's model config must be the run's (GET /api/network, checked against the
    signature it is served with): the θ hashes cover the weights, not the shapes' meaning
    (heads, rotary base, norm epsilon), which the file's header states. The vocabulary may have
    grown since the definition was written, so it is not compared."""
    request = urllib.request.Request(base + "/api/network")
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        body = reply.read((1 << 20) + 1)
        key_hex = reply.headers.get(OPERATOR_HEADER, "")
        signature = reply.headers.get(NETWORK_SIGNATURE_HEADER, "")
    if len(body) > 1 << 20:
        raise ValueError(f"{base}/api/network: more than 1 MiB")
    try:
        network = verify_network(body, signature, bytes.fromhex(key_hex))
    except ValueError as exc:
        raise ValueError(f"{base}/api/network: {exc}") from None
    with safe_open(str(path), framework="pt") as f:
        config = ModelConfig.from_dict(json.loads((f.metadata() or {})["model_config"]))
    ours = dataclasses.replace(config, vocab_size=network.model.vocab_size)
    if ours != network.model or num_stages != network.num_stages:
        raise ValueError(
            f"{path.name}: the file's model ({config.to_dict()}, {num_stages} stages) is not the run's "
            f"({network.model.to_dict()}, {network.num_stages} stages)"
        )


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """Where a trained model comes from (`neuroshard-export` and `neuroshard-generate` flags)."""

    checkpoint: str
    """A node checkpoint, a whole-model .safetensors file, or a round number (or 'latest') of the
    verifier's majority models."""
    models: Path | None = None
    """The verifier's round files, for a round `checkpoint` (None: the run under HOME/models measured last)."""
    verifier: str | None = None
    """Download a round `checkpoint` from this verifier's API instead (http://HOST:PORT)."""
    tokenizers: tuple[Path, ...] = ()
    """tokenizer.json files or data set directories holding one, tried before HOME/data/default."""
    home: Path = Path.home() / ".neuroshard"
    model_size: str | None = None
    """The preset (None: found by fingerprint)."""


def open_source(source: ModelSource) -> tuple[TrainedModel, BPETokenizer | None]:
    """The model `source` names, and its tokenizer if one is found."""
    candidates = [*source.tokenizers, source.home / "data" / "default"]
    if not (is_round(source.checkpoint) and not Path(source.checkpoint).exists()):
        if source.verifier:
            raise ValueError(
                f"--verifier needs a round --checkpoint (a number or 'latest'), got {source.checkpoint!r}"
            )
        model = load_trained_model(Path(source.checkpoint), model_size=source.model_size)
        return model, find_tokenizer(model, candidates)
    if source.verifier:
        download = Path(tempfile.mkdtemp(prefix="neuroshard-round-"))
        try:
            round_ = download_round(source.verifier, source.checkpoint, download)
            return _open_round(download, str(round_), candidates)
        finally:
            shutil.rmtree(download, ignore_errors=True)
    return _open_round(source.models or latest_models_dir(source.home), source.checkpoint, candidates)


def _open_round(models: Path, which: str, candidates: list[Path]) -> tuple[TrainedModel, BPETokenizer | None]:
    model = load_round_model(models, which)
    if model.tokenizer_sha256 is not None:  # the verifier keeps it beside the round files
        candidates = [*candidates, round_tokenizer_path(models, model.tokenizer_sha256)]
    return model, find_tokenizer(model, candidates)
