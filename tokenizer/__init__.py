"""Byte-level BPE for NeuroShard: ids 0-9 special, 10-265 bytes, 266+ merges (append-only)."""

from .bpe import (
    BOS_ID,
    BYTE_OFFSET,
    EOS_ID,
    FIRST_MERGE_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    SPLIT_PATTERN,
    UNK_ID,
    BPETokenizer,
)

__all__ = [
    "BOS_ID",
    "BYTE_OFFSET",
    "EOS_ID",
    "FIRST_MERGE_ID",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "SPLIT_PATTERN",
    "UNK_ID",
    "BPETokenizer",
]
