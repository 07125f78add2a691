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
    p.add_argument(
        "--low-rank",
        metavar="R",
        help="store each table of dim > R as U [rows, R] @ V [R, dim] (fp32), factored by "
        "alternating least squares from a random start; tables of dim <= R stay as they are",
    )
    p.add_argument(
        "--low-rank-iters",
        metavar="K",
        help="ALS iterations of --low-rank (default 5; each is one pass over the table)",
    )


def run(args: argparse.Namespace) -> int:
    """Export."""
    from neorec.serve.commands import run_export

    return run_export(args)
