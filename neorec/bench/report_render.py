"""The README rows of ``neorec bench report`` whose text states a verdict computed from the
result: which cost model wins (``costcheck``), whether ExFM's target is met per cell
(``distill``), the in-host reduction of table-row-wise (``twrw``), MovieLens over users and seeds
(``movielens``), the quantized lookup against fp32 (``quant_lookup``), large batches' NE
(``largebatch``), the sequence lookup's speedups (``seqlookup``)."""

from __future__ import annotations

from neorec.bench.report_text import Json, iv
from neorec.bench.report_text import seeds_text as _seeds

__all__ = [
    "costcheck",
    "distill",
    "distill_gap",
    "twrw",
    "movielens",
    "serve",
    "quant_lookup",
    "largebatch",
    "seqlookup",
    "dynamic_speed",
    "distill_speed",
    "sequential",
]


def costcheck(j: Json) -> str:
    """Learned and analytical errors, anchored and not, and which model the paired difference
    shows winning."""
    from neorec.bench.costcheck_errors import paired_errors  # the figures of older records

    e = j["errors"]
    paired = j.get("learned_minus_analytical") or paired_errors(
        j["results"], j["random_results"], j["anchored"]
    )

    def mean(d: Json) -> str:
        m = d["mean_interval"]
        scaled = {**m, "value": 100 * d["mean"], "lo": 100 * m["lo"], "hi": 100 * m["hi"]}
        return iv(scaled, ".1f", "%")

    def diff(d: Json) -> str:
        return iv({**d, **{k: 100 * d[k] for k in ("value", "lo", "hi")}}, "+.1f", " points")

    parts = []
    for how in ("anchored", "unanchored"):
        la, aa, p = e["learned"][how]["all"], e["analytical"][how]["all"], paired[how]
        where = ", ".join(f"{s} plans {p[s]['winner']}" for s in ("fixed", "random") if s in p)
        parts.append(
            f"{how}: learned mean \\|err\\| {mean(la)}, analytical {mean(aa)}; learned − "
            f"analytical {diff(p['all'])} paired by plan: **{p['all']['winner']} wins** "
            f"({where})"
        )
    la = e["learned"]["anchored"]["all"]
    return (
        f"{'; '.join(parts)}; max learned / analytical anchored {100 * la['max']:.0f}% / "
        f"{100 * e['analytical']['anchored']['all']['max']:.0f}%; {la['n']} plans, "
        f"{j['world_size']} ranks, batch {j['random_batch']}"
    )


def distill(j: Json) -> str:
    """Every cell's NE change of the full ExFM student against `alone`, with its interval."""
    cells = []
    for bias, by_k in j["per_bias"].items():
        for k, r in by_k["per_k"].items():
            cells.append(
                f"bias {bias}, k={k}: NE vs alone {iv(r['ne_minus_alone']['aux+adapter'], '+.4f')}"
            )
    streams = j.get("stream_seeds")
    where = (
        f"on their own streams, lr tuned for each on seeds {_seeds(j['dev_seeds'])}' streams"
        if streams
        else f"lr tuned for each on seeds {_seeds(j['dev_seeds'])} (the same stream)"
    )
    return f"{'; '.join(cells)}; seeds {_seeds(j['seeds'])} {where}"


def distill_gap(j: Json) -> str:
    """Every cell's `gap_closed` with its interval, met / not met by the lower end."""
    from neorec.bench.distill_stats import GAP_TARGET, target_met

    def cell(g: Json, fmt: str = ".3f") -> str:
        return f"{iv(g, fmt)} {'**met**' if target_met(g) else 'not met'}"

    cells = []
    for bias, by_k in j["per_bias"].items():
        for k, r in by_k["per_k"].items():
            g = r["gap_closed"]
            cells.append(
                f"bias {bias}, k={k}: fresh {cell(g['vs_fresh_fm'])}, recalibrated "
                f"{cell(g['vs_fresh_fm_recalibrated'])}, stale {cell(g['vs_stale_fm'], '.1f')}"
            )
    return f"{'; '.join(cells)} (met: the interval's lower end ≥ {GAP_TARGET:g})"


def twrw(j: Json) -> str:
    """Inter-host pooled bytes of table-row-wise against row-wise in the same host layout."""
    by = {r["type"]: r["inter_host_pooled_bytes"] for r in j["results"] if r["codecs"] == "fp32"}
    red, rph = j["inter_host_reduction"], j["ranks_per_host"]
    return (
        f"**{red['vs_row_wise_host']:.2f}×** fewer pooled bytes between hosts than row-wise over "
        f"the same in-host shards ({by['table_row_wise']:,} vs {by['row_wise_host']:,} B/step, "
        f"forward + backward, every byte counted); {red['vs_row_wise']:.2f}× vs row-wise over all "
        f"{j['nproc']} ranks ({by['row_wise']:,}); {j['nproc'] // rph} hosts × {rph}, "
        f"{j['tables']} tables × {j['rows']:,} × {j['dim']}, batch {j['batch']}"
    )


def movielens(j: Json) -> str:
    """Both models' eval AUC and DLRM - LR, intervals over users and seeds."""
    d, lr, b = j["dlrm"], j["lr"], j.get("bootstrap")
    if b is None:  # a record from before the bootstrap: its intervals cover the seeds only
        return (
            f"DLRM AUC {iv(d['auc_ci'], '.4f')}, logistic regression AUC {lr['auc']:.4f}; "
            f"DLRM − LR {iv(j['auc_diff'], '+.4f')} AUC; intervals over seeds "
            f"{_seeds(j['seeds'])} alone, on one eval set (they do not cover the data)"
        )
    return (
        f"DLRM AUC {iv(d['auc_ci_users'], '.4f')}, NE {d['ne']:.4f}; logistic regression AUC "
        f"{iv(lr['auc_ci_users'], '.4f')}, NE {lr['ne']:.4f}; DLRM − LR "
        f"{iv(j['auc_diff_users'], '+.4f')} AUC, {iv(j['logloss_diff_users'], '+.4f')} log loss; "
        f"intervals: a bootstrap over the {b['users']} eval users and seeds "
        f"{_seeds(j['seeds'])} (over seeds alone: {iv(j['auc_diff'], '+.4f')} AUC): "
        f"{_above(j['auc_diff_users'], j['auc_diff'])}; settings chosen on seeds "
        f"{_seeds(j['select_seeds'])}, a validation split"
    )


def _above(users: Json, seeds: Json) -> str:
    """DLRM above LR only where both intervals lie above 0: redrawing a few seeds understates
    their spread, so the t interval over seeds must agree."""
    both = all(d["lo"] is not None and d["lo"] > 0 for d in (users, seeds))
    return "**above LR beyond noise**" if both else "above LR not established"


def serve(j: Json) -> str:
    """``bench serve``: the rate held at p99 <= 20 ms with batching and without, their ratio, and
    whether the server refused the excess with 503s only."""
    m, gain = j["max_rps_p99_20ms"], j.get("batching_gain")
    ratio = f"**{gain:.2f}×**" if gain is not None else "no ratio (unbatched held nothing)"
    above = "503s only above it" if j.get("overload_only_503") else "**not only 503s above it**"
    return (
        f"{ratio}: batched {m['batched']:,.0f} requests/s vs unbatched {m['unbatched']:,.0f} "
        f"({j['headline']}; server and load generator share {j['cores']} cores); {above}"
    )


def quant_lookup(j: Json) -> str:
    """Per tables and ids: fp32's time per batch and each width's speed-up over it; **bold**
    where int4 is faster beyond noise."""
    parts = []
    for c in j["cases"]:
        sp = c["speedup_vs_fp32"]
        names = {"numpy": "the loader's NumPy path (fp32)"}
        widths = ", ".join(
            f"{names.get(k, k)} {iv(v, '.2f', '×')}" if v else f"{k} (one round)"
            for k, v in sp.items()
        )
        i4 = sp.get("int4")
        bold = "**" if i4 and i4["lo"] > 1 else ""
        parts.append(
            f"{bold}{c['shape'].replace('x', ' × ')} {c['ids']}{bold}: fp32 "
            f"{c['ms_per_batch']['none']:.3f} ms/batch, {widths}"
        )
    return "; ".join(parts) + f" ({j['threads']} thread, batch {j['batch']} × {j['pooling']} ids)"


def largebatch(j: Json) -> str:
    """Each large-batch arm's NE against batch B, and the verdict at 0.1%."""
    arms, r = j["arms"], j["recipe"]
    if "kB cowclip" not in arms:  # a result stored before CowClip
        recipe = f"warmup {r['warmup_share']:g}, {r['decay']}, scaling {r['scaling']}"
        return f"NE vs B: 8·B recipe ({recipe}) {iv(arms['kB recipe']['ne_vs_B_pct'], '+.2f', '%')}"
    c = j["cowclip"]
    ref = f"B NE {j['reference_ne']:.4f}, AUC {j['reference_auc']:.4f}"
    if "embedding_optimizer" in j:
        ref += f" (rows: {j['embedding_optimizer']}, lr {j['embedding_lr']:g})"
    big = j["factor"] * j["big"]
    parts = [
        f"8·B recipe (warmup {r['warmup_share']:g}, {r['decay']}) "
        + iv(arms["kB recipe"]["ne_vs_B_pct"], "+.2f", "%"),
        f"8·B CowClip (r {c['ratio']:g}, ζ {c['bound']:g}, row lr ×{c['row_lr_multiplier']:g}, "
        f"{c['decay']}{', ' + c['rule'] + ' lrs' if 'rule' in c else ''}) "
        + iv(arms["kB cowclip"]["ne_vs_B_pct"], "+.2f", "%"),
        f"{big}·B both " + iv(arms["k2B both"]["ne_vs_B_pct"], "+.2f", "%"),
    ]
    verdict = j["verdict"]
    if "verdicts" in j:
        verdict = ", ".join(f"{k.replace('kB', '8·B')} {v}" for k, v in j["verdicts"].items())
    return f"{ref}; NE vs B: " + "; ".join(parts) + f"; 0.1%: {verdict}; seeds {_seeds(j['seeds'])}"


def seqlookup(j: Json) -> str:
    """Our step time and its paired speedups over torch and FBGEMM."""
    out = f"{j['ms_per_step']:.1f} ms/step; vs torch {iv(j['speedup_vs_torch'], '.2f', '×')}"
    fb = j.get("speedup_vs_fbgemm")
    return out + (f"; vs FBGEMM {iv(fb, '.2f', '×')}" if fb else "; FBGEMM not run")


def dynamic_speed(j: Json) -> str:
    """A dynamic table's speed against a plain table per memory budget, and the id map's rate."""
    return (
        "; ".join(
            f"{100 * t['budget_fraction']:g}% memory: {iv(t['ratio_dynamic_vs_plain'], '.2f', '×')}"
            for t in j["throughput"]
        )
        + f"; id map {j['map_ids_per_s'] / 1e6:.1f} M ids/s"
    )


def distill_speed(j: Json) -> str:
    """A student's throughput next to its FM against alone, per k."""
    return "; ".join(
        f"k={k}: " + ", ".join(f"{s} {iv(v, '.2f', '×')}" for s, v in by.items())
        for k, by in j["throughput_vs_alone"].items()
    )


def sequential(j: Json) -> str:
    """SASRec and the popularity ranking on the test split, full corpus, seen items as run."""
    p, s, pop = j["protocol"], j["sasrec"], j["pop"]
    seen = "seen items excluded" if p["exclude_seen"] else "seen items kept"
    return (
        f"SASRec HR@10 {iv(s['hr@10'], '.4f')}, NDCG@10 {iv(s['ndcg@10'], '.4f')}, MRR@10 "
        f"{iv(s['mrr@10'], '.4f')} (over seeds {_seeds(j['seeds'])}; users: HR@10 "
        f"{iv(s['users']['hr@10'], '.4f')}); popularity HR@10 {pop['hr@10']['value']:.4f}, NDCG@10 "
        f"{pop['ndcg@10']['value']:.4f}; {p['candidates']}, {seen}, leave-one-out test"
    )
