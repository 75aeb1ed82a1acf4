"""BPETokenizer: id layout, round trips, engine == plain-Python BPE, extend, files, chunking."""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, pre_tokenizers

import neuroshard.tokenizer.bpe as bpe_module
from neuroshard.tokenizer import (
    BYTE_OFFSET,
    EOS_ID,
    FIRST_MERGE_ID,
    SPECIAL_TOKENS,
    SPLIT_PATTERN,
    BPETokenizer,
)
from neuroshard.tokenizer.bpe import byte_alphabet, chunk_text
from neuroshard.tokenizer.train import learn_merges

WORD_LIST = (
    "the of and to a in that it was her his you he be not as had with for she but is at my on have "
    "by which all this they were so no there would from one been could very what me an or any more "
    "Elizabeth Darcy letter sister morning walked gardens replied don't can't I'm we'll they've"
)
WORDS = tuple(WORD_LIST.split())
CODE = 'def encode(self, text: str) -> list[int]:\r\n    return [i + 10 for i in text.encode("utf-8")]\n'
EXOTIC = "Café naïve Ünïcödé — “quoted” 漢字かな 🙂🚀 ½ ٣٤٥ Ⅻ\u00a0nbsp\u2028line\x85nel\ttab\x0b\x0c"
TAB_WORDS = st.sampled_from(
    [*WORDS, " ", "  ", "\n", "\n\n", "\r\n", "\t", "123", "45678", "'s", "!!", "é", "🙂"]
)


def make_corpus(seed: int, n_sentences: int) -> str:
    """Prose-like sentences with numbers, code and non-Latin text: a few KB, fixed by `seed`."""
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(n_sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", ",", "!", "?", ";"]))
        if i % 7 == 0:
            lines.append(f"  {rng.randint(0, 10**6)} items at {rng.random():.3f} each\n")
        if i % 11 == 0:
            lines.append(CODE)
        if i % 13 == 0:
            lines.append(EXOTIC)
    return "\n".join(lines)


CORPUS = make_corpus(seed=1, n_sentences=120)
OTHER_CORPUS = make_corpus(seed=2, n_sentences=80) + "\n" + "supercalifragilistic zyzzyva quux " * 30


@pytest.fixture(scope="module")
def tok() -> BPETokenizer:
    return BPETokenizer.train([CORPUS], 600)


def reference_encode(tokenizer: BPETokenizer, text: str) -> list[int]:
    """Plain merge-rank BPE: in each pre-token, merge the lowest-ranked adjacent pair until none is left.

    Only the pre-tokenizer is shared with the engine (Python's `re` has no \\p{L});
    test_split_pattern_is_the_cl100k_split pins what it does.
    """
    rank = {pair: FIRST_MERGE_ID + i for i, pair in enumerate(tokenizer.merges)}  # rank order == id order
    split = pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False)
    out: list[int] = []
    for piece, _ in split.pre_tokenize_str(text):
        word = [BYTE_OFFSET + b for b in piece.encode("utf-8")]
        while len(word) > 1:
            best = min(pairwise(word), key=lambda p: rank.get(p, float("inf")))
            if best not in rank:
                break
            merged: list[int] = []
            i = 0
            while i < len(word):
                if tuple(word[i : i + 2]) == best:
                    merged.append(rank[best])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        out += word
    return out


# ----- id layout -----


def test_special_and_byte_ids() -> None:
    assert SPECIAL_TOKENS[:4] == ("<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>")
    assert SPECIAL_TOKENS[4:] == tuple(f"<|reserved_{i}|>" for i in range(4, 10))
    assert (BYTE_OFFSET, FIRST_MERGE_ID) == (10, 266)
    raw = BPETokenizer()
    assert raw.vocab_size == raw.next_merge_id == 266
    assert raw.encode("".join(chr(b) for b in range(128))) == [10 + b for b in range(128)]
    assert raw.encode("é€") == [10 + b for b in "é€".encode()]
    assert [raw.token_bytes(10 + b) for b in range(256)] == [bytes([b]) for b in range(256)]


def test_trained_ids_follow_the_layout(tok: BPETokenizer) -> None:
    assert tok.vocab_size == tok.next_merge_id == FIRST_MERGE_ID + len(tok.merges) == 600
    ids = tok.encode(CORPUS)
    assert min(ids) >= BYTE_OFFSET  # encode never emits special ids
    assert max(ids) >= FIRST_MERGE_ID
    # Merge i is id 266 + i and spells its two parts.
    for i, (left, right) in enumerate(tok.merges):
        assert tok.token_bytes(FIRST_MERGE_ID + i) == tok.token_bytes(left) + tok.token_bytes(right)
    assert (
        len({tok.token_bytes(i) for i in range(BYTE_OFFSET, tok.vocab_size)}) == tok.vocab_size - BYTE_OFFSET
    )


def test_train_rejects_a_vocab_below_the_byte_ids() -> None:
    with pytest.raises(ValueError, match="vocab_size=265 is below 266"):
        BPETokenizer.train([CORPUS], 265)


def test_train_stops_when_the_text_runs_out_of_pairs() -> None:
    assert BPETokenizer.train(["ab ab ab"], 1000).vocab_size == 266 + 2  # "ab", then " ab"


def test_byte_alphabet_is_the_engines() -> None:
    alphabet = byte_alphabet()
    assert sorted(alphabet) == sorted(pre_tokenizers.ByteLevel.alphabet())
    # Every byte that valid UTF-8 can hold, spelt by the engine's own ByteLevel step.
    text = "".join(chr(c) for c in [*range(0x800), 0xFFFD, 0x10000, 0x10FFFF, 0x3FFFF, 0xE000])
    spelt = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    assert "".join(piece for piece, _ in spelt) == "".join(alphabet[b] for b in text.encode())


def test_split_pattern_is_the_cl100k_split() -> None:
    split = pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False)
    pieces = [p for p, _ in split.pre_tokenize_str("Hello world's   12345 foo!!\n\n  bar\tBAZ'LL é漢字  ")]
    assert pieces == [
        "Hello", " world", "'s", "  ", " ", "123", "45", " foo", "!!\n\n", " ", " bar", "\tBAZ", "'LL",
        " é漢字", "  ",
    ]  # fmt: skip


# ----- round trips and decode -----


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_round_trip_any_text(tok: BPETokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(TAB_WORDS | st.text(max_size=3)).map("".join))
def test_round_trip_corpus_like_text(tok: BPETokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_decode_replaces_invalid_utf8() -> None:
    raw = BPETokenizer()
    euro = raw.encode("€uro")  # three byte ids for €
    assert raw.decode(euro[1:]) == "\ufffd\ufffduro"
    assert raw.decode(euro[:2]) == "\ufffd"
    assert raw.decode([10 + 0xFF]) == "\ufffd"


def test_decode_spells_or_skips_special_ids(tok: BPETokenizer) -> None:
    ids = [1, *tok.encode("hi"), EOS_ID, 0]
    assert tok.decode(ids) == "<|bos|>hi<|eos|><|pad|>"
    assert tok.decode(ids, skip_special=True) == "hi"
    assert EOS_ID not in tok.encode("<|eos|>")  # text cannot inject a special id


def test_decode_rejects_ids_outside_the_vocabulary(tok: BPETokenizer) -> None:
    with pytest.raises(ValueError, match="600"):
        tok.decode([20, 600])
    with pytest.raises(ValueError, match="-1"):
        tok.decode([-1])


# ----- engine == plain-Python BPE -----


@settings(max_examples=200, deadline=None)
@given(st.lists(TAB_WORDS | st.text(max_size=4)).map("".join))
def test_engine_matches_reference_bpe(tok: BPETokenizer, text: str) -> None:
    assert tok.encode(text) == reference_encode(tok, text)


def test_engine_matches_reference_on_the_corpus(tok: BPETokenizer) -> None:
    text = CORPUS + OTHER_CORPUS
    assert tok.encode(text) == reference_encode(tok, text)


def test_training_segmentation_is_the_engines() -> None:
    # Self-overlapping runs ("aaaa") and repeats are where merge orders can disagree.
    texts = ["aaaa aaa aaaaaaa abababa babab " * 3, "aaab aab xaab " * 2]
    tok = BPETokenizer.train(texts, 290)
    for text in [*texts, "aaaaaaaaaaa bababababab aaabaaab"]:
        assert tok.encode(text) == reference_encode(tok, text)


# ----- training details -----


def naive_train(text: str, num_merges: int) -> list[tuple[int, int]]:
    """BPE training that recounts every pair after every merge: slow, obviously right."""
    split = pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False)
    counts = Counter(piece for piece, _ in split.pre_tokenize_str(text))
    words = {tuple(BYTE_OFFSET + b for b in w.encode()): n for w, n in counts.items()}
    merges: list[tuple[int, int]] = []
    for new_id in range(FIRST_MERGE_ID, FIRST_MERGE_ID + num_merges):
        pairs: Counter[tuple[int, int]] = Counter()
        for word, n in words.items():
            for pair in pairwise(word):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))  # highest count, then smallest ids
        merges.append(best)
        merged: dict[tuple[int, ...], int] = {}
        for word, n in words.items():
            out: list[int] = []
            i = 0
            while i < len(word):
                if word[i : i + 2] == best:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        words = merged
    return merges


def test_incremental_training_equals_naive_recounting() -> None:
    text = CORPUS[:3000] + "aaaa aaa aaaaaaa abababa babab"
    assert list(BPETokenizer.train([text], 266 + 150).merges) == naive_train(text, 150)


def test_ties_go_to_the_smallest_pair_and_counts_win() -> None:
    single = {i: bytes([i - 10]) for i in range(10, 266)}
    tie = learn_merges([[12, 13], [10, 11]], [1, 1], dict(single), first_id=266, num_merges=2)
    assert tie.merges == [(10, 11), (12, 13)]
    counted = learn_merges([[12, 13], [10, 11]], [3, 2], dict(single), first_id=266, num_merges=1)
    assert counted.merges == [(12, 13)]


def test_merge_whose_bytes_exist_is_skipped() -> None:
    # Id 266 already spells b"ab"; word types still holding a, b must not make a second b"ab".
    token_bytes = {i: bytes([i - 10]) for i in range(10, 266)} | {266: b"ab"}
    a, b, c = 10 + ord("a"), 10 + ord("b"), 10 + ord("c")
    result = learn_merges([[a, b], [b, c]], [5, 1], token_bytes, first_id=267, num_merges=5)
    assert result.skipped == 1
    assert result.merges == [(b, c)]


def test_constructor_rejects_two_ids_with_one_spelling() -> None:
    a, b, c = 10 + ord("a"), 10 + ord("b"), 10 + ord("c")
    # 266 = ab, 267 = bc, 268 = (ab, c) = "abc", 269 = (a, bc) = "abc" again.
    with pytest.raises(ValueError, match="already id 268"):
        BPETokenizer([(a, b), (b, c), (266, c), (a, 267)])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text("abc", min_size=1, max_size=12), min_size=1, max_size=8), st.data())
def test_training_from_bytes_never_needs_the_spelling_guard(words: list[str], data: st.DataObject) -> None:
    weights = data.draw(st.lists(st.integers(1, 5), min_size=len(words), max_size=len(words)))
    token_bytes = {i: bytes([i - 10]) for i in range(10, 266)}
    ids = [[10 + b for b in word.encode()] for word in words]
    result = learn_merges(ids, weights, token_bytes, first_id=266, num_merges=40)
    assert result.skipped == 0
    BPETokenizer(result.merges)  # and the constructor accepts every spelling


def test_training_is_deterministic(tok: BPETokenizer) -> None:
    assert BPETokenizer.train([CORPUS], 600).sha256 == tok.sha256


def test_progress_reports_every_merge() -> None:
    seen: list[tuple[int, int]] = []
    BPETokenizer.train([CORPUS], 276, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i, 10) for i in range(1, 11)]


# ----- extend -----


def test_extend_keeps_every_old_id_and_merge(tok: BPETokenizer, tmp_path: Path) -> None:
    before = tok.sha256
    bigger = tok.extend([OTHER_CORPUS], 150)
    assert tok.sha256 == before  # extend returns a new tokenizer
    assert bigger.merges[: len(tok.merges)] == tok.merges
    assert 600 < bigger.next_merge_id <= 750
    assert all(bigger.token_bytes(i) == tok.token_bytes(i) for i in range(tok.vocab_size))
    # The old merges alone are exactly the old tokenizer: same file, same ids.
    assert BPETokenizer(bigger.merges[: len(tok.merges)]).sha256 == tok.sha256
    old_lines = tok.save(tmp_path / "old.json").read_text().splitlines()
    new_lines = bigger.save(tmp_path / "new.json").read_text().splitlines()
    old_merges = old_lines[old_lines.index('  "merges": [') + 1 : -2]
    new_merges = new_lines[new_lines.index('  "merges": [') + 1 : -2]
    assert [line.rstrip(",") for line in new_merges[: len(old_merges)]] == [
        line.rstrip(",") for line in old_merges
    ]
    text = OTHER_CORPUS + CORPUS
    assert bigger.encode(text) == reference_encode(bigger, text)
    assert len(bigger.encode(OTHER_CORPUS)) < len(tok.encode(OTHER_CORPUS))


def test_extend_continues_training_where_it_stopped(tok: BPETokenizer) -> None:
    assert BPETokenizer.train([CORPUS], 500).extend([CORPUS], 100).sha256 == tok.sha256


def test_extend_by_zero_is_the_same_tokenizer(tok: BPETokenizer) -> None:
    assert tok.extend([OTHER_CORPUS], 0).sha256 == tok.sha256
    with pytest.raises(ValueError, match="num_new_merges=-1"):
        tok.extend([OTHER_CORPUS], -1)


# ----- files -----


def test_save_load_round_trip_and_stable_sha256(tok: BPETokenizer, tmp_path: Path) -> None:
    path = tok.save(tmp_path / "tokenizer.json")
    data = path.read_bytes()
    assert data == tok.to_bytes()
    assert hashlib.sha256(data).hexdigest() == tok.sha256
    loaded = BPETokenizer.load(path)
    assert loaded.merges == tok.merges and loaded.sha256 == tok.sha256
    assert loaded.encode(CORPUS) == tok.encode(CORPUS)
    assert loaded.save(tmp_path / "again.json").read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "again.json",
        "tokenizer.json",
    ]  # no temp files left


def test_file_format(tok: BPETokenizer) -> None:
    doc = json.loads(tok.to_bytes())
    assert list(doc) == [
        "format",
        "version",
        "pattern",
        "special_tokens",
        "byte_offset",
        "next_merge_id",
        "merges",
    ]
    assert doc["format"] == "neuroshard-bpe" and doc["version"] == 1
    assert doc["pattern"] == SPLIT_PATTERN
    assert doc["special_tokens"] == list(SPECIAL_TOKENS) and doc["byte_offset"] == 10
    assert doc["next_merge_id"] == 600
    assert [tuple(m) for m in doc["merges"]] == list(tok.merges)
    assert BPETokenizer().to_bytes().decode().endswith('"merges": [\n  ]\n}\n')


def _doc_with(tok: BPETokenizer, **changes: object) -> bytes:
    doc = json.loads(tok.to_bytes()) | changes
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"version": 2}, "version is 2"),
        ({"next_merge_id": 5}, "next_merge_id is 5 but 2 merges imply 268"),
        ({"merges": [[107, 108], [268, 10]], "next_merge_id": 268}, r"merge 1 = \(268, 10\)"),
        ({"merges": [[107, 108], "x"]}, "merges must be a list"),
        ({"merges": [[107, 108], [107, 108]]}, "already id 266"),
        ({"pattern": "(unclosed"}, "bad.json"),
    ],
)
def test_load_rejects_bad_files(tmp_path: Path, changes: dict[str, object], message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(_doc_with(BPETokenizer([(107, 108), (10, 11)]), **changes))
    with pytest.raises(ValueError, match=message):
        BPETokenizer.load(path)


def test_load_rejects_non_json(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(b"\xff not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not JSON"):
        BPETokenizer.load(path)


# ----- chunked encoding and batches -----

REAL_TEXT = "\n".join(
    [
        Path(bpe_module.__file__).read_text(encoding="utf-8"),
        CORPUS,
        EXOTIC + "\n1st\n2nd\r\nA\n\n\nZ\n \nB.\n\n  \n\ty\n 2\n's\n!\n",
        OTHER_CORPUS,
    ]
)


@pytest.mark.parametrize("chunk_chars", [1, 7, 100, 4096])
def test_chunked_encode_equals_whole_encode(tok: BPETokenizer, chunk_chars: int) -> None:
    chunks = chunk_text(REAL_TEXT, chunk_chars)
    assert "".join(chunks) == REAL_TEXT
    assert len(chunks) > (1 if chunk_chars == 4096 else 50)
    whole = tok.engine.encode(REAL_TEXT, add_special_tokens=False).ids
    assert [i for chunk in chunks for i in tok.engine.encode(chunk, add_special_tokens=False).ids] == whole


@settings(max_examples=500, deadline=None)
@given(
    # A dense alphabet finds short traps such as "\n \n"; the wide one covers other whitespace.
    st.text(st.sampled_from("\n \ta7'!"), max_size=40)
    | st.text(st.sampled_from("\n\r \t\x0b\x0c\x85\u2028\u00a0aZé7٣'s!-_漢🙂"), max_size=60),
    st.integers(1, 8),
)
def test_chunk_cuts_are_pre_token_boundaries(text: str, chunk_chars: int) -> None:
    split = pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False)
    whole = [p for p, _ in split.pre_tokenize_str(text)]
    chunked = [p for chunk in chunk_text(text, chunk_chars) for p, _ in split.pre_tokenize_str(chunk)]
    assert chunked == whole


def test_long_text_is_split_and_still_matches(tok: BPETokenizer) -> None:
    text = REAL_TEXT * (2 * bpe_module.CHUNK_CHARS // len(REAL_TEXT) + 1)
    assert len(chunk_text(text)) > 1
    assert tok.encode(text) == tok.engine.encode(text, add_special_tokens=False).ids


def test_encode_batch_equals_encode(tok: BPETokenizer) -> None:
    long_text = REAL_TEXT * (bpe_module.CHUNK_CHARS // len(REAL_TEXT) + 2)
    texts = ["", CORPUS, "x", long_text, EXOTIC]
    assert tok.encode_batch(texts) == [tok.engine.encode(t, add_special_tokens=False).ids for t in texts]
    assert tok.encode("") == []
    assert tok.encode_batch([]) == []
