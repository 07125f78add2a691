"""The entries of ``neorec bench report``: one command each, and how its JSON line becomes a row of
the README's results table."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from neorec.bench import report_render as _render
from neorec.bench.quant_summary import quant_row
from neorec.bench.report_text import Json, iv, pct
from neorec.bench.report_text import seeds_text as _seeds

__all__ = ["Entry", "ENTRIES", "render_table"]


@dataclass(frozen=True)
class Entry:
    """One headline command: ``neorec <kind> <argv>`` (kind ``bench`` or ``train``), its small
    ``--quick`` form, and the row its result renders to."""

    name: str
    what: str
    target: str
    argv: tuple[str, ...]
    quick: tuple[str, ...]
    render: Callable[[Json], str]
    kind: str = "bench"
    source: str = ""
    """Another entry whose result this row renders (one run, several rows)."""

    def command(self, quick: bool = False) -> str:
        """The command as a user types it."""
        return shlex.join(["neorec", self.kind, *(self.quick if quick else self.argv)])

    @property
    def key(self) -> str:
        """The name its result is stored under."""
        return self.source or self.name


def _threads(j: Json) -> str:
    floor = ""
    if "loaded_over_floor" in j:  # a result stored before the fair-share floor had none
        floor = (
            f" (the scheduler's floor, one thread at {j['fair_share']:.2g} of a CPU: "
            f"{iv(j['floor_over_quiet'])}×; neorec {iv(j['loaded_over_floor'])}× the floor)"
        )
    return (
        f"neorec's default {iv(j['loaded_over_quiet'])}× its quiet time{floor}; PyTorch's "
        f"default ({j['torch_threads']} threads) {iv(j['torch_over_neorec'])}× neorec's time"
    )


def _op(j: Json) -> str:
    ours = f"{j['ms_per_step']:.1f} ms/step"
    if j.get("speedup_vs_fbgemm") is None:
        return ours
    sp = j.get("speedup_vs_fbgemm_interval")
    ratio = iv(sp, ".2f", "×") if sp else f"{j['speedup_vs_fbgemm']:.2f}×"
    return f"**{ratio}** FBGEMM's speed ({ours} vs {j['fbgemm_ms_per_step']:.1f})"


def _step_lowp(j: Json) -> str:
    lp = j["lowp"]
    parts = [f"fp32 {j['ms_per_step']:.1f} ms/step"]
    for m, label in (("auto", "auto"), ("bf16", "bf16"), ("autocast", "plain autocast")):
        if m in lp:
            parts.append(f"{label} {iv(lp[m]['speedup_vs_off'], '.2f', '×')}")
    r = j.get("auto_vs_autocast")
    if r is not None:  # paired by step; < 1 within its interval: auto is slower, and why
        why = ""
        if r["hi"] < 1:
            why = " (auto keeps the first and last Linears and sites under 10% faster in fp32: docs/lowp.md)"
        parts.append(f"auto vs plain autocast {iv(r, '.2f', '×')}{why}")
    return "; ".join(parts)


def _lowp_ne(j: Json) -> str:
    ref = j.get("reference")
    head = []
    if ref is not None:  # the reference's absolute NE and AUC: a change means something only if
        # it learned (NE < 1)
        learns = "" if ref["learns"] else " (**learned nothing**: no verdict)"
        head.append(f"fp32 NE {iv(ref['ne'], '.4f')}, AUC {iv(ref['auc'], '.4f')}{learns}")
    parts = []
    for m, label in (("auto", "auto"), ("bf16", "bf16"), ("autocast", "autocast")):
        if m in j["modes"]:
            r = j["modes"][m]
            sites = f"{r['low_precision_sites']} sites"
            if m == "auto" and "plan" in j:
                low = j["plan"]["low_precision"]
                sites = f"plan: {', '.join(low) or 'every site fp32'}"
            parts.append(f"{label} NE {pct(r['rel_vs_base'])} ({sites})")
    return f"{'; '.join([*head, *parts])}; seeds {_seeds(j['seeds'])}"


_LOWP_NE = ("lowp", "--modes", "off,auto,bf16,autocast", "--plan-seed", "0")


def _lowp_tables(j: Json) -> str:
    modes = j["modes"]
    base = "fp32" if "fp32" in modes else next(iter(modes))
    ref = j.get("reference")  # (a result stored before it had none)
    head = [f"fp32 NE {iv(ref['ne'], '.4f')}, AUC {iv(ref['auc'], '.4f')}"] if ref else []
    return "; ".join(
        head
        + [
            f"{m} {r['table_mb'] / modes[base]['table_mb']:.2f}× memory, NE {pct(r['rel_vs_base'])}"
            for m, r in modes.items()
            if m != base
        ]
    )


def _train(j: Json) -> str:
    gap = j.get("eval_ne_gap_vs_teacher")
    ne = f"eval NE {100 * gap:+.2f}% vs the teacher, " if gap is not None else ""
    return f"{ne}{j['train']['samples_per_s']:,.0f} samples/s"


def _dist(j: Json) -> str:
    cells = []
    for key, by in j["results"].items():
        best = min(by, key=lambda s: by[s]["ms_median"])
        cells.append(f"{key.split()[0]} {by[best]['ms_median']:.1f} ms ({best})")
    return "; ".join(cells)


def _dist_ratio(setting: str) -> Callable[[Json], str]:
    def render(j: Json) -> str:
        ref = "vs_" + j["baseline"].replace("/", "_")
        return "; ".join(
            f"{key.split()[0]} {iv(by[setting][ref], '.2f', '×')}"
            for key, by in j["results"].items()
            if setting in by
        )

    return render


def _planner_pred(j: Json) -> str:
    return "; ".join(
        f"{100 * s['gain_vs_best_baseline_mean']:.1f}% lower max-rank cost ({s['set']})"
        for s in j["sets"]
    )


def _cache(j: Json) -> str:
    return (
        f"**{100 * j['ssd_vs_dram']:.0f}%** of all-in-DRAM throughput ({j['ssd_ms_per_step']:.1f} "
        f"vs {j['dram_ms_per_step']:.1f} ms/step, hit rate {j['ssd_hit_rate']:.3f})"
    )


def _pct3(d: Json) -> str:
    """A relative interval object as signed percents, 3 decimals."""
    return iv(
        {**d, "value": 100 * d["value"], "lo": 100 * d["lo"], "hi": 100 * d["hi"]}, "+.3f", "%"
    )


def _ckpt(j: Json) -> str:
    d = j["settings"][j["default"]]
    text = (
        f"**{d['write_reduction']:.1f}×** fewer bytes written, {d['storage_reduction']:.1f}× "
        "less storage"
    )
    q = j.get("quality")
    if not q:  # a result stored before the quality half learned (one run, no interval)
        return f"{text}, NE {100 * d['ne_change']:+.4f}% after restore"
    one = q["settings"][j["default_quality"]]["ne_change_interval"]
    x4 = q["settings"].get(j["default_quality"].replace("/x1", "/x4"))
    more = f", {_pct3(x4['ne_change_interval'])} after 4" if x4 else ""
    seeds = f"{len(q['seeds'])} {'held-out ' if q['held_out'] else ''}seeds"
    return (
        f"{text}; NE {_pct3(one)} after one restore{more} ({seeds}; reference NE "
        f"{j['reference_ne']:.3f}, AUC {j['reference_auc']:.3f})"
    )


def _data(j: Json) -> str:
    text = (
        f"Criteo preprocessing {j['preprocess_mb_s_all_cores']:.1f} MB/s on {j['cores']} cores; "
        f"reader {j['reader_samples_s_per_core']:,} samples/s per core"
    )
    if "preprocess_parquet_rows_s" in j:
        text += (
            f"; Parquet / CSV preprocessing {j['preprocess_parquet_rows_s']:,} / "
            f"{j['preprocess_csv_rows_s']:,} rows/s, read directly {j['direct_parquet_rows_s']:,} / "
            f"{j['direct_csv_rows_s']:,} rows/s"
        )
    return text


def _dmt_bytes(j: Json) -> str:
    return (
        f"**{j['inter_host_reduction_towers_host']:.2f}×** fewer inter-host bytes, every byte "
        f"counted, tower sync inside the host; {j['inter_host_reduction_towers_world']:.2f}× with "
        f"world-wide tower sync; all-to-alls alone {j['a2a_inter_host_reduction_towers_host']:.2f}×"
    )


def _dmt_quality(j: Json) -> str:
    parts = []
    for teacher in ("ungrouped", "grouped"):
        k = f"rel_ne_learned_vs_flat_{teacher}"
        if k in j:
            ref = j.get(f"reference_{teacher}")
            flat = "" if ref is None else f" (flat: NE {ref['ne']:.3f}, AUC {ref['auc']:.3f})"
            parts.append(
                f"{teacher} teacher{flat}: learned vs flat {pct(j[k])}, vs random "
                f"{pct(j[f'rel_ne_learned_vs_random_{teacher}'])}"
            )
    return f"{'; '.join(parts)}; seeds {_seeds(j['seeds'])}"


def _ratio_pct(d: Json) -> str:
    """A ratio interval as a signed percent change (0.97 -> -3.00%)."""
    return pct({**d, "value": d["value"] - 1, "lo": d["lo"] - 1, "hi": d["hi"] - 1})


def _dynamic(stream: str) -> Callable[[Json], str]:
    def render(j: Json) -> str:
        cells = [
            f"{100 * b['budget_fraction']:g}% memory: vs hashed + filter "
            f"{_ratio_pct(b['ne_ratio_dynamic_vs_hashed_adm'])}, vs hashed "
            f"{_ratio_pct(b['ne_ratio_dynamic_vs_hashed'])}"
            for b in j["streams"][stream]["budgets"]
        ]
        st = j["streams"][stream]
        ref = (
            f"full table NE {st['ne_full']['value']:.3f}, AUC {st['auc_full']['value']:.3f}; "
            if "auc_full" in st
            else ""
        )
        return f"{ref}{'; '.join(cells)}; seeds {_seeds(j['seeds'])}"

    return render


def _planner_measured(j: Json) -> str:
    return (
        f"**{iv(j['paired_ratio_by_task'], '.3f')}** over {j['paired_ratio_by_task']['n']} tasks; "
        f"over task-rounds {iv(j['paired_ratio'], '.3f')}; seeds {_seeds(j['seeds'])}"
    )


_OP = ("--tables", "8", "--rows", "1000000", "--dim", "64", "--batch", "2048", "--pooling", "100")
_OP_QUICK = ("--tables", "4", "--rows", "200000", "--batch", "1024", "--pooling", "20")
_DIST = (
    "dist", "--nproc", "2", "--embedding-only", "--tables", "8", "--rows", "100000", "--dim", "64",
    "--batch", "4096", "--pooling", "10", "--alpha", "1.05",
    "--types", "table_wise,row_wise,data_parallel", "--transport", "shm,gloo",
    "--keep-heap", "on,off",
)  # fmt: skip

_TWRW = (
    "dist", "--nproc", "4", "--ranks-per-host", "2", "--embedding-only", "--types",
    "row_wise_host,table_row_wise,row_wise", "--tables", "4", "--dim", "32", "--batch", "1024",
    "--iters", "2", "--warmup", "1",
)  # fmt: skip


def _breakdown(j: Json) -> str:
    return (
        f"step {j['step_ms']:.0f} ms = {j['step_over_floor']:.2f}× the floors' sum "
        f"({j['floor_ms']:.0f} ms); phases add to {j['phase_sum_over_step']:.3f}× the step; "
        f"furthest from its floor: {j['furthest']}"
    )


def _vs_torchrec(j: Json) -> str:
    rounds = f"; {j['rounds']} rounds, {j['params']:,} parameters each" if "rounds" in j else ""
    return (
        f"{j['ms_per_step']:.0f} vs {j['torchrec_ms_per_step']:.0f} ms/step: "
        f"{iv(j['vs_torchrec'], '.2f', '×')} of TorchRec's step{rounds}"
    )


ENTRIES: tuple[Entry, ...] = (
    Entry(
        "op_uniform", "fused TBE vs FBGEMM's CPU TBE, 8 × 1M × 64, batch 2048, pooling 100, uniform",
        "3× FBGEMM", ("op", *_OP, "--alpha", "0", "--repeats", "5"),
        ("op", *_OP_QUICK, "--alpha", "0", "--repeats", "2"), _op,
    ),
    Entry(
        "op_zipf", "the same, Zipf 1.05 ids", "3× FBGEMM",
        ("op", *_OP, "--alpha", "1.05", "--repeats", "5"),
        ("op", *_OP_QUICK, "--alpha", "1.05", "--repeats", "2"), _op,
    ),
    Entry(
        "op_adam", "fused TBE with Adam, 4 × 200k × 64, pooling 20, Zipf 1.05", "—",
        ("op", "--tables", "4", "--rows", "200000", "--batch", "2048", "--pooling", "20",
         "--alpha", "1.05", "--optimizer", "adam", "--compare", "none", "--repeats", "3"),
        ("op", *_OP_QUICK, "--optimizer", "adam", "--compare", "none", "--repeats", "1"), _op,
    ),
    Entry(
        "step_lowp", "full DLRM step and LoKA speed, `dlrm_benchmark.toml`, vs fp32 paired by step",
        "2.5× on AMX", ("step", "--lowp", "off,auto,bf16,autocast", "--iters", "30"),
        ("step", "--lowp", "off,auto,autocast", "--iters", "5", "--rows", "100000"), _step_lowp,
    ),
    Entry(
        "lowp_ne", "LoKA NE vs fp32, default config (300k samples), paired by seed", "within 0.1%",
        (*_LOWP_NE, "--set", "data.train_samples=300000", "--seeds", "5", "--seed-base", "10",
         "--save-plan", "/tmp/neorec-lowp-plan-default.json"),
        ("lowp", "--modes", "off,auto", "--seeds", "2", "--seed-base", "10",
         "--set", "train.steps=50"), _lowp_ne,
    ),
    Entry(
        "lowp_ne_dcn", "LoKA NE vs fp32, DCNv2 (`dcn_small.toml`, 300k samples), paired by seed",
        "within 0.1%",
        (*_LOWP_NE, "--config", "configs/dcn_small.toml", "--set", "data.train_samples=300000",
         "--seeds", "4", "--seed-base", "10", "--save-plan", "/tmp/neorec-lowp-plan-dcn.json"),
        ("lowp", "--config", "configs/dcn_small.toml", "--modes", "off,auto", "--seeds", "2",
         "--seed-base", "10", "--set", "train.steps=50"), _lowp_ne,
    ),
    Entry(
        "lowp_ne_movielens", "LoKA NE vs fp32, MovieLens-100K recipe, paired by seed",
        "within 0.1%",
        (*_LOWP_NE, "--movielens", "--seeds", "5", "--seed-base", "100", "--save-plan",
         "/tmp/neorec-lowp-plan-movielens.json"),
        ("lowp", "--movielens", "--modes", "off,auto", "--seeds", "2", "--seed-base", "100"),
        _lowp_ne,
    ),
    Entry(
        "lowp_tables", "low-precision tables, default config: memory and NE vs fp32", "—",
        ("lowp", "--emb", "fp32,fp16,bf16,fp8", "--seeds", "5", "--seed-base", "10"),
        ("lowp", "--emb", "fp32,fp8", "--seeds", "2", "--seed-base", "10",
         "--set", "train.steps=50"), _lowp_tables,
    ),
    Entry(
        "quant_lookup", "serving tables' fused lookup, speed-up over fp32 rows on the same ids: "
        "default tables (8 × 10k × 16) and 4 × 1M × 64, uniform and Zipf 1.05, paired by round",
        "int4 faster than fp32", ("qlookup", "--rounds", "10", "--iters", "50"),
        ("qlookup", "--shapes", "8x10000x16,1x200000x64", "--rounds", "2", "--iters", "5"),
        _render.quant_lookup,
    ),
    Entry(
        "train_default", "default training (`make run`)", "≤ 2% NE gap", (), ("--set", "train.steps=100"),
        _train, kind="train",
    ),
    Entry(
        "threads", "the Parquet example beside two busy loops: default intra-op threads, paired by "
        "round", "≤ 1.5× the quiet time",
        ("threads", "--rounds", "5", "--train-rows", "100000", "--eval-rows", "10000"),
        ("threads", "--rounds", "1", "--train-rows", "2000", "--eval-rows", "500"), _threads,
    ),
    Entry(
        "dist_step", "sharded embedding step, 2 ranks, 8 × 100k × 64, batch 4096, fastest setting",
        "—", (*_DIST, "--rounds", "5", "--iters", "20"),
        (*_DIST, "--rounds", "2", "--iters", "5"), _dist,
    ),
    Entry(
        "dist_vs_gloo", "shared memory + kept heap vs gloo with the heap given back", "—",
        (), (), _dist_ratio("shm/on"), source="dist_step",
    ),
    Entry(
        "dist_heap", "of which the kept heap alone (gloo both sides)", "—",
        (), (), _dist_ratio("gloo/on"), source="dist_step",
    ),
    Entry(
        "twrw", "table-row-wise's in-host reduction: inter-host bytes vs row-wise in the same host "
        "layout, 4 ranks as 2 hosts × 2", "ranks per host (2×)", (*_TWRW, "--rows", "20000"),
        (*_TWRW, "--rows", "5000"), _render.twrw,
    ),
    Entry(
        "planner_pred", "planner vs the best greedy plan, predicted", "15% lower",
        ("planner",), ("planner", "--tasks", "4"), _planner_pred,
    ),
    Entry(
        "dmt", "DMT towers vs flat sharding, 4 ranks as 2 hosts × 2, inter-host bytes per step",
        "—", ("dmt", "--nproc", "4", "--ranks-per-host", "2", "--steps", "30", "--seeds", "5",
              "--seed-base", "100"),
        ("dmt", "--nproc", "4", "--ranks-per-host", "2", "--tables", "8", "--rows", "5000",
         "--batch", "512", "--steps", "8", "--warmup", "1", "--seeds", "2", "--quality-steps",
         "200", "--teachers", "grouped"), _dmt_bytes,
    ),
    Entry(
        "dmt_quality", "DMT eval NE, learned partition, paired by seed", "better than flat",
        (), (), _dmt_quality, source="dmt",
    ),
    Entry(
        "costcheck", "learned vs analytical cost model against measured steps, each anchored "
        "to the round's speed and not, held out: plans and batch the calibration never saw, "
        "4 ranks", "10% / 20%",
        ("costcheck", "--topology", "bench-topology.json", "--cost-model", "learned",
         "--world-size", "4", "--batch", "3072", "--random-batch", "3072", "--random-plans", "6",
         "--random-seed", "7777", "--repeats", "3", "--passes", "5", "--iters", "50"),
        ("costcheck", "--topology", "bench-topology.json", "--cost-model", "learned",
         "--world-size", "4", "--batch", "3072", "--random-batch", "3072", "--random-plans", "3",
         "--random-seed", "7777", "--plans", "table_wise,planner", "--repeats", "2",
         "--passes", "4", "--iters", "40"), _render.costcheck,
    ),
    Entry(
        "planner_measured", "planner's plan / best greedy plan, measured, fresh seeds",
        "< 1 beyond noise",
        ("planner", "--measure", "--measure-tasks", "2", "--repeats", "4", "--measure-batch",
         "4096", "--seed-base", "100", "--seeds", "3", "--topology", "bench-topology.json"),
        ("planner", "--measure", "--measure-tasks", "1", "--repeats", "2", "--measure-batch",
         "2048", "--seed-base", "100", "--seeds", "2", "--topology", "bench-topology.json"),
        _planner_measured,
    ),
    Entry(
        "cache", "row cache over SSD, full DLRM step", "≥ 50% of DRAM",
        ("cache", "--skip-hit", "--model", "dlrm"),
        ("cache", "--skip-hit", "--model", "dlrm", "--iters", "20"), _cache,
    ),
    Entry(
        "serve", "`neorec serve`, default model, fp32 tables, 1 row per request: highest rate "
        "at p99 ≤ 20 ms, batching on vs off", "≥ 4×",
        ("serve", "--configs", "default", "--rows-per-request", "1", "--closed", "1,8"),
        ("serve", "--quick"),
        _render.serve,
    ),
    Entry(
        "ckpt", "Check-N-Run checkpoints, 16 tables", "6× fewer bytes, NE within 0.05%",
        ("ckpt", "--tables", "16", "--scale", "256"),
        ("ckpt", "--tables", "4", "--scale", "64", "--seeds", "100-102", "--quality-steps", "100",
         "--quality-interval", "25", "--quality", "8/opt32/x1,8/opt32/x4"),
        _ckpt,
    ),
    Entry(
        "distill", "ExFM student (aux + adapter) vs the student alone, same kernel, each lr tuned",
        "better NE", ("distill", "--windows", "5", "--seeds", "5", "--seed-base", "100",
                      "--dev-seeds", "2", "--lrs", "0.001,0.003,0.01", "--biases", "0,0.3",
                      "--staleness", "1,2", "--rounds", "10", "--steps", "16"),
        ("distill", "--windows", "3", "--dev-seeds", "1", "--seeds", "3", "--seed-base", "100",
         "--staleness", "1", "--lrs", "0.003,0.01", "--rounds", "5",
         "--set", "data.window_samples=8192", "--fm-set", "data.window_samples=32768"), _render.distill,
    ),
    Entry(
        "distill_gap", "ExFM `gap_closed` (aux + adapter) vs the fresh FM, the fresh FM recalibrated, the stale FM",
        "≥ 0.3", (), (), _render.distill_gap, source="distill",
    ),
    Entry(
        "distill_speed", "ExFM throughput vs the student alone, interleaved rounds", "≥ 0.9×",
        (), (), _render.distill_speed, source="distill",
    ),
    Entry(
        "dynamic", "dynamic vs hashed tables, equal memory, NE, the stream where exact ids matter",
        "better NE than hashed + the same admission filter", ("dynamic",),
        ("dynamic", "--windows", "1", "--window-samples", "51200", "--budgets", "0.25",
         "--thresholds", "16", "--rounds", "5", "--speed-steps", "50"), _dynamic("tuned"),
    ),
    Entry(
        "dynamic_default", "the same on the default stream", "—", (), (), _dynamic("default"),
        source="dynamic",
    ),
    Entry(
        "dynamic_speed", "dynamic table's speed vs a plain table, interleaved rounds", "≥ 0.7×",
        (), (), _render.dynamic_speed, source="dynamic",
    ),
    Entry(
        "data", "Criteo and Parquet / CSV preprocessing and readers", "—", ("data",), ("data", "--lines", "20000"), _data,
    ),
    Entry(
        "movielens", "MovieLens-100K (real ratings, click = rating ≥ 4, time split): eval AUC",
        "above the LR baseline", ("movielens",), ("movielens", "--quick"), _render.movielens,
    ),
    Entry(
        "sequential", "SASRec on MovieLens-100K sequences: next item ranked against the full corpus "
        "(leave-one-out test; settings chosen on valid + dev seeds)", "≥ published SASRec",
        ("sequential", "--model", "sasrec", "--seeds", "5", "--seed-base", "100"),
        ("sequential", "--model", "sasrec", "--quick", "--seeds", "2"), _render.sequential,
    ),
    Entry(
        "largebatch", "large batch: default model at B = 512, 8·B and 32·B (CowClip), the same samples",
        "within 0.1% NE", ("largebatch",), ("largebatch", "--quick"), _render.largebatch,
    ),
    Entry(
        "seqlookup", "sequence lookup fwd + bwd + update, 2 × 1M × 64, 1,024 sequences (Zipf lengths, "
        "mean 50, max 200), row-wise Adagrad: vs `nn.Embedding(sparse=True)` + Adagrad, vs FBGEMM's "
        "TBE on bags of length 1, paired rounds", "≥ 3× torch, > 1× FBGEMM",
        ("seqlookup", "--rounds", "10"),
        ("seqlookup", "--rows", "100000", "--batch", "256", "--rounds", "2", "--steps", "2"),
        _render.seqlookup,
    ),
    Entry(
        "quant", "quantized tables: default model's eval NE at fp16 / int8 / int4 / int2 (the "
        "export's codec), PTQ vs QAT, paired by seed", "int8 ≤ +0.02%, int4 with QAT ≤ +0.1% NE",
        ("quant",), ("quant", "--seeds", "10,11", "--widths", "int8,int4", "--set",
                     "train.steps=100"), quant_row,
    ),
    Entry(
        "step_breakdown", "the whole step against this machine's floors, `dlrm_benchmark.toml`, fp32",
        "≤ 1.5× the floors",
        ("step", "--config", "configs/dlrm_benchmark.toml", "--breakdown", "--iters", "10"),
        ("step", "--config", "configs/dlrm_benchmark.toml", "--breakdown", "--iters", "3",
         "--rows", "100000"), _breakdown,
    ),
    Entry(
        "step_torchrec", "the same step vs TorchRec's (FBGEMM CPU TBE), rounds in fresh processes, "
        "order rotated, paired by round",
        "≤ 0.25×",
        ("step", "--config", "configs/dlrm_benchmark.toml", "--compare", "torchrec", "--iters", "10"),
        ("step", "--config", "configs/dlrm_benchmark.toml", "--compare", "torchrec", "--iters", "3",
         "--rows", "100000", "--rounds", "2"), _vs_torchrec,
    ),
    Entry(
        "step_breakdown_lowp", "the same step with `lowp.mode = auto`, floors at the chosen precisions",
        "≤ 1.5× the floors",
        ("step", "--config", "configs/dlrm_benchmark.toml", "--breakdown", "--set",
         "lowp.mode=auto", "--iters", "10"),
        ("step", "--config", "configs/dlrm_benchmark.toml", "--breakdown", "--set",
         "lowp.mode=auto", "--iters", "3", "--rows", "100000"), _breakdown,
    ),
    Entry(
        "step_torchrec_lowp", "`lowp.mode = auto` vs TorchRec under bf16 autocast, paired by round",
        "—",
        ("step", "--config", "configs/dlrm_benchmark.toml", "--compare", "torchrec", "--set",
         "lowp.mode=auto", "--warmup", "5", "--iters", "30"),
        ("step", "--config", "configs/dlrm_benchmark.toml", "--compare", "torchrec", "--set",
         "lowp.mode=auto", "--iters", "3", "--rows", "100000", "--rounds", "2"), _vs_torchrec,
    ),
    Entry(
        "step_breakdown_dist", "the same step on 2 ranks (1 thread each), its collectives at the "
        "copy floor; the slowest rank's phases", "—",
        ("step", "--config", "configs/dlrm_benchmark.toml", "--breakdown", "--nproc", "2",
         "--iters", "30"),
        ("step", "--config", "configs/dlrm_benchmark.toml", "--breakdown", "--nproc", "2",
         "--iters", "3", "--rows", "100000"), _breakdown,
    ),
    Entry(
        "step_breakdown_dcn", "DCNv2 step against the floors, `dcn_benchmark.toml` (DLRMv2's dense "
        "part and bag sizes, 26 × 100k × 128), fp32", "≤ 1.5× the floors",
        ("step", "--config", "configs/dcn_benchmark.toml", "--breakdown", "--iters", "6"),
        ("step", "--config", "configs/dcn_benchmark.toml", "--breakdown", "--iters", "2",
         "--batch", "256"), _breakdown,
    ),
    Entry(
        "step_torchrec_dcn", "the same DCNv2 step vs TorchRec's `DLRM_DCN`, paired by round",
        "≤ 0.25×",
        ("step", "--config", "configs/dcn_benchmark.toml", "--compare", "torchrec", "--iters", "8"),
        ("step", "--config", "configs/dcn_benchmark.toml", "--compare", "torchrec", "--iters", "2",
         "--batch", "256", "--rounds", "2"), _vs_torchrec,
    ),
)  # fmt: skip


def _loaded(rec: Json) -> str:
    """`` *(loaded)*`` when other jobs kept the cores busy as the entry started: the 1-minute load
    average above the cores plus a half (a benchmark that just ended adds at most the cores)."""
    load, cores = rec.get("load"), rec.get("cores")
    return " *(loaded)*" if load is not None and cores and load > cores + 0.5 else ""


def _row(e: Entry, rec: Json | None) -> str:
    if rec is None:
        return f"| {e.what} | not measured yet | {e.target} | — | `--only {e.key}` |"
    return (
        f"| {e.what} | {e.render(rec['result'])} | {e.target} | {rec['cpu']}, {rec['date']}"
        f"{_loaded(rec)} | "
        f"`--only {e.key}` |"
    )


def render_table(full: Mapping[str, Json]) -> str:
    """The README's results table (and the full commands under it) from the stored results."""
    lines = [
        "| what | result (95% interval) | target | measured on | `neorec bench report` |",
        "|---|---|---|---|---|",
        *(_row(e, full.get(e.key)) for e in ENTRIES),
        "",
        "<details><summary>The commands behind each row</summary>",
        "",
        *(
            f"- `{e.name}`: `{e.command()}`"
            + (
                f" ({full[e.name]['seconds'] / 60:.1f} min)"
                if full.get(e.name, {}).get("seconds")
                else ""
            )
            for e in ENTRIES
            if not e.source
        ),
        "",
        "</details>",
        "",
    ]
    return "\n".join(lines)
