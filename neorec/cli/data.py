"""``neorec data``: ``preprocess`` (Criteo TSV, or Parquet / CSV / TSV with a config's
``data.schema``, into the columnar shards training reads), ``example-parquet`` (a small tabular
data set for configs/parquet_example.toml) and ``movielens`` (the MovieLens click recipe)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

HELP = "data tools: preprocess Criteo or tabular data into shards, example data, MovieLens"
ACTIONS = ("preprocess", "example-parquet", "movielens")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``neorec data``: the action, then its own flags."""
    p.add_argument("action", choices=ACTIONS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the action's own flags (--help)")


def passthrough(argv: list[str]) -> int | None:
    """``data ACTION ...``: its flags go to it unparsed; None for anything else."""
    mains = {
        "preprocess": preprocess_main,
        "example-parquet": example_main,
        "movielens": movielens_main,
    }
    if not argv or argv[0] not in mains:
        return None
    return mains[argv[0]](argv[1:])


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


def _multi_hot(s: str) -> list[int]:
    from neorec.data.shards import MLPERF_MULTI_HOT

    return list(MLPERF_MULTI_HOT) if s.strip().lower() == "mlperf" else _ints(s)


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
    p.add_argument(
        "--multi-hot",
        type=_multi_hot,
        default=[1],
        help="bag size per feature (1 or 26 comma-separated), or 'mlperf': MLPerf DLRMv2's "
        "published sizes (configs/criteo_multihot.toml)",
    )
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
    if a.config and _tabular(a.config):
        return _preprocess_tabular(a, out)
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


def _tabular(path: str) -> bool:
    from neorec.config import load_config

    return load_config(path).data.source == "tabular"


def _preprocess_tabular(a: argparse.Namespace, out: Any) -> int:
    """Parquet / CSV / TSV as the config's ``data.schema`` declares (Criteo-only flags refused)."""
    from neorec.config import ConfigError, load_config
    from neorec.data.tabular_pre import TabularOptions, preprocess_tabular

    criteo_only = {
        "--rows": a.rows,
        "--vocab-threshold": a.vocab_threshold,
        "--multi-hot": a.multi_hot != [1],
        "--raw": a.raw,
        "--bad-lines skip": a.bad_lines == "skip",
    }
    given = [k for k, v in criteo_only.items() if v]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: Criteo options; {a.config} reads tabular data, whose ids and "
            "vocabularies its data.schema declares"
        )
    if a.shard_rows < 1 or a.workers < 0:
        raise ConfigError("--shard-rows must be >= 1 and --workers >= 0")
    f = a.eval_fraction
    if f is not None and not (0.0 <= f < 1.0):
        raise ConfigError(f"--eval-fraction must be in [0, 1), got {f}")
    cfg = load_config(a.config)
    opts = TabularOptions(
        shard_rows=a.shard_rows,
        workers=a.workers,
        eval_fraction=f,
        bad_rows=cfg.data.bad_rows,
        max_bad_fraction=cfg.data.max_bad_fraction,
    )
    preprocess_tabular(a.input, a.output, cfg.data.schema, cfg.embedding.tables, opts, out=out)
    return 0


def example_main(argv: list[str] | None = None, out: Any = None) -> int:
    """``neorec data example-parquet``: the small data set of configs/parquet_example.toml."""
    p = argparse.ArgumentParser(
        prog="neorec data example-parquet",
        description="write a small Parquet (or CSV) click data set: part-0 train, part-1 eval",
    )
    p.add_argument("--output", required=True, help="output directory")
    p.add_argument("--format", choices=["parquet", "csv"], default="parquet")
    p.add_argument("--train", type=int, default=20_000, help="train samples")
    p.add_argument("--eval", type=int, default=4_000, help="eval samples")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from neorec.config import ConfigError
    from neorec.data.example import write_example

    if a.train < 1 or a.eval < 1:
        raise ConfigError(f"--train and --eval must be >= 1, got {a.train}, {a.eval}")
    paths = write_example(a.output, a.format, a.train, a.eval, a.seed)
    print(f"wrote {', '.join(str(x) for x in paths)}", file=sys.stdout if out is None else out)
    return 0


def movielens_main(argv: list[str] | None = None, out: Any = None) -> int:
    """``neorec data movielens``: GroupLens MovieLens files -> a preprocessed click task."""
    p = argparse.ArgumentParser(
        prog="neorec data movielens",
        description="MovieLens (ML-100K, ML-1M, ML-20M/25M, or RecBole's atomic ml-100k) -> a "
        "click task (rating >= 4) with the last 10% of each user's ratings held out, "
        "preprocessed for configs/movielens.toml",
    )
    p.add_argument("--input", required=True, help="the unpacked GroupLens directory")
    p.add_argument("--output", required=True, help="output directory (shards)")
    p.add_argument("--workers", type=int, default=0, help="processes (0 = one per core)")
    p.add_argument(
        "--sequential",
        action="store_true",
        help="write each user's time-ordered history instead (leave-one-out: last = test, the "
        "one before = valid; docs/data.md), for configs/sasrec_movielens.toml",
    )
    a = p.parse_args(argv)
    if a.sequential:
        from neorec.data.sequential import write_sequential

        write_sequential(a.input, a.output, stdout=sys.stdout if out is None else out)
        return 0
    from neorec.data.movielens import movielens

    movielens(a.input, a.output, workers=a.workers, stdout=sys.stdout if out is None else out)
    return 0
