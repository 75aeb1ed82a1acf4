"""`neuroshard-export`: a trained model as a Hugging Face Llama folder (node.export does the work).

Also the flags that name a trained model, which `neuroshard-generate` shares (cli.generate)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from neuroshard.node import export
from neuroshard.node.export import DTYPES, ModelSource, export_hf, open_source
from neuroshard.node.model import MODEL_SIZES
from neuroshard.node.model_file import MODELS_DIR

PROG = "neuroshard-export"


def add_source_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that name a trained model (`neuroshard-export`, `neuroshard-generate`)."""
    p.add_argument(
        "--checkpoint",
        required=True,
        help="a node checkpoint (HOME/checkpoints/WALLET-stage0.pt), a whole-model .safetensors file, "
        "or a round number (or 'latest') of the verifier's majority models (see --models)",
    )
    p.add_argument(
        "--models",
        type=Path,
        help=f"the verifier's round files, for a round --checkpoint (default: the run under "
        f"HOME/{MODELS_DIR}/ measured last)",
    )
    p.add_argument(
        "--verifier",
        help="download a round --checkpoint from this verifier's API instead (http://HOST:PORT)",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        action="append",
        default=[],
        help="tokenizer.json or a data set directory holding it (default: HOME/data/default)",
    )
    p.add_argument("--home", type=Path, default=Path.home() / ".neuroshard", help="node state directory")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), help="preset (default: found by fingerprint)")


def source_from_args(args: argparse.Namespace) -> ModelSource:
    return ModelSource(
        checkpoint=args.checkpoint,
        models=args.models,
        verifier=args.verifier,
        tokenizers=tuple(args.tokenizer),
        home=args.home,
        model_size=args.model_size,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=PROG, description=export.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_source_arguments(p)
    p.add_argument("--out", type=Path, required=True, help="folder to write (created if missing)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="tensor type of model.safetensors")
    args = p.parse_args(argv)
    try:
        model, tokenizer = open_source(source_from_args(args))
        if tokenizer is None:
            raise ValueError("no tokenizer.json found: pass --tokenizer (a file or the data set directory)")
        files = export_hf(args.out, model, tokenizer, dtype=args.dtype)
    except (ValueError, OSError, KeyError, TypeError) as exc:  # urllib's errors are OSErrors
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    n = sum(v.numel() for v in model.state_dict.values())
    print(f"exported {n:,} parameters ({args.dtype}) to {args.out}: {', '.join(f.name for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
