"""`neuroshard-generate`: sample text from a trained model, streamed to the terminal (node.generate)."""

from __future__ import annotations

import argparse
import sys

from neuroshard.cli.export import add_source_arguments, source_from_args
from neuroshard.node import device as devices
from neuroshard.node import generate
from neuroshard.node.export import open_source
from neuroshard.node.generate import SamplingConfig, sample_text

PROG = "neuroshard-generate"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=PROG, description=generate.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_source_arguments(p)
    d = SamplingConfig()
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature, help="0: greedy")
    p.add_argument("--top-k", type=int, default=d.top_k, help="0: no top-k cut")
    p.add_argument("--top-p", type=float, default=d.top_p, help="1: no nucleus cut")
    p.add_argument("--seed", type=int, help="sampling seed (default: random)")
    p.add_argument("--device", default="cpu", help="auto, cpu, cuda, cuda:N or mps")
    args = p.parse_args(argv)
    try:
        cfg = SamplingConfig(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k or None,
            top_p=args.top_p if args.top_p < 1 else None,
            seed=args.seed,
        )
        trained, tokenizer = open_source(source_from_args(args))
        if tokenizer is None:
            raise ValueError("no tokenizer.json found: pass --tokenizer (a file or the data set directory)")
        model = trained.build().to(devices.resolve_device(args.device))
    except (ValueError, OSError, KeyError, TypeError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(args.prompt)
    sys.stdout.flush()

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    sample_text(model, tokenizer, args.prompt, cfg, max_seq_len=trained.config.max_seq_len, on_text=show)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
