"""``neorec bench NAME``: benchmarks; each prints a table and a JSON line (its flags: ``--help``)."""

from __future__ import annotations

import argparse
import importlib

HELP = "benchmarks (print a table and a JSON line)"

BENCHES = (
    "op",
    "step",
    "planner",
    "locality",
    "dist",
    "costcheck",
    "cache",
    "ckpt",
    "data",
    "lowp",
    "dmt",
    "dynamic",
    "distill",
    "largebatch",
    "movielens",
    "sequential",
    "report",
    "soak",
    "serve",
    "threads",
    "qlookup",
    "lowrank",
    "quant",
    "seqlookup",
)
"""Each is ``neorec.bench.<name>``, whose ``main(argv)`` parses its own flags."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``neorec bench``: the benchmark, then its own flags."""
    p.add_argument("name", choices=BENCHES, help="which benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags")


def passthrough(argv: list[str]) -> int | None:
    """``bench NAME ...``: the benchmark's flags go to it unparsed; None for anything else. A
    benchmark's JSON line is followed by its provenance (``neorec.bench.provenance``)."""
    if not argv or argv[0] not in BENCHES:
        return None
    main = importlib.import_module(f"neorec.bench.{argv[0]}").main
    if argv[0] == "report":  # it runs the others: its own output is no result
        return int(main(argv[1:]) or 0)
    from neorec.bench.provenance import run_recorded

    return run_recorded(main, ["bench", *argv])


def run(args: argparse.Namespace) -> int:
    """Run the benchmark."""
    return int(passthrough([args.name, *args.rest]) or 0)
