"""Byte-level BPE with NeuroShard's id layout, encoded by the HF `tokenizers` engine.

Ids: 0-9 special tokens, 10-265 the raw bytes (byte b is id 10 + b), 266+ learned
merges in the order learned. `tokenizer.json` stores only the merges, as pairs of ids,
so publishing more merges appends to the list and never moves an existing id.

Encoding runs in the compiled engine (`tokenizers.models.BPE`, merge-rank BPE), fed
with our merges: byte b is spelt as the engine's ByteLevel character for b (GPT-2's
printable byte alphabet), and each merge's string is the concatenation of its parts.

tokenizer.json (canonical: the same merges always give the same bytes, so its sha256
pins the tokenizer), keys in this order, one merge per line:
    format "neuroshard-bpe", version 1, pattern (the pre-tokenizer regex),
    special_tokens (names of ids 0-9), byte_offset 10,
    next_merge_id (266 + number of merges), merges [[left_id, right_id], ...]
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from .train import LearnResult, Pair, Progress, learn_merges

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|unk|>",
    *(f"<|reserved_{i}|>" for i in range(4, 10)),
)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
BYTE_OFFSET = len(SPECIAL_TOKENS)
"""Id of byte 0x00; byte b has id BYTE_OFFSET + b."""
FIRST_MERGE_ID = BYTE_OFFSET + 256

# The cl100k (GPT-4) split: contractions, letters with an optional one-character
# non-letter prefix, 1-3 digits, punctuation runs, newline runs, other whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
FORMAT_NAME = "neuroshard-bpe"
FORMAT_VERSION = 1

# Where SPLIT_PATTERN always cuts: after a '\n' that is followed by an ASCII letter or
# digit. The match holding that '\n' can only be `\s*[\r\n]+` or the punctuation
# alternative ending in `[\r\n]*`, both of which stop at the letter or digit, and no
# alternative (none has a look-behind) looks back across it, so the pieces of
# text[:k] + text[k:] are the pieces of text. test_bpe.py checks this on real text.
_SAFE_CUT = re.compile(r"\n(?=[A-Za-z0-9])")
CHUNK_CHARS = 1 << 14
"""Characters per engine call when cutting long texts for the engine's threads.

Measured on austen.txt (4 MB, vocab 8192, one thread): CPU time is flat, within the 10%
noise, for pieces of 1 Ki to 64 Ki characters, and one 4 MB call costs ~40% more (the
engine's per-call buffers grow large). 16 Ki gives ~250 pieces per 4 MB to balance threads."""
_COUNT_CHUNK_CHARS = 1 << 20
"""Characters pre-tokenized per call while counting words for training."""


def byte_alphabet() -> list[str]:
    """The engine's ByteLevel character for each byte value (index = byte).

    Printable Latin-1 bytes stand for themselves; the other 68 are moved, in byte
    order, to code points 256 and up, so every token is a printable string.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    kept = set(printable)
    chars: list[str] = []
    moved = 0
    for b in range(256):
        if b in kept:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + moved))
            moved += 1
    return chars


def chunk_text(text: str, chunk_chars: int = CHUNK_CHARS) -> list[str]:
    """Cut `text` into pieces of about `chunk_chars` at points where SPLIT_PATTERN always cuts.

    Encoding the pieces one by one gives the same ids as encoding `text` whole. A text
    with no such point after `chunk_chars` stays in one piece.
    """
    pieces: list[str] = []
    start = 0
    while len(text) - start > chunk_chars:
        cut = _SAFE_CUT.search(text, start + chunk_chars)
        if cut is None:
            break
        pieces.append(text[start : cut.end()])
        start = cut.end()
    pieces.append(text[start:])
    return pieces


class BPETokenizer:
    """An immutable byte-level BPE tokenizer: `train` and `extend` return new tokenizers.

    decode() spells special ids as their names ("<|eos|>"), or drops them with
    skip_special=True; encode() never produces them (text that spells "<|eos|>" is
    encoded as ordinary bytes, so user text cannot inject a special token).
    """

    def __init__(self, merges: Sequence[Pair] = (), *, pattern: str = SPLIT_PATTERN) -> None:
        self._merges: tuple[Pair, ...] = tuple((int(a), int(b)) for a, b in merges)
        self._pattern = pattern
        self._token_bytes = _token_bytes(self._merges)
        self._engine = _build_engine(self._token_bytes, self._merges, pattern)
        names = [name.encode() for name in SPECIAL_TOKENS]
        self._decode_table = names + self._token_bytes[BYTE_OFFSET:]
        self._decode_table_skip = [b""] * BYTE_OFFSET + self._token_bytes[BYTE_OFFSET:]
        self._file_bytes = _serialize(self._merges, pattern)
        self._sha256 = hashlib.sha256(self._file_bytes).hexdigest()

    # ----- training -----

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int, *, progress: Progress | None = None
    ) -> BPETokenizer:
        """Learn merges from scratch until the vocabulary holds `vocab_size` ids.

        Stops early (smaller vocab_size) if the texts run out of pairs to merge.
        """
        if vocab_size < FIRST_MERGE_ID:
            raise ValueError(
                f"vocab_size={vocab_size} is below {FIRST_MERGE_ID} (10 special ids + 256 bytes)"
            )
        return cls().extend(texts, vocab_size - FIRST_MERGE_ID, progress=progress)

    def extend(
        self, texts: Iterable[str], num_new_merges: int, *, progress: Progress | None = None
    ) -> BPETokenizer:
        """Return a new tokenizer with up to `num_new_merges` more merges learned from `texts`.

        Every existing merge and id is kept; the new merges get ids from next_merge_id on.
        Each word is first encoded with the existing merges, then merging continues.
        """
        result = self._learn(texts, num_new_merges, progress)
        return BPETokenizer([*self._merges, *result.merges], pattern=self._pattern)

    def _learn(self, texts: Iterable[str], num_new_merges: int, progress: Progress | None) -> LearnResult:
        if num_new_merges < 0:
            raise ValueError(f"num_new_merges={num_new_merges} must be >= 0")
        word_counts = _count_words(self._pattern, texts)
        alphabet = byte_alphabet()
        model = self._engine.model
        words = [
            [token.id for token in model.tokenize("".join(alphabet[b] for b in word.encode()))]
            for word in word_counts
        ]
        known = {i: b for i, b in enumerate(self._token_bytes) if i >= BYTE_OFFSET}
        return learn_merges(
            words,
            list(word_counts.values()),
            known,
            first_id=self.next_merge_id,
            num_merges=num_new_merges,
            progress=progress,
        )

    # ----- encoding -----

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS/EOS added). Long texts use all of the engine's threads."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel by the engine's thread pool.

        Long texts are cut with `chunk_text` first, so one big document also spreads
        over the threads; the ids equal those of encoding each text whole.
        """
        if self._pattern != SPLIT_PATTERN:
            # chunk_text's cut points are only proven for SPLIT_PATTERN.
            return [enc.ids for enc in self._engine.encode_batch_fast(list(texts), add_special_tokens=False)]
        pieces_per_text = [chunk_text(text) for text in texts]
        flat = list(itertools.chain.from_iterable(pieces_per_text))
        encodings = iter(self._engine.encode_batch_fast(flat, add_special_tokens=False))
        out: list[list[int]] = []
        for pieces in pieces_per_text:
            if len(pieces) == 1:
                out.append(next(encodings).ids)
            else:
                ids: list[int] = []
                for _ in pieces:
                    ids += next(encodings).ids
                out.append(ids)
        return out

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD.

        Special ids decode to their names ("<|eos|>"), or to nothing with skip_special=True.
        """
        table = self._decode_table_skip if skip_special else self._decode_table
        ids = [int(i) for i in ids] if not isinstance(ids, list) else ids
        if ids and (min(ids) < 0 or max(ids) >= len(table)):
            bad = next(i for i in ids if not 0 <= i < len(table))
            raise ValueError(f"token id {bad} is outside this tokenizer's range 0..{len(table) - 1}")
        return b"".join([table[i] for i in ids]).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a non-special id stands for (b"" for special ids)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(
                f"token id {token_id} is outside this tokenizer's range 0..{self.vocab_size - 1}"
            )
        return self._token_bytes[token_id]

    # ----- properties -----

    @property
    def merges(self) -> tuple[Pair, ...]:
        """Learned merges in order; merge i produced id FIRST_MERGE_ID + i."""
        return self._merges

    @property
    def pattern(self) -> str:
        return self._pattern

    @property
    def next_merge_id(self) -> int:
        """The id the next learned merge will get."""
        return FIRST_MERGE_ID + len(self._merges)

    @property
    def vocab_size(self) -> int:
        """Number of ids (specials + bytes + merges); equals next_merge_id."""
        return self.next_merge_id

    @property
    def sha256(self) -> str:
        """Hex sha256 of the bytes `save` writes (== sha256 of any file `save` wrote)."""
        return self._sha256

    @property
    def engine(self) -> Tokenizer:
        """The HF tokenizer that encodes (vocabulary without the special ids). Do not mutate."""
        return self._engine

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, sha256={self._sha256[:12]}…)"

    # ----- files -----

    def to_bytes(self) -> bytes:
        """The canonical tokenizer.json contents: same merges and pattern, same bytes."""
        return self._file_bytes

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write tokenizer.json atomically (temp file, fsync, rename) and return its path."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self._file_bytes)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BPETokenizer:
        """Read a tokenizer.json written by `save`; raise ValueError naming the file if it is invalid."""
        path = Path(path)
        return cls.from_bytes(path.read_bytes(), source=str(path))

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = "<bytes>") -> BPETokenizer:
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            # ValueError: bad JSON, or an integer longer than Python converts (4,300 digits).
            raise ValueError(f"{source}: not JSON ({str(exc)[:200]})") from None
        merges, pattern = _parse(doc, source)
        try:
            return cls(merges, pattern=pattern)
        except Exception as exc:  # a bad merge (ValueError) or a pattern the engine rejects
            raise ValueError(f"{source}: {exc}") from exc


def _token_bytes(merges: Sequence[Pair]) -> list[bytes]:
    """Bytes of every id; specials get b"". Checks that each merge is well formed."""
    table = [b""] * BYTE_OFFSET + [bytes([b]) for b in range(256)]
    seen: dict[bytes, int] = {table[i]: i for i in range(BYTE_OFFSET, FIRST_MERGE_ID)}
    for i, (left, right) in enumerate(merges):
        new_id = FIRST_MERGE_ID + i
        if not (BYTE_OFFSET <= left < new_id and BYTE_OFFSET <= right < new_id):
            raise ValueError(
                f"merge {i} = ({left}, {right}) must join two ids in {BYTE_OFFSET}..{new_id - 1}"
            )
        merged = table[left] + table[right]
        if merged in seen:
            # The engine's vocabulary is keyed by string: two ids cannot share one.
            raise ValueError(f"merge {i} = ({left}, {right}) spells {merged!r}, already id {seen[merged]}")
        seen[merged] = new_id
        table.append(merged)
    return table


def _build_engine(token_bytes: list[bytes], merges: Sequence[Pair], pattern: str) -> Tokenizer:
    alphabet = byte_alphabet()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {spell(token_bytes[i]): i for i in range(BYTE_OFFSET, len(token_bytes))}
    merge_strings = [(spell(token_bytes[a]), spell(token_bytes[b])) for a, b in merges]
    model = models.BPE(vocab=vocab, merges=merge_strings)
    engine = Tokenizer(model)
    engine.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    engine.decoder = decoders.ByteLevel()
    return engine


def _count_words(pattern: str, texts: Iterable[str]) -> Counter[str]:
    """Count the pre-tokens of `texts` (as text, before the byte mapping)."""
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    counts: Counter[str] = Counter()
    for text in texts:
        # Cutting big texts bounds the memory of pre_tokenize_str's list of (piece, offsets).
        chunks = chunk_text(text, _COUNT_CHUNK_CHARS) if pattern == SPLIT_PATTERN else [text]
        for chunk in chunks:
            counts.update(piece for piece, _ in split.pre_tokenize_str(chunk))
    return counts


def _serialize(merges: Sequence[Pair], pattern: str) -> bytes:
    """tokenizer.json, one merge per line so appended merges read as appended lines in a diff."""
    header = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "pattern": pattern,
        "special_tokens": list(SPECIAL_TOKENS),
        "byte_offset": BYTE_OFFSET,
        "next_merge_id": FIRST_MERGE_ID + len(merges),
    }
    lines = [f"  {json.dumps(key)}: {json.dumps(value)}," for key, value in header.items()]
    merge_lines = ",\n".join(f"    [{a}, {b}]" for a, b in merges)
    body = "\n".join(["{", *lines, '  "merges": [', *([merge_lines] if merges else []), "  ]", "}", ""])
    return body.encode("ascii")


def _parse(doc: object, source: str) -> tuple[list[Pair], str]:
    """Validate a parsed tokenizer.json and return (merges, pattern)."""
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(doc).__name__}")
    expected = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "special_tokens": list(SPECIAL_TOKENS),
        "byte_offset": BYTE_OFFSET,
    }
    for key, want in expected.items():
        if doc.get(key) != want:
            raise ValueError(f"{source}: {key} is {doc.get(key)!r}, this reader supports {want!r}")
    pattern, merges, next_id = doc.get("pattern"), doc.get("merges"), doc.get("next_merge_id")
    if not isinstance(pattern, str):
        raise ValueError(f"{source}: pattern must be a string, got {pattern!r}")
    if not isinstance(merges, list) or not all(_is_pair(m) for m in merges):
        raise ValueError(f"{source}: merges must be a list of [left_id, right_id] integer pairs")
    if next_id != FIRST_MERGE_ID + len(merges):
        raise ValueError(
            f"{source}: next_merge_id is {next_id!r} but {len(merges)} merges "
            f"imply {FIRST_MERGE_ID + len(merges)}"
        )
    return [(a, b) for a, b in merges], pattern


def _is_pair(item: object) -> bool:
    return (
        isinstance(item, list)
        and len(item) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in item)
    )


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable; not every platform lets a directory be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
