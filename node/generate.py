"""Sample text from a trained model, streamed as it comes (`neuroshard-generate`, cli.generate).

Temperature, top-k and nucleus (top-p, Holtzman et al. 2019, arXiv:1904.09751) sampling over our
own Transformer; no KV cache (each new token re-runs the context, cropped to max_seq_len), which
is fine for the short samples a contributor or the dashboard asks for. Decoding is incremental
over bytes, so a character split across tokens is printed once it is whole.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from neuroshard.tokenizer import BPETokenizer
from neuroshard.tokenizer.bpe import BYTE_OFFSET, EOS_ID


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    max_new_tokens: int = 200
    """Tokens to generate at most (fewer when the model emits end-of-sequence)."""
    temperature: float = 0.8
    """Divides the logits; 0 picks the most likely token every time (greedy)."""
    top_k: int | None = 50
    """Sample among the k most likely tokens only; None: all."""
    top_p: float | None = 0.95
    """Sample among the most likely tokens whose probabilities add up to p; None: all."""
    seed: int | None = None
    """Seed of the sampling generator; None draws a fresh one."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0 or self.temperature < 0:
            raise ValueError(f"max_new_tokens and temperature must be >= 0, got {self}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")


def next_token(logits: Tensor, cfg: SamplingConfig, generator: torch.Generator) -> int:
    """One token id from the last position's logits (V,)."""
    logits = logits.float()
    if cfg.temperature == 0:
        return int(logits.argmax())
    logits = logits / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < logits.numel():
        kth = torch.topk(logits, cfg.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the ones before it already reach p (the first token always stays).
        drop = cumulative - sorted_logits.softmax(-1) >= cfg.top_p
        logits = logits.index_put((order[drop],), torch.tensor(float("-inf")))
    probs = logits.softmax(-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: Sequence[int],
    cfg: SamplingConfig,
    *,
    max_seq_len: int,
    stop_ids: Sequence[int] = (EOS_ID,),
) -> Iterator[int]:
    """New token ids after `prompt`, one at a time, until max_new_tokens or a stop id (not yielded)."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    was_training = model.training
    model.eval()
    generator = torch.Generator()
    generator.manual_seed(cfg.seed if cfg.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    where = next(model.parameters()).device
    ids = list(prompt)
    try:
        for _ in range(cfg.max_new_tokens):
            context = torch.tensor([ids[-max_seq_len:]], device=where)  # (1, T)
            token = next_token(model(context)[0, -1], cfg, generator)
            if token in stop_ids:
                return
            ids.append(token)
            yield token
    finally:
        model.train(was_training)


class TextStream:
    """Token ids → text pieces, decoded incrementally over bytes (special ids become nothing)."""

    def __init__(self, tokenizer: BPETokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        raw = self._tokenizer.token_bytes(token) if token >= BYTE_OFFSET else b""
        return self._decoder.decode(raw)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def sample_text(
    model: nn.Module,
    tokenizer: BPETokenizer,
    prompt: str,
    cfg: SamplingConfig,
    *,
    max_seq_len: int,
    on_text: Callable[[str], None] | None = None,
) -> str:
    """The continuation of `prompt` as text; `on_text` gets each piece as soon as it is whole."""
    stream = TextStream(tokenizer)
    pieces = []
    for token in generate(model, tokenizer.encode(prompt), cfg, max_seq_len=max_seq_len):
        piece = stream.push(token)
        if piece:
            pieces.append(piece)
            if on_text is not None:
                on_text(piece)
    tail = stream.flush()
    if tail:
        pieces.append(tail)
        if on_text is not None:
            on_text(tail)
    return "".join(pieces)
