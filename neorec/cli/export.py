"""``neorec export``: a serving artifact of a saved model that loads with torch + numpy only."""

from __future__ import annotations

import argparse

from neorec.cli.eval import MODEL_HELP

HELP = "write a serving artifact that loads with torch + numpy only (no neorec)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``neorec export``."""
    p.add_argument("--model", required=True, metavar="RUN", help=MODEL_HELP)
    p.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) directory")
    p.add_argument(
        "--quantize",
        choices=["none", "fp16", "int8", "int4", "int2"],
        default="none",
        help="table rows: none (fp32), fp16, or int8 / int4 / int2 row-wise codes with a float16 "
        "scale and offset per row",
    )


def run(args: argparse.Namespace) -> int:
    """Export."""
    from neorec.serve.commands import run_export

    return run_export(args)
