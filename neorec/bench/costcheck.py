"""``neorec bench costcheck``: the planner's cost model against measured embedding steps.

For a few plans (one per sharding type, a mixed plan, and the planner's own plan) of the
``bench dist`` table set, on ``--nproc`` gloo ranks of this machine: the cost model's predicted
embedding step time (``PlanCost.max_time_s`` on a calibrated topology, ids Zipf(``--alpha``) as
``bench dist`` draws them) next to the measured one (``bench dist --embedding-only``: sharded EBC
forward + backward with the update, median over steps, max over ranks). Prints a table and a JSON
line with the mean and max absolute error.

Next to the fixed plans, ``--random-plans N`` random placements of random table mixes (seed
``--random-seed``; calibration uses other seeds, so these mixes and shard geometries are held
out) are measured the same way; ``mean_abs_error`` / ``max_abs_error`` cover both sets (the JSON
also splits them). With a topology that carries a learned cost model fitted on this machine
(``neorec plan --calibrate``), predictions are the learned model's (``--cost-model``), and the
analytical model's errors on the same measurements are reported next to them (its baseline).

The topology comes from ``--topology FILE`` or is calibrated here (``neorec.measure.calibrate``)
once per round, just before the round measures every plan: on a shared host the load from other
processes changes by tens of percent within minutes, so constants and steps are taken under the
same load. ``--repeats`` rounds; predictions and measurements are medians over rounds (with the
measured range), so drifting load hits all plans alike.

A round builds every plan once and measures them in ``--passes`` interleaved passes of
``--iters / --passes`` steps each (``run_jobs``' blocks; a plan's figure is the median of its
passes): on this kind of 2-core VM one 10-step window of the same plan varies by +-20%, so a plan
is measured across the round's time, not in one window. The round also measures the speed
references (``learned_placements.reference_jobs``, fixed small placements, not the checked plans);
a learned model fitted with them predicts at its calibration's speed and is multiplied by the
speed the round's references show (``anchored``). The errors are reported both ways, for the
learned and the analytical model: anchored (x the round's speed) and unanchored (the raw
prediction against the raw measured ms), with the mean's 95% interval over the plans; and, for
each anchoring, the paired difference learned - analytical of each plan's |error| with its 95%
interval and which model it shows winning (``learned_minus_analytical``: below 0 learned, above
0 analytical, containing 0 neither).

A check on plans the calibration never saw: ``--world-size 4`` (calibrations fit 2 ranks),
``--random-batch B`` (every random plan at global batch B; calibration draws 512, 1024, 2048 and
4096) and a ``--random-seed`` no calibration used (``designed_jobs`` draws with the calibration's
``--seed``, default 0); a model fitted on 2 ranks needs ``--cost-model learned`` there (``auto``
keeps it to its world size).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from neorec.bench import dist as bench_dist
from neorec.bench.costcheck_errors import error_summary, paired_errors, print_errors
from neorec.machine import cpu_model_and_flags
from neorec.measure import jobs as measure_jobs
from neorec.measure.calibrate import calibrate
from neorec.sharding.cost_model import CostModel, tables_from_config
from neorec.sharding.learned_cost import (
    COST_MODEL_MODES,
    LearnedCostModel,
    LearnedModelError,
    model_summary,
    resolve,
)
from neorec.sharding.learned_fit import predict_job
from neorec.sharding.learned_placements import plan_job, random_jobs, reference_jobs, speed_of
from neorec.sharding.planner import plan_tables
from neorec.sharding.topology import Topology
from neorec.sharding.types import ShardingPlan

__all__ = ["main", "TARGET_ERROR", "error_summary", "paired_errors"]

PLANS = [
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "data_parallel",
    "mixed",
    "planner",
]
TARGET_ERROR = 0.25
"""Earlier issue target: predicted within 25% of measured."""
TARGET_MEAN_ERROR = 0.10
TARGET_MAX_ERROR = 0.20
"""Issue 23 targets: mean |error| <= 10%, max <= 20% (fixed and random plans, --repeats 3)."""


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Own flags; the rest (``--tables``, ``--rows``, ``--batch``, ...) go to ``bench dist``."""
    p = argparse.ArgumentParser(prog="neorec bench costcheck", description=__doc__)
    p.add_argument("--plans", default=",".join(PLANS), help="comma-separated: " + ",".join(PLANS))
    p.add_argument("--topology", default="", help="topology JSON (default: calibrate now)")
    p.add_argument("--save-topology", default="", help="write the calibrated topology here")
    p.add_argument("--json-out", default="", help="also write the JSON line here")
    p.add_argument(
        "--random-plans",
        type=int,
        default=10,
        help="also measure N random placements of random table mixes (held out: other mixes and "
        "shard geometries than a calibration fits, seed --random-seed)",
    )
    p.add_argument("--random-seed", type=int, default=1000, help="seed of the random plans")
    p.add_argument(
        "--random-batch",
        type=int,
        default=0,
        help="global batch of every random plan (0: drawn per mix, 512-2048, as calibration "
        "draws; another, e.g. 3072, is a batch no calibration measured)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=0,
        help="ranks (bench dist's --nproc; 0: its default). Calibrations fit 2 ranks, so 4 is "
        "held out (with --cost-model learned)",
    )
    p.add_argument(
        "--cost-model",
        choices=COST_MODEL_MODES,
        default="auto",
        help="predict with the topology's learned model (auto: when fitted on this machine), "
        "or the analytical one",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds: each calibrates (unless --topology) and then measures every plan, so the "
        "constants and the steps see the same load from other processes, and load drifting "
        "over time hits all plans alike; predictions and measurements are medians over rounds",
    )
    p.add_argument(
        "--passes",
        type=int,
        default=15,
        help="interleaved passes per round: each plan's --iters steps are measured in this many "
        "windows spread over the round (as the calibration measures), not one",
    )
    return p.parse_known_args(argv)


def _topology(args: argparse.Namespace, world: int, rph: int, optimizer: str) -> Topology:
    if args.topology:
        return Topology.load(args.topology).with_world(world, rph)
    topo, _ = calibrate(world, rph, optimizer=optimizer)
    if args.save_topology:
        topo.save(args.save_topology)
    return topo


def predictions(
    cfg,
    plans: list[tuple[str, ShardingPlan]],
    topo: Topology,
    batch: int,
    alpha: float = 0.0,
    model: LearnedCostModel | None = None,
    speed: float = 1.0,
) -> dict[str, dict[str, float]]:
    """Predicted embedding step (ms) of each plan, with its phase split (ids Zipf(``alpha``),
    as ``bench dist`` draws them; 0 = uniform): the learned ``model``'s step when given, at the
    machine's ``speed`` (the phases stay analytical), else the analytical one."""
    specs = tables_from_config(cfg.embedding.tables, zipf_alpha=alpha)
    cm = CostModel(topo, batch, cfg.embedding.optimizer)
    out = {}
    for label, plan in plans:
        c = cm.evaluate(plan, specs)
        fwd_comm, fwd, bwd_comm, bwd = (1000 * x for x in c.phase_max())
        step = 1000 * c.max_time_s
        unanchored = model.predict_ms(cm, plan, specs)["step"] if model else step
        out[label] = {
            "predicted_ms": unanchored * speed,
            "unanchored_ms": unanchored,
            "analytical_ms": step,
            "analytical_anchored_ms": step * speed,
            "fwd_comm_ms": fwd_comm,
            "fwd_compute_ms": fwd,
            "bwd_comm_ms": bwd_comm,
            "bwd_compute_ms": bwd,
            "sample_side_ms": 1000 * c.sample_side_s,
        }
    return out


def summarize(
    rows: list[dict[str, Any]], plans: list[tuple[str, ShardingPlan]]
) -> dict[str, dict[str, float]]:
    """Per plan: the median over rounds of each round's measured figures (and the rounds' range)."""
    out = {}
    for label, _ in plans:
        mine = [r for r in rows if r["type"] == label]
        steps = [r["ms_per_step"] for r in mine]
        out[label] = {
            k: round(statistics.median(r[k] for r in mine), 2)
            for k in ("ms_per_step", "fwd_ms", "bwd_ms", "comm_wait_ms")
        }
        # rounded as the median is (rounding is monotone, so min <= median <= max still holds)
        out[label].update(min_ms=round(min(steps), 2), max_ms=round(max(steps), 2))
    return out


def main(argv: list[str] | None = None) -> int:
    """Calibrate (or load), predict, measure; print the table and a JSON line."""
    args, rest = parse(argv)
    # More steps than bench dist's default: single steps vary by 10-20% on a shared CPU host.
    # 15 interleaved passes of 10 steps per round: with 5, a plan's round still moved by ~10%
    # (one 10-step window varies by +-20% here) and the max error over 17 plans with it.
    if args.world_size:
        rest = [*rest, "--nproc", str(args.world_size)]
    a = bench_dist.parse(["--iters", "150", "--warmup", "3", *rest, "--embedding-only"])
    world = a.nproc
    rph = a.ranks_per_host or world
    _validate(args, a)
    cfg = bench_dist._config(a)
    topo = _topology(args, world, rph, cfg.embedding.optimizer)
    try:
        scoring = resolve(topo, args.cost_model, args.topology or "calibrated topology")
    except LearnedModelError as e:
        raise SystemExit(f"neorec: error: {e}") from None
    for w in scoring.warnings:
        print(w, file=sys.stderr)
    model = scoring.model
    jobs = random_jobs(args.random_plans, world, rph, args.random_seed, per_mix=1)
    if args.random_batch:
        jobs = [{**j, "batch": args.random_batch} for j in jobs]
    plans: list[tuple[str, ShardingPlan]] = []
    for label in [x for x in args.plans.split(",") if x]:
        if label == "planner":
            specs = tables_from_config(cfg.embedding.tables, zipf_alpha=a.alpha)
            plan = plan_tables(
                specs, topo, a.batch, cfg.embedding.optimizer, cost_model=args.cost_model
            ).plan
        elif label in PLANS:
            plan = bench_dist._plan(cfg, label, world, rph)
        else:
            raise SystemExit(f"unknown plan '{label}'; known: {PLANS}")
        plans.append((label, plan))
    rounds = max(1, args.repeats)
    passes = max(1, args.passes)
    fixed_jobs = [_plan_job(cfg, a, label, plan) for label, plan in plans]
    refs = reference_jobs(world, rph)
    anchor = model.reference.get("ms", {}) if model is not None else {}
    topos: list[Topology] = []
    preds: list[dict[str, dict[str, float]]] = []
    measured_rows: list[dict[str, Any]] = []
    random_rows: list[dict[str, Any]] = []
    random_preds: list[list[dict[str, float]]] = []
    random_ana: list[list[dict[str, float]]] = []
    random_unanch: list[list[dict[str, float]]] = []
    random_ana_anch: list[list[dict[str, float]]] = []
    speeds: list[float] = []
    for rnd in range(rounds):
        if rnd and not args.topology:
            topo, _ = calibrate(world, rph, optimizer=cfg.embedding.optimizer)
        topos.append(topo)
        # One round: every plan, random plan and speed reference built once and measured in
        # --passes interleaved passes of --iters / --passes steps (each spread over the round).
        block = [*fixed_jobs, *jobs, *refs]
        per = measure_jobs.run_passes(block, world, passes, a.iters // passes, a.warmup, rnd)
        ref_now = {j["reference"]: per[len(fixed_jobs) + len(jobs) + n]["ms_per_step"]
                   for n, j in enumerate(refs)}  # fmt: skip
        speed = speed_of(ref_now, anchor) if anchor else 1.0
        speeds.append(speed)
        preds.append(predictions(cfg, plans, topo, a.batch, a.alpha, model, speed))
        measured_rows.extend({**per[n], "type": label} for n, (label, _) in enumerate(plans))
        if jobs:
            unanchored = [predict_job(topo, j, model) for j in jobs]  # analytical when no model
            random_unanch.append(unanchored)
            random_preds.append([{k: v * speed for k, v in p.items()} for p in unanchored])
            ana = [predict_job(topo, j, None) for j in jobs]
            random_ana.append(ana)
            random_ana_anch.append([{k: v * speed for k, v in p.items()} for p in ana])
            random_rows.extend({**per[len(fixed_jobs) + n], "job": n} for n in range(len(jobs)))
    pred = {
        label: {k: statistics.median(p[label][k] for p in preds) for k in preds[0][label]}
        for label, _ in plans
    }
    measured = summarize(measured_rows, plans)
    rows: list[dict[str, Any]] = []
    for label, _ in plans:
        m = measured[label]
        p = pred[label]
        err = (p["predicted_ms"] - m["ms_per_step"]) / m["ms_per_step"]
        rows.append(
            {
                "plan": label,
                **{k: round(v, 3) for k, v in p.items()},
                "measured_ms": m["ms_per_step"],
                "measured_fwd_ms": m["fwd_ms"],
                "measured_bwd_ms": m["bwd_ms"],
                "comm_wait_ms": m["comm_wait_ms"],
                "measured_min_ms": m["min_ms"],
                "measured_max_ms": m["max_ms"],
                "error": round(err, 4),
            }
        )
    rand = _random_results(
        jobs, random_rows, random_preds, random_ana, random_unanch, random_ana_anch
    )
    fixed_errs = [abs(r["error"]) for r in rows]
    rand_errs = [abs(r["error"]) for r in rand]
    errs = fixed_errs + rand_errs
    mean_err, max_err = sum(errs) / len(errs), max(errs)
    errors = error_summary(rows, rand, bool(anchor))
    paired = paired_errors(rows, rand, bool(anchor))
    # The analytical model's errors on the same measurements (the baseline of a learned model),
    # and the learned model at the calibration's speed (not anchored to this run's references).
    ana_mean, ana_max = (errors["analytical"]["unanchored"]["all"][k] for k in ("mean", "max"))
    un_mean, un_max = (errors["learned"]["unanchored"]["all"][k] for k in ("mean", "max"))
    print(
        f"bench costcheck: {world} gloo ranks, {a.tables} tables x {a.rows:,} rows x dim {a.dim}, "
        f"global batch {a.batch}, pooling {a.pooling}, zipf {a.alpha}, {cfg.embedding.optimizer}"
    )
    print(f"topology: {topos[0].name}")
    if len(topos) > 1 and not args.topology:
        keys = (
            "device_bw_gbs",
            "unfused_bw_gbs",
            "dp_update_bw_gbs",
            "row_split_bw_gbs",
            "intra_host_bw_gbs",
        )
        spread = ", ".join(
            f"{k} {min(getattr(t, k) for t in topos):.3g}-{max(getattr(t, k) for t in topos):.3g}"
            for k in keys
        )
        print(f"calibrated {len(topos)} times (once per round): {spread}")
    print(
        f"{'plan':<16}{'pred ms':>9}{'meas ms':>9}{'error':>8}{'meas range':>14}"
        f"{'pred fwd':>10}{'meas fwd':>10}{'pred bwd':>10}{'meas bwd':>10}"
    )
    for r in rows:
        pf = r["fwd_comm_ms"] + r["fwd_compute_ms"]
        pb = r["bwd_comm_ms"] + r["bwd_compute_ms"]
        print(
            f"{r['plan']:<16}{r['predicted_ms']:>9.1f}{r['measured_ms']:>9.1f}"
            f"{100 * r['error']:>7.1f}%"
            f"{r['measured_min_ms']:>7.1f}-{r['measured_max_ms']:<6.1f}"
            f"{pf:>10.1f}{r['measured_fwd_ms']:>10.1f}"
            f"{pb:>10.1f}{r['measured_bwd_ms']:>10.1f}"
        )
    for r in rand:
        print(
            f"{r['plan']:<16}{r['predicted_ms']:>9.1f}{r['measured_ms']:>9.1f}"
            f"{100 * r['error']:>7.1f}%  {r['tables']} tables, {r['types']}"
        )
    print(f"cost model: {scoring.note}")
    for label, errs_of in (("fixed plans", fixed_errs), ("random plans", rand_errs)):
        if errs_of:
            mean_of = sum(errs_of) / len(errs_of)
            print(f"{label}: mean |error| {100 * mean_of:.1f}%, max {100 * max(errs_of):.1f}%")
    if model is not None:
        print(
            f"the analytical model on the same measurements: mean |error| {100 * ana_mean:.1f}%, "
            f"max {100 * ana_max:.1f}%"
        )
    if anchor:
        print(
            "predictions anchored to the speed references measured in each round: speed "
            + ", ".join(f"{x:.3f}" for x in speeds)
            + f" x the calibration's; not anchored (x 1): mean |error| {100 * un_mean:.1f}%, "
            f"max {100 * un_max:.1f}%"
        )
    print_errors(errors)
    for how, sets in paired.items():
        cells = "; ".join(
            f"{name} {100 * d['value']:+.1f}"
            + ("" if d["lo"] is None else f" [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]")
            + f" ({d['winner']} wins)"
            for name, d in sets.items()
        )
        print(f"learned - analytical |error|, {how}, points paired by plan: {cells}")
    print(
        f"mean |error| {100 * mean_err:.1f}%, max {100 * max_err:.1f}% over all "
        f"(targets: mean {100 * TARGET_MEAN_ERROR:.0f}%, max {100 * TARGET_MAX_ERROR:.0f}%; "
        "pred fwd/bwd exclude the sample-side term)"
    )
    result = {
        "bench": "costcheck",
        "nproc": world,
        "tables": a.tables,
        "rows": a.rows,
        "dim": a.dim,
        "batch": a.batch,
        "pooling": a.pooling,
        "alpha": a.alpha,
        "optimizer": cfg.embedding.optimizer,
        "repeats": max(1, args.repeats),
        "iters": a.iters,
        "topology": {**topos[0].to_dict(), "learned_cost": model_summary(topos[0].learned_cost)},
        "topologies": [t.to_dict() for t in topos[1:]],
        "mean_abs_error": round(mean_err, 4),
        "max_abs_error": round(max_err, 4),
        "analytical_mean_abs_error": round(ana_mean, 4),
        "analytical_max_abs_error": round(ana_max, 4),
        "anchored": bool(anchor),
        "speeds": [round(x, 4) for x in speeds],
        "unanchored_mean_abs_error": round(un_mean, 4),
        "unanchored_max_abs_error": round(un_max, 4),
        "passes": passes,
        **(
            {
                "fixed_mean_abs_error": round(sum(fixed_errs) / len(fixed_errs), 4),
                "fixed_max_abs_error": round(max(fixed_errs), 4),
            }
            if fixed_errs
            else {}
        ),
        **(
            {
                "random_mean_abs_error": round(sum(rand_errs) / len(rand_errs), 4),
                "random_max_abs_error": round(max(rand_errs), 4),
            }
            if rand_errs
            else {}
        ),
        "target": TARGET_ERROR,
        "target_mean": TARGET_MEAN_ERROR,
        "target_max": TARGET_MAX_ERROR,
        "cost_model": scoring.to_dict(),
        "errors": errors,
        "learned_minus_analytical": paired,
        "world_size": world,
        "random_seed": args.random_seed,
        "seeds": [args.random_seed],
        "random_batch": args.random_batch or None,
        "cpu": cpu_model_and_flags()[0],
        "results": rows,
        "random_results": rand,
    }
    line = json.dumps(result)
    print(line)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    return 0


def _validate(args: argparse.Namespace, a: argparse.Namespace) -> None:
    """Bad flags, one line each, before any calibration or measurement."""
    if args.random_plans < 0:
        raise SystemExit(f"neorec: error: --random-plans must be >= 0, got {args.random_plans}")
    if a.nproc < 2:
        raise SystemExit(f"neorec: error: --world-size must be >= 2, got {a.nproc}")
    if args.random_batch < 0 or (args.random_batch and args.random_batch % a.nproc):
        raise SystemExit(
            f"neorec: error: --random-batch must be a positive multiple of the {a.nproc} ranks "
            f"(or 0: drawn per mix), got {args.random_batch}"
        )
    if args.random_batch and not args.random_plans:
        raise SystemExit("neorec: error: --random-batch needs --random-plans > 0")
    if not [x for x in args.plans.split(",") if x] and not args.random_plans:
        raise SystemExit("neorec: error: no plans to check (--plans is empty, --random-plans 0)")
    if a.iters < max(1, args.passes):
        raise SystemExit(f"neorec: error: --iters {a.iters} must be >= --passes {args.passes}")


def _plan_job(cfg, a: argparse.Namespace, label: str, plan: ShardingPlan) -> dict[str, Any]:
    """A fixed plan of the ``bench dist`` table set as a ``run_jobs`` job."""
    specs = tables_from_config(cfg.embedding.tables, zipf_alpha=a.alpha)
    return plan_job(specs, a.batch, cfg.embedding.optimizer, plan, label=label)


def _random_results(
    jobs: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    preds: list[list[dict[str, float]]],
    ana: list[list[dict[str, float]]] | None = None,
    unanchored: list[list[dict[str, float]]] | None = None,
    ana_anchored: list[list[dict[str, float]]] | None = None,
) -> list[dict[str, Any]]:
    """Per random plan: median over rounds of the predicted (and analytical) and measured ms,
    and the error."""
    out = []
    for i, job in enumerate(jobs):
        meas = [r["ms_per_step"] for r in rows if r["job"] == i]
        if not meas:
            continue
        m = statistics.median(meas)
        p = statistics.median(pr[i]["step"] for pr in preds)
        pa = statistics.median(pr[i]["step"] for pr in (ana or preds))
        pu = statistics.median(pr[i]["step"] for pr in (unanchored or preds))
        paa = statistics.median(pr[i]["step"] for pr in (ana_anchored or ana or preds))
        types: dict[str, int] = {}
        for t in job["plan"]["tables"]:
            types[t["type"]] = types.get(t["type"], 0) + 1
        out.append(
            {
                "plan": f"random_{i}",
                "mix": job["mix"],
                "tables": len(job["tables"]),
                "types": ",".join(f"{k}:{v}" for k, v in sorted(types.items())),
                "batch": job["batch"],
                "optimizer": job["optimizer"],
                "alpha": job["alpha"],
                "predicted_ms": round(p, 3),
                "analytical_ms": round(pa, 3),
                "unanchored_ms": round(pu, 3),
                "analytical_anchored_ms": round(paa, 3),
                "measured_ms": m,
                "measured_min_ms": min(meas),
                "measured_max_ms": max(meas),
                "error": round((p - m) / m, 4),
            }
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
