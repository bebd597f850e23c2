"""A generated fp32 Qwen3 for the benchmarks that need a model larger than the tests' tiny one: its shape as flags
(default about 390M parameters: hidden 2048, 8 layers, 32 heads, MLP 5888), and the folder made from them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def add_shape_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=5888)
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: the test tokenizer's 259)")


def generated_model(args: argparse.Namespace, folder: Path) -> Path:
    from testkit import make_tiny_model

    return make_tiny_model(
        folder,
        "qwen3",
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        intermediate=args.intermediate,
        vocab=args.vocab or None,
    )
