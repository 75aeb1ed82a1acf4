"""BPE merge learning over word types, with incremental pair counts.

Byte-pair encoding as in Sennrich et al. 2016 ("Neural Machine Translation of Rare
Words with Subword Units"): repeatedly replace the most frequent adjacent pair of
tokens by a new token. The text is cut into pre-tokens first (see `bpe.SPLIT_PATTERN`),
so a merge never crosses a word boundary, and every distinct pre-token ("word type")
is stored once with its count.

Each merge only touches the word types that hold the merged pair (found through
`_PairIndex.where`), and the best pair is kept in a heap whose stale entries are
skipped when popped, so nothing is recounted from scratch after a merge.

This module knows nothing of the HF engine or the file format: it takes words as
lists of token ids and returns the merges it learned.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

Pair = tuple[int, int]
Progress = Callable[[int, int], None]
"""Called as progress(merges_learned, merges_requested) after every merge."""


@dataclass(kw_only=True)
class LearnResult:
    """What `learn_merges` produced."""

    merges: list[Pair]
    """New merges in the order learned; merge i gets id `first_id + i`."""
    skipped: int
    """Pairs passed over because their byte string was already a token (see `learn_merges`)."""


@dataclass
class _PairIndex:
    """Weighted counts of adjacent pairs over all word types, and which word types hold each pair."""

    counts: dict[Pair, int] = field(default_factory=dict)
    where: dict[Pair, set[int]] = field(default_factory=dict)

    def add_word(self, index: int, word: Sequence[int], weight: int) -> None:
        for pair in pairwise(word):
            self.counts[pair] = self.counts.get(pair, 0) + weight
            self.where.setdefault(pair, set()).add(index)

    def replace_word(self, index: int, old: Sequence[int], new: Sequence[int], weight: int) -> set[Pair]:
        """Swap one word type's pairs from `old` to `new`; return the pairs whose count changed."""
        before = Counter(pairwise(old))
        after = Counter(pairwise(new))
        changed: set[Pair] = set()
        for pair in before.keys() | after.keys():
            delta = (after[pair] - before[pair]) * weight
            if delta == 0:
                continue
            changed.add(pair)
            count = self.counts.get(pair, 0) + delta
            if count > 0:
                self.counts[pair] = count
            else:
                self.counts.pop(pair, None)
            if after[pair] == 0:
                self._forget(pair, index)
            else:
                self.where.setdefault(pair, set()).add(index)
        return changed

    def _forget(self, pair: Pair, index: int) -> None:
        holders = self.where.get(pair)
        if holders is not None:
            holders.discard(index)
            if not holders:
                del self.where[pair]


def merge_word(word: Sequence[int], pair: Pair, new_id: int) -> list[int]:
    """Replace every occurrence of `pair` in `word` by `new_id`, scanning left to right.

    Overlapping occurrences resolve leftmost first ("aaa" with (a, a) gives [aa, a]),
    which is also what a merge-rank encoder does, so training and encoding agree.
    """
    left, right = pair
    out: list[int] = []
    i = 0
    n = len(word)
    while i < n:
        if i + 1 < n and word[i] == left and word[i + 1] == right:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def learn_merges(
    words: list[list[int]],
    weights: Sequence[int],
    token_bytes: dict[int, bytes],
    *,
    first_id: int,
    num_merges: int,
    progress: Progress | None = None,
) -> LearnResult:
    """Learn up to `num_merges` merges over word types; `words` is updated in place.

    words[i] is word type i as token ids, seen weights[i] times. token_bytes maps every
    existing non-special id to its bytes and gains an entry per new merge. The pair
    chosen is the one with the highest count, ties going to the smallest (left, right)
    ids, so the result depends only on the input.

    A pair whose bytes already belong to a token (e.g. (ab, c) when (a, bc) made "abc")
    is skipped for good: the HF engine keys its vocabulary by the token's string, so
    two ids cannot share one. When `words` are the existing merges applied to raw bytes
    this never fires (a byte string is segmented the same way wherever it occurs, so
    it is always built by the same last merge), but callers may hand in other states.
    Learning stops early when no pair is left (every word type is a single token).
    """
    if len(words) != len(weights):
        raise ValueError(f"{len(words)} words but {len(weights)} weights")
    index = _PairIndex()
    for i, word in enumerate(words):
        index.add_word(i, word, weights[i])
    # Min-heap of (-count, left, right): highest count first, then the smallest pair.
    heap = [(-count, left, right) for (left, right), count in index.counts.items()]
    heapq.heapify(heap)
    known = set(token_bytes.values())
    banned: set[Pair] = set()
    merges: list[Pair] = []
    skipped = 0
    while heap and len(merges) < num_merges:
        neg_count, left, right = heapq.heappop(heap)
        pair = (left, right)
        if index.counts.get(pair) != -neg_count or pair in banned:
            continue  # stale entry: the count changed after it was pushed
        merged = token_bytes[left] + token_bytes[right]
        if merged in known:
            banned.add(pair)
            skipped += 1
            continue
        new_id = first_id + len(merges)
        token_bytes[new_id] = merged
        known.add(merged)
        merges.append(pair)
        for changed in _apply_merge(words, weights, index, pair, new_id):
            count = index.counts.get(changed)
            if count is not None and changed not in banned:
                heapq.heappush(heap, (-count, *changed))
        if progress is not None:
            progress(len(merges), num_merges)
    return LearnResult(merges=merges, skipped=skipped)


def _apply_merge(
    words: list[list[int]], weights: Sequence[int], index: _PairIndex, pair: Pair, new_id: int
) -> set[Pair]:
    changed: set[Pair] = set()
    # sorted: set order of ints is stable anyway, but this keeps the order obvious.
    for i in sorted(index.where.get(pair, ())):
        new_word = merge_word(words[i], pair, new_id)
        changed |= index.replace_word(i, words[i], new_word, weights[i])
        words[i] = new_word
    return changed
