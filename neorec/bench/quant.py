"""``neorec bench quant``: eval NE of the default model with its tables quantized at each width,
post-training quantization (PTQ) against quantization-aware training (QAT), paired by seed.

Per seed (model seed = data seed = ``train.seed``), the default config (``configs/default.toml``,
``neorec train``'s) trains once in fp32: the reference, whose eval NE and AUC are reported. Its
tables are then stored at each width with the export's codec (``table_roundtrip``: the function
``neorec export --quantize`` writes the rows with) and read back as the loader reads them, and the
model is evaluated on them (PTQ). For each integer width the same seed trains again with
``[train.qat]`` at that width (``--strength``, ``--start-fraction``, ``--shape``), is quantized at
that width and evaluated (QAT). A cost is ``ne / reference ne - 1`` per seed (in %), its mean and
95% t interval over the seeds (``neorec.bench.stats``); ``bytes_ratio`` is the stored bytes
(codes, scales, offsets as the export writes them) over the fp32 rows' bytes.

QAT's settings were chosen on ``DEV_SEEDS`` (``--select``: a grid of strength x start fraction
at ``--select-widths``, on those seeds; docs/embeddings.md has the grid's result) and are
reported on others (``--seeds``, by default 10-14); the JSON records both, and ``held_out``
says whether they are apart. Targets (issue 53): int8 PTQ within 0.02% NE, int4 with QAT within
0.1% (the interval's upper end), int4 at <= 0.2x the fp32 bytes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from torch import Tensor

from neorec.bench.quant_summary import print_select, print_table, select_summary, summarize
from neorec.bench.stats import parse_seeds
from neorec.config import Config, load_config
from neorec.errors import ConfigError
from neorec.modules.collection import EmbeddingCollection

if TYPE_CHECKING:
    from neorec.train.trainer import Trainer

__all__ = ["main", "table_roundtrip", "WIDTHS", "DEV_SEEDS", "QAT_CHOSEN"]

WIDTHS = {"fp16": 16, "int8": 8, "int4": 4, "int2": 2}
"""Stored widths: fp16 (PTQ only) and the integer codes (PTQ and QAT)."""
DEV_SEEDS = (0, 1, 2)
"""The seeds QAT's settings were chosen on (never reported)."""
QAT_CHOSEN = {"strength": 0.03, "start_fraction": 0.25, "shape": "sin"}
"""QAT's settings chosen on ``DEV_SEEDS`` (``--select``; docs/embeddings.md)."""
SELECT_GRID = "0.03:0.25,0.3:0.25,1:0.25,10:0.25,100:0.25,1000:0.25"
"""``--select``'s default grid: strength:start_fraction pairs."""


def table_roundtrip(w: Tensor, kind: str) -> tuple[Tensor, int]:
    """Rows ``w`` [rows, dim] stored at ``kind`` and read back as the serving loader reads them
    (fp32 rows), and the stored bytes: the export's own writer and the loader's own reader, so
    this benchmark and ``neorec export --quantize`` cannot disagree (``tests/test_bench_quant.py``
    checks it bitwise against an export)."""
    from neorec.ops.quant_lookup import quantize_rows
    from neorec.serve.standalone import Table

    q = quantize_rows(w, kind)
    stored = SimpleNamespace(  # what Table.rows reads of a loaded table
        quantization=kind,
        weight=q.data,
        data=q.data,
        dim=q.dim,
        bits=WIDTHS[kind],
        scale_unit=q.scale_unit,
        offset_unit=q.offset_unit,
    )
    rows = Table.rows(cast(Any, stored), np.arange(w.shape[0], dtype=np.int64))
    return rows, int(q.data.nbytes)


def quantized_metrics(
    ebc: Any, evaluate: Callable[[], dict[str, float]], kind: str
) -> tuple[dict[str, float], float]:
    """``evaluate()``'s metrics with every table of ``ebc`` (a collection with
    ``set_table_weight``: an ``EmbeddingBagCollection``) stored at ``kind``, and the stored bytes
    over the fp32 bytes; the fp32 tables are put back after."""
    saved = {t.name: ebc.table_weight(t.name).detach().clone() for t in ebc.tables}
    stored = fp32 = 0
    try:
        for name, w in saved.items():
            rows, nbytes = table_roundtrip(w, kind)
            ebc.set_table_weight(name, rows)
            stored, fp32 = stored + nbytes, fp32 + w.numel() * 4
        return evaluate(), stored / fp32
    finally:
        for name, w in saved.items():
            ebc.set_table_weight(name, w)


def grid_rms(ebc: EmbeddingCollection, bits: int) -> float:
    """The tables' mean RMS distance of a row to its ``bits`` grid, relative to the row's grid
    step (0: every value on a level; 0.29: uniform between levels)."""
    from neorec.ops.qat import grid_error

    out, n = 0.0, 0
    for t in ebc.tables:
        w = ebc.table_weight(t.name).detach().float()
        step = (w.amax(1) - w.amin(1)) / ((1 << bits) - 1)
        ok = step > 0
        out += float((grid_error(w, bits)[ok] / step[ok]).sum())
        n += int(ok.sum())
    return out / max(n, 1)


def _config(a: argparse.Namespace, seed: int, run_dir: Path, extra: list[str]) -> Config:
    """The default config (or ``--config``), seeded, quiet, no saved model."""
    return load_config(
        a.config,
        [
            *a.set,
            f"train.seed={seed}",
            f"data.seed={seed}",
            "train.progress=false",
            "train.save_model=false",
            f"train.threads={a.threads}",
            f"train.run_dir='{run_dir}'",
            *extra,
        ],
    )


def _train(cfg: Config) -> tuple[Trainer, dict[str, Any]]:
    """A trained ``Trainer`` (its model and eval source kept for the quantized evals) and its
    metrics."""
    from neorec.train.trainer import Trainer

    t = Trainer(cfg)
    return t, t.fit()["eval"]


def _quantized(t: Trainer, kind: str) -> dict[str, Any]:
    """A trained model's eval NE / AUC at ``kind``, its bytes ratio and (integer widths) its
    tables' distance to their grid."""
    m, ratio = quantized_metrics(t.model.ebc, t.evaluate, kind)
    out = {"ne": m["ne"], "auc": m["auc"], "bytes_ratio": ratio}
    if kind != "fp16":
        out["grid_rms"] = grid_rms(t.model.ebc, WIDTHS[kind])
    return out


def _qat_sets(bits: int, qat: dict[str, Any]) -> list[str]:
    return [
        f"train.qat.bits={bits}",
        f"train.qat.strength={qat['strength']}",
        f"train.qat.start_fraction={qat['start_fraction']}",
        f"train.qat.shape='{qat['shape']}'",
    ]


def run_seed(
    a: argparse.Namespace, seed: int, widths: list[str], qats: list[dict[str, Any]], tmp: Path
) -> dict[str, Any]:
    """One seed: the fp32 reference's metrics, PTQ at ``widths``, and QAT at the integer widths
    for each setting in ``qats`` (its own fp32 NE, its quantized NE, its grid distance)."""
    from neorec.bench.lowrank import als_error_over_svd

    ref, ref_m = _train(_config(a, seed, tmp / f"fp32-{seed}", []))
    out: dict[str, Any] = {"seed": seed, "reference": ref_m, "ptq": {}, "qat": []}
    for kind in widths:
        out["ptq"][kind] = _quantized(ref, kind)
    ebc = ref.model.ebc
    tables = [ebc.table_weight(t.name).detach().float().cpu() for t in ebc.tables]
    out["als"] = {  # the export's ALS (neorec export --low-rank R) on these trained tables
        str(r): als_error_over_svd(tables, r, seed=seed) for r in a.als_ranks
    }
    del ref
    for qat in qats:
        per: dict[str, Any] = {}
        for kind in (k for k in widths if k != "fp16"):
            bits = WIDTHS[kind]
            name = f"qat{bits}-{qat['strength']}-{qat['start_fraction']}-{seed}"
            t, t_m = _train(_config(a, seed, tmp / name, _qat_sets(bits, qat)))
            per[kind] = {**_quantized(t, kind), "fp32_ne": t_m["ne"]}
        out["qat"].append({"setting": qat, "widths": per})
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags."""
    p = argparse.ArgumentParser(prog="neorec bench quant", description=__doc__)
    p.add_argument("--config", default=None, help="TOML config (default: the built-in default)")
    p.add_argument("--set", action="append", default=[], help="config override (repeatable)")
    p.add_argument("--seeds", default="10-14", help="reported seeds: a-b or a,b,c")
    p.add_argument("--widths", default="fp16,int8,int4,int2", help="stored widths")
    p.add_argument("--strength", type=float, default=QAT_CHOSEN["strength"])
    p.add_argument("--start-fraction", type=float, default=QAT_CHOSEN["start_fraction"])
    p.add_argument("--shape", default=QAT_CHOSEN["shape"], choices=("sin", "hat"))
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="train.threads (fixed, so a pair's runs are the same until QAT starts; 0: neorec's "
        "load-aware default, which may differ between runs)",
    )
    p.add_argument(
        "--select",
        action="store_true",
        help="choose QAT's settings: run --grid on --dev-seeds at --select-widths",
    )
    p.add_argument(
        "--als-ranks",
        default="4,8",
        type=lambda x: [int(v) for v in x.split(",") if v.strip()],
        help="ranks of the ALS-vs-SVD measurement on the trained tables ('' = none)",
    )
    p.add_argument("--dev-seeds", default="0-2", help="--select's seeds (never reported)")
    p.add_argument("--grid", default=SELECT_GRID, help="--select: strength:start_fraction,...")
    p.add_argument("--select-widths", default="int4", help="--select: the widths it compares")
    return p.parse_args(argv)


def als_summary(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """``als_error_over_svd``: per iteration count, the export's ALS error over the SVD optimum's
    on the trained tables (pooled over tables), the worst seed's at the largest rank measured;
    ``als_error_over_svd_by_rank``: the same per rank."""
    ranks = sorted({int(r) for s in per_seed for r in s.get("als", {})})
    by_rank = {
        str(r): {
            it: max(s["als"][str(r)][it] for s in per_seed) for it in per_seed[0]["als"][str(r)]
        }
        for r in ranks
    }
    top = by_rank[str(ranks[-1])] if ranks else None
    return {
        "als_error_over_svd": top,
        "als_rank": ranks[-1] if ranks else None,
        "als_error_over_svd_by_rank": by_rank,
    }


def _widths(text: str, flag: str) -> list[str]:
    out = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in out if w not in WIDTHS]
    if bad or not out:
        raise ConfigError(f"bench quant {flag} {text!r}: expected some of {', '.join(WIDTHS)}")
    return out


def _grid(a: argparse.Namespace) -> list[dict[str, Any]]:
    try:
        pairs = [x.split(":") for x in a.grid.split(",") if x.strip()]
        return [
            {"strength": float(s), "start_fraction": float(f), "shape": a.shape} for s, f in pairs
        ]
    except ValueError:
        raise ConfigError(
            f"bench quant --grid {a.grid!r}: expected strength:start_fraction pairs"
        ) from None


def _check(a: argparse.Namespace, seeds: list[int], qats: list[dict[str, Any]]) -> None:
    """Every run's config built once before any training (a bad flag fails in seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        for qat in qats:
            _config(a, seeds[0], Path(tmp) / "check", _qat_sets(4, qat))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or ``--select``); print a table and a JSON line."""
    a = parse(argv)
    t0 = time.perf_counter()
    if a.select:
        seeds = parse_seeds(a.dev_seeds, "--dev-seeds")
        widths, qats = _widths(a.select_widths, "--select-widths"), _grid(a)
    else:
        seeds = parse_seeds(a.seeds, "--seeds")
        widths = _widths(a.widths, "--widths")
        qats = [{"strength": a.strength, "start_fraction": a.start_fraction, "shape": a.shape}]
    _check(a, seeds, qats)
    with tempfile.TemporaryDirectory() as tmp:
        per_seed = [run_seed(a, s, widths, qats, Path(tmp)) for s in seeds]
    common = {"config": a.config or "configs/default.toml (built-in default)", "sets": a.set}
    if a.select:
        result = select_summary(per_seed, widths)
        result.update(bench="quant", mode="select", dev_seeds=seeds, **common)
        print_select(result)
    else:
        dev = parse_seeds(a.dev_seeds, "--dev-seeds")
        result = summarize(per_seed, widths)
        result.update(
            bench="quant",
            seeds=seeds,
            qat_settings={**qats[0], "chosen_on_seeds": dev},
            held_out=not set(seeds) & set(dev),
            **common,
        )
        result.update(als_summary(per_seed))
        print_table(result)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))
    return 0
