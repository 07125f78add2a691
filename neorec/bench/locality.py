"""How close locality-calibrated synthetic ids come to Meta's published per-batch reuse.

Samples one batch of a production-like table mix (neorec.data.locality.production_like_tables) with
``locality_ids``, measures its lookup-share histogram, and prints it next to the references and the
analytic expectation, then one JSON line. ``--scale s`` divides rows and batch by s (same reuse
shape below the top bins, s^2 times cheaper).

    python -m neorec.bench.locality [--tables 64] [--scale 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from neorec.data.ids import LOCALITY_REF_BATCH, locality_ids
from neorec.data.locality import (
    BIN_LABELS,
    REFERENCE_LOOKUP_SHARE,
    REFERENCE_LOOKUP_SHARE_BY_FILE,
    expected_lookup_share,
    histogram_distance,
    mean_lookup_share,
    parse_locality_file,
    production_like_tables,
    reference_files,
    reuse_histograms,
)


def main(argv: list[str] | None = None) -> int:
    """Print the calibration table and a JSON summary line; returns the exit code."""
    ap = argparse.ArgumentParser(prog="neorec.bench.locality", description=__doc__)
    ap.add_argument("--tables", type=int, default=64, help="tables in the production-like mix")
    ap.add_argument("--scale", type=float, default=4.0, help="divide rows and batch by this")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    batch = max(1, round(LOCALITY_REF_BATCH / args.scale))
    tables = production_like_tables(args.tables, scale=args.scale)
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    ids = [
        locality_ids(t.rows, round(t.pooling_factor * batch), t.pooling_factor * batch, g, salt=i)
        for i, t in enumerate(tables)
    ]
    t1 = time.perf_counter()
    col_share, lookup_share = reuse_histograms(ids)
    t2 = time.perf_counter()
    expected = expected_lookup_share(tables, batch, ref_batch=batch)

    refs = dict(REFERENCE_LOOKUP_SHARE_BY_FILE)
    files = reference_files()
    for f in files:  # prefer the files themselves when present
        refs[f.name] = tuple(mean_lookup_share(parse_locality_file(f)))
    names = list(refs)
    print(
        f"{len(tables)} tables, batch {batch}, {sum(x.numel() for x in ids):,} lookups "
        f"(scale {args.scale:g}); references from {'files' if files else 'embedded constants'}"
    )
    header = f"{'bin':>16} {'sampled':>8} {'expected':>8} {'ref mean':>8}"
    header += "".join(f" {n[-8:-4]:>8}" for n in names)
    print(header)
    for i, label in enumerate(BIN_LABELS):
        row = f"{label:>16} {lookup_share[i]:8.3f} {expected[i]:8.3f} {REFERENCE_LOOKUP_SHARE[i]:8.3f}"
        row += "".join(f" {refs[n][i]:8.3f}" for n in names)
        print(row)
    dist = {n: histogram_distance(lookup_share, refs[n]) for n in names}
    summary = {
        "bench": "locality",
        "tables": len(tables),
        "batch": batch,
        "scale": args.scale,
        "lookups": sum(x.numel() for x in ids),
        "distance_mean_ref": histogram_distance(lookup_share, REFERENCE_LOOKUP_SHARE),
        "distance_by_file": dist,
        "distance_expected_vs_mean_ref": histogram_distance(expected, REFERENCE_LOOKUP_SHARE),
        "unique_share_singletons": float(col_share[0]),
        "gen_s": round(t1 - t0, 3),
        "hist_s": round(t2 - t1, 3),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
