"""`neuroshard-publish-shards`: tokenize text files into signed, hash-pinned shards."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm import tqdm

from .corpus import expand_paths, read_documents
from .keys import PublisherKeyError, load_or_create_signing_key
from .manifest import ShardInfo
from .publish import DEFAULT_SHARD_TOKENS, publish_shards


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neuroshard-publish-shards",
        description="Tokenize text into shard_{id}.pt files, write manifest.json and sign it (manifest.json.sig).",
    )
    parser.add_argument(
        "--input",
        nargs="+",
        type=Path,
        required=True,
        metavar="PATH",
        help="text files, or directories searched for *.txt, *.py, *.md, *.rst (sorted)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="DIR",
        help="data set directory; must already hold tokenizer.json (neuroshard-publish-tokenizer)",
    )
    parser.add_argument(
        "--key-file",
        type=Path,
        required=True,
        metavar="PATH",
        help="publisher Ed25519 seed (hex); created with mode 0600 if it does not exist",
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS:,})",
    )
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=None,
        metavar="N",
        help="stop reading input after this many characters (default: read everything)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        files = expand_paths(args.input)
        key, created = load_or_create_signing_key(args.key_file)
    except (FileNotFoundError, PublisherKeyError) as exc:
        print(f"neuroshard-publish-shards: error: {exc}", file=sys.stderr)
        return 2
    if created:
        print(f"created publisher key {args.key_file} (keep it secret; nodes pin its public key)")
    start = time.monotonic()
    bar = tqdm(desc="shards", unit="shard", file=sys.stderr)

    def on_shard(info: ShardInfo) -> None:
        bar.update(1)
        bar.set_postfix(tokens=f"{info.tokens:,}")

    try:
        manifest = publish_shards(
            read_documents(files, args.max_bytes),
            out=args.out,
            key=key,
            shard_tokens=args.shard_tokens,
            on_shard=on_shard,
        )
    except (FileExistsError, FileNotFoundError, ValueError) as exc:
        bar.close()
        print(f"neuroshard-publish-shards: error: {exc}", file=sys.stderr)
        return 2
    bar.close()
    tokens = sum(s.tokens for s in manifest.shards)
    print(
        f"published {manifest.total_shards} shards ({tokens:,} tokens) to {args.out} "
        f"in {time.monotonic() - start:.1f}s; publisher key {manifest.publisher}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
