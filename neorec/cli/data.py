"""``neorec data preprocess``: Criteo TSV (plain or .gz) into the columnar shards training reads."""

from __future__ import annotations

import argparse
import sys
from typing import Any

HELP = "data tools: preprocess Criteo TSV into columnar shards"
ACTIONS = ("preprocess",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``neorec data``: the action, then its own flags."""
    p.add_argument("action", choices=ACTIONS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the action's own flags (--help)")


def passthrough(argv: list[str]) -> int | None:
    """``data preprocess ...``: its flags go to it unparsed; None for anything else."""
    if argv[:1] != ["preprocess"]:
        return None
    return preprocess_main(argv[1:])


def run(args: argparse.Namespace) -> int:
    """Run the action."""
    return int(passthrough([args.action, *args.rest]) or 0)


def _rows_from_config(path: str) -> tuple[list[int], list[bool]]:
    """(rows, raw) per feature: the tables' rows, and which tables are dynamic (raw ids)."""
    from neorec.config import ConfigError, load_config
    from neorec.data.criteo import NUM_SPARSE

    tables = load_config(path).embedding.tables
    if len(tables) != NUM_SPARSE:
        raise ConfigError(
            f"{path}: Criteo needs {NUM_SPARSE} tables (C1..C26), the config has {len(tables)}"
        )
    return [t.rows for t in tables], [getattr(t, "kind", "fixed") == "dynamic" for t in tables]


def _raw_flags(s: str) -> list[bool]:
    """``--raw``: ``all``, ``none`` or comma-separated features (``C3,C7`` or ``3,7``)."""
    from neorec.data.criteo import NUM_SPARSE

    s = s.strip()
    if s in ("all", "none"):
        return [s == "all"] * NUM_SPARSE
    out = [False] * NUM_SPARSE
    for x in (x.strip() for x in s.split(",") if x.strip()):
        j = x[1:] if x[:1] in ("C", "c") else x
        if not j.isdigit() or not 1 <= int(j) <= NUM_SPARSE:
            raise argparse.ArgumentTypeError(
                f"'{x}' is not a feature: want all, none or C1..C{NUM_SPARSE} (comma-separated)"
            )
        out[int(j) - 1] = True
    return out


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _fraction(s: str) -> float:
    return float(s)


def preprocess_main(argv: list[str] | None = None, out: Any = None) -> int:
    """``neorec data preprocess``: flags -> preprocess() with progress and a summary.

    Bad input raises a :class:`~neorec.errors.NeorecError` (the ``neorec`` command prints it as
    one line and exits 2); a bad flag exits 2 through argparse.
    """
    p = argparse.ArgumentParser(prog="neorec data preprocess", description=HELP)
    p.add_argument("--input", nargs="+", required=True, help="TSV(.gz) files or directories")
    p.add_argument("--output", required=True, help="output directory")
    p.add_argument(
        "--config", help="take the hash modulus of each feature from this config's tables"
    )
    p.add_argument(
        "--rows",
        type=_ints,
        help="hash modulus: one size, or 26 comma-separated (default: the Criteo Kaggle table "
        "sizes of configs/criteo_kaggle.toml)",
    )
    p.add_argument(
        "--vocab-threshold", type=int, default=0, help="vocab mode: min count (0 = hash)"
    )
    p.add_argument("--multi-hot", type=_ints, default=[1], help="bag size per feature (1 or 26)")
    p.add_argument(
        "--raw",
        type=_raw_flags,
        default=None,
        help="features that keep raw 64-bit ids (no modulo) for dynamic tables: all, none or "
        "C1,C5,... (default: the dynamic tables of --config, else none)",
    )
    p.add_argument("--multi-hot-seed", type=int, default=0)
    p.add_argument("--bad-lines", choices=["fail", "skip"], default="fail")
    p.add_argument("--shard-rows", type=int, default=1 << 20)
    p.add_argument("--chunk-mb", type=float, default=64, help="plain files: MB per unit of work")
    p.add_argument("--workers", type=int, default=0, help="processes (0 = one per core)")
    p.add_argument(
        "--eval-fraction",
        type=_fraction,
        default=None,
        help="hold out the last fraction of the samples for eval (0 = none; default: the last "
        "input file if several, else 1/7)",
    )
    a = p.parse_args(argv)
    from neorec.config import ConfigError
    from neorec.data.preprocess import KAGGLE_ROWS, PreprocessOptions, preprocess

    out = sys.stdout if out is None else out
    if a.config and a.rows:
        raise ConfigError("give --config or --rows, not both")
    raw = [False]
    if a.vocab_threshold:
        rows = a.rows or [1 << 62]
    elif a.config:
        rows, raw = _rows_from_config(a.config)
    elif a.rows:
        rows = a.rows
    else:
        rows = KAGGLE_ROWS
        print(
            "rows: the Criteo Kaggle table sizes of configs/criteo_kaggle.toml (hash mode; "
            "--config or --rows to choose others)",
            file=out,
            flush=True,
        )
    opts = PreprocessOptions(
        rows=rows,
        mode="vocab" if a.vocab_threshold else "hash",
        threshold=max(1, a.vocab_threshold),
        multi_hot=a.multi_hot,
        multi_hot_seed=a.multi_hot_seed,
        bad_lines=a.bad_lines,
        shard_rows=a.shard_rows,
        chunk_bytes=max(1, int(a.chunk_mb * (1 << 20))),
        workers=a.workers,
        eval_fraction=a.eval_fraction,
        raw=raw if a.raw is None else a.raw,
    )
    preprocess(a.input, a.output, opts, out=out)
    return 0
