"""`neuroshard-publish-shards`: tokenize text files into signed, hash-pinned shards.

neuroshard-publish-shards --input corpus/ --out dist --key-file publisher.key
neuroshard-publish-shards --input corpus/ --out s3://bucket/data --endpoint-url http://127.0.0.1:9000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm import tqdm

from neuroshard.cli.publish_tokenizer import add_publish_arguments
from neuroshard.data.corpus import expand_paths, read_documents
from neuroshard.data.keys import PublisherKeyError, load_or_create_signing_key
from neuroshard.data.publish import DEFAULT_SHARD_TOKENS, DEFAULT_WORKERS, PublishProgress, publish_shards
from neuroshard.data.storage import MAX_CONNECTIONS, StoreError, open_store


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neuroshard-publish-shards",
        description="Tokenize text into shard_{id}.pt files, write manifest.json and sign it (manifest.json.sig).",
    )
    add_publish_arguments(
        parser,
        input_help="text files, or directories searched for *.txt, *.py, *.md, *.rst (sorted)",
        out_help="data set directory or S3 location; must already hold tokenizer.json (neuroshard-publish-tokenizer)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=DEFAULT_WORKERS,
        metavar="N",
        help=f"parallel shard uploads, 1..{MAX_CONNECTIONS} (default {DEFAULT_WORKERS})",
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.workers <= MAX_CONNECTIONS:
        parser.error(f"--workers {args.workers} must be in 1..{MAX_CONNECTIONS}")
    try:
        files = expand_paths(args.input)
        store = open_store(args.out, args.endpoint_url)  # first: a key file is not created for nothing
        key, created = load_or_create_signing_key(args.key_file)
    except (FileNotFoundError, PublisherKeyError, StoreError) as exc:
        print(f"neuroshard-publish-shards: error: {exc}", file=sys.stderr)
        return 2
    if created:
        print(f"created publisher key {args.key_file} (keep it secret; nodes pin its public key)")
    start = time.monotonic()
    input_chars = _input_chars(files, args.max_bytes)
    with tqdm(desc="shards", unit="shard", file=sys.stderr) as bar:

        def on_progress(progress: PublishProgress) -> None:
            bar.total = progress.shards_total
            bar.update(progress.shards_done - bar.n)
            bar.set_postfix_str(_progress_line(progress, input_chars), refresh=False)

        try:
            manifest = publish_shards(
                read_documents(files, args.max_bytes),
                out=store,
                key=key,
                shard_tokens=args.shard_tokens,
                workers=args.workers,
                on_progress=on_progress,
            )
        except (OSError, ValueError, StoreError) as exc:  # OSError: a full disk, a file not found
            bar.close()
            print(f"neuroshard-publish-shards: error: {exc}", file=sys.stderr)
            return 2
    tokens = sum(s.tokens for s in manifest.shards)
    print(
        f"published version {manifest.version}: {manifest.total_shards} shards ({tokens:,} tokens) "
        f"to {store.describe()} in {time.monotonic() - start:.1f}s; publisher key {manifest.publisher}"
    )
    return 0


def _input_chars(files: list[Path], max_bytes: int | None) -> int:
    """About how many characters the run will read: file sizes (bytes ~ characters for mostly ASCII)."""
    total = sum(path.stat().st_size for path in files)
    return total if max_bytes is None else min(total, max_bytes)


def _progress_line(progress: PublishProgress, input_chars: int) -> str:
    """Like `12.3 MB/s, ETA 4m05s (3 already stored)`.

    The ETA comes from shards once their number is known (all text tokenized), before that
    from the share of the input text read so far.
    """
    eta = progress.eta_seconds
    if eta is None and progress.text_chars_read > 0 and input_chars > 0:
        eta = progress.seconds * max(input_chars / progress.text_chars_read - 1, 0.0)
    line = f"{progress.mb_per_s:.1f} MB/s, ETA " + ("?" if eta is None else _minutes(eta))
    return line + (f" ({progress.shards_skipped} already stored)" if progress.shards_skipped else "")


def _minutes(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s"


if __name__ == "__main__":
    sys.exit(main())
