"""neuroshard-publish-tokenizer: train or extend the BPE and write DIR/tokenizer.json.

neuroshard-publish-tokenizer --input corpus/ notes.txt --out dist --vocab-size 4096
neuroshard-publish-tokenizer --input more.txt --out dist --extend 512
neuroshard-publish-tokenizer --input corpus/ --out s3://bucket/data --endpoint-url http://127.0.0.1:9000
"""

from __future__ import annotations

import argparse
import codecs
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from tqdm import tqdm

from neuroshard.data.storage import Store, StoreError, open_store
from neuroshard.tokenizer.bpe import FIRST_MERGE_ID, BPETokenizer

TOKENIZER_NAME = "tokenizer.json"
TEXT_SUFFIXES = (".txt", ".py")
"""File types read from directories given to --input (files named directly are always read)."""


class UsageError(Exception):
    """A problem with the command line or its files: one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage block; one line says enough.
        raise UsageError(message)


@dataclass(kw_only=True)
class PublishConfig:
    """What one run of the publisher does, as parsed from the command line."""

    inputs: list[Path]
    """Text files, and directories searched recursively for TEXT_SUFFIXES files."""
    out: str
    """Directory (created if missing) or s3://bucket/prefix that receives tokenizer.json."""
    endpoint_url: str | None
    """S3-compatible endpoint for an s3:// `out`; None means AWS."""
    vocab_size: int | None
    """Train a new tokenizer with this many ids; None when extending."""
    extend: int | None
    """Learn this many merges on top of out/tokenizer.json; None when training anew."""
    max_bytes: int
    """Stop reading input after this many UTF-8 bytes, so a large corpus stays fast."""


def add_publish_arguments(parser: argparse.ArgumentParser, *, input_help: str, out_help: str) -> None:
    """--input, --out and --endpoint-url: what both publishers (this one and
    neuroshard-publish-shards, cli.publish_shards) read, and the store they write to (data.storage.open_store)."""
    parser.add_argument("--input", nargs="+", type=Path, required=True, metavar="PATH", help=input_help)
    parser.add_argument("--out", required=True, metavar="DIR|s3://BUCKET/PREFIX", help=out_help)
    parser.add_argument(
        "--endpoint-url",
        default=None,
        metavar="URL",
        help="S3-compatible endpoint for s3:// (default: AWS; region and credentials from the usual AWS settings)",
    )


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="neuroshard-publish-tokenizer",
        description="Train or extend the BPE and write DIR/tokenizer.json.",
    )
    add_publish_arguments(
        p,
        input_help="UTF-8 text files or directories (searched for *.txt and *.py, sorted)",
        out_help="writes DIR/tokenizer.json (or the object PREFIX/tokenizer.json)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--vocab-size", type=int, metavar="N", help="train a new tokenizer with N ids (default 4096)"
    )
    mode.add_argument(
        "--extend", type=int, metavar="N", help="learn N more merges on top of DIR/tokenizer.json"
    )
    p.add_argument(
        "--max-bytes",
        type=int,
        default=8_000_000,
        metavar="N",
        help="read at most N bytes of input text (default 8000000)",
    )
    return p


def parse_args(argv: list[str] | None) -> PublishConfig:
    args = _parser().parse_args(argv)
    if args.extend is None and args.vocab_size is None:
        args.vocab_size = 4096
    if args.vocab_size is not None and args.vocab_size < FIRST_MERGE_ID:
        raise UsageError(
            f"--vocab-size {args.vocab_size} is below {FIRST_MERGE_ID} (10 special ids + 256 bytes)"
        )
    if args.extend is not None and args.extend < 1:
        raise UsageError(f"--extend {args.extend} must be at least 1")
    if args.max_bytes < 1:
        raise UsageError(f"--max-bytes {args.max_bytes} must be at least 1")
    return PublishConfig(
        inputs=args.input,
        out=args.out,
        endpoint_url=args.endpoint_url,
        vocab_size=args.vocab_size,
        extend=args.extend,
        max_bytes=args.max_bytes,
    )


def input_files(inputs: list[Path]) -> list[Path]:
    """Expand directories (recursively, sorted) and check that every path exists."""
    files: list[Path] = []
    for path in inputs:
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"--input {path}: no such file or directory")
    if not files:
        raise UsageError(f"--input {' '.join(map(str, inputs))}: no *.txt or *.py files found")
    return files


def read_texts(files: list[Path], max_bytes: int) -> Iterator[str]:
    """Yield each file's text until max_bytes bytes are read; a cut never splits a character."""
    left = max_bytes
    for path in files:
        if left <= 0:
            return
        with path.open("rb") as f:
            data = f.read(left)
        left -= len(data)
        try:
            # final=False keeps back a multi-byte character cut by the byte cap.
            yield codecs.getincrementaldecoder("utf-8")().decode(data, final=left > 0)
        except UnicodeDecodeError as exc:
            raise UsageError(f"--input {path}: not UTF-8 (byte {exc.start}: {exc.reason})") from exc


def publish(
    config: PublishConfig, store: Store, progress: Callable[[int, int], None] | None = None
) -> BPETokenizer:
    """Train or extend as `config` says and write tokenizer.json to `store`."""
    base = _stored_tokenizer(store) if config.extend is not None else None  # fail before reading input
    texts = list(read_texts(input_files(config.inputs), config.max_bytes))
    if base is not None and config.extend is not None:
        tokenizer = base.extend(texts, config.extend, progress=progress)
    else:
        assert config.vocab_size is not None  # parse_args sets the default
        tokenizer = BPETokenizer.train(texts, config.vocab_size, progress=progress)
    store.put_bytes(TOKENIZER_NAME, tokenizer.to_bytes())
    return tokenizer


def _stored_tokenizer(store: Store) -> BPETokenizer:
    raw = store.get_bytes(TOKENIZER_NAME)
    if raw is None:
        raise UsageError(
            f"--extend: {store.describe(TOKENIZER_NAME)} does not exist (train one first with --vocab-size)"
        )
    return BPETokenizer.from_bytes(raw, source=store.describe(TOKENIZER_NAME))


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    try:
        config = parse_args(argv)
        store = open_store(config.out, config.endpoint_url)
        with tqdm(desc="merges", unit="merge", disable=None, leave=False) as bar:

            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            tokenizer = publish(config, store, progress)
    except (UsageError, OSError, ValueError, StoreError) as exc:
        print(f"neuroshard-publish-tokenizer: error: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    asked = config.vocab_size if config.extend is None else None
    if asked is not None and tokenizer.vocab_size < asked:
        print(
            f"note: the input ran out of pairs to merge at vocab_size {tokenizer.vocab_size} < {asked}",
            file=sys.stderr,
        )
    print(
        f"wrote {store.describe(TOKENIZER_NAME)}: vocab_size={tokenizer.vocab_size} "
        f"next_merge_id={tokenizer.next_merge_id} sha256={tokenizer.sha256} seconds={seconds:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
