"""``neorec bench step``: one full DLRM training step (embeddings + dense + optimizers).

``--device cuda`` runs the step on the GPU (tables in HBM, backend ``auto``: triton when
installed, else cuda; the NaN guard read once at the end, as the trainer does) next to the same
DLRM whose embeddings are FBGEMM GPU's CUDA TBE (``--compare fbgemm``, the default there; one
FBGEMM table per feature). Without a CUDA device or fbgemm_gpu it stops with a one-line error.

``--breakdown`` splits the step into its phases, each next to its floor on this machine
(``step_breakdown``); ``--compare torchrec`` times the same DLRM in TorchRec against ours, each
side in fresh processes over ``--rounds`` rounds in rotated order (``step_compare``). ``--set
key=value`` overrides the config as ``neorec train`` does (e.g. ``lowp.mode=auto``, which the
breakdown runs with the trainer's LoKA hooks).
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from neorec.bench.op import check_gpu_bench, fbgemm_tbe
from neorec.bench.stats import paired_ratio
from neorec.bench.step_breakdown import main_args, run_breakdown
from neorec.bench.step_compare import (
    SIDES,
    check_compare_args,
    ours_shapes,
    run_compare,
    step_shape,
    torchrec_shapes,
)
from neorec.bench.step_timing import make_batches
from neorec.builder import build_dlrm, dense_optimizer
from neorec.config import LowpConfig, load_config
from neorec.config.model import PRECISIONS
from neorec.data.batch import Batch
from neorec.errors import ConfigError
from neorec.modules.collection import EmbeddingCollection
from neorec.modules.dlrm import DLRM
from neorec.ops.row_optim import RowOptimizer
from neorec.sparse import SparseFeatures
from neorec.train.steps import LossGuard, train_step

__all__ = ["main", "make_batches"]

DEFAULT_CONFIG = "configs/dlrm_benchmark.toml"


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags."""
    p = argparse.ArgumentParser(prog="neorec bench step", description=__doc__)
    p.add_argument("--config", default=None, help=f"TOML config (default {DEFAULT_CONFIG})")
    p.add_argument("--tables", type=int)
    p.add_argument("--rows", type=int)
    p.add_argument("--dim", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--pooling", type=float)
    p.add_argument("--alpha", type=float, default=0.0, help="Zipf exponent of ids (0 = uniform)")
    p.add_argument("--optimizer", choices=["sgd", "rowwise_adagrad", "adam"])
    p.add_argument("--backend", default=None, help="TBE backend (auto, cpu, reference)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bf16", action="store_true", help="dense MLPs under bf16 autocast (AMX)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs")
    p.add_argument(
        "--compare",
        choices=("fbgemm", "torchrec", "none"),
        default=None,
        help="also time the DLRM with FBGEMM's TBE as its embeddings (default: fbgemm on cuda), "
        "or the same DLRM in TorchRec (CPU; JSON vs_torchrec = ours / TorchRec's, paired by round)",
    )
    p.add_argument(
        "--rounds", type=int, default=None,
        help="--compare torchrec: rounds, each side in a fresh process, order rotated (default 5)",
    )  # fmt: skip
    p.add_argument("--worker", choices=SIDES, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
        help="config override, repeatable (e.g. lowp.mode=auto)",
    )  # fmt: skip
    main_args(p)
    p.add_argument(
        "--lowp",
        default="",
        metavar="MODE[,MODE...]",
        help="LoKA precision modes to time side by side: off, auto, bf16, fp16, fp8, and "
        "autocast (plain torch.autocast(bfloat16) of the dense part, the baseline LoKA must "
        "beat), e.g. off,auto,autocast; each mode probes during the warm-up steps, then is timed",
    )
    p.add_argument("--tolerance", type=float, default=None, help="lowp.tolerance override")
    p.add_argument(
        "--plan",
        default="",
        metavar="FILE",
        help="the auto arm runs this pinned plan (lowp.plan; e.g. what neorec bench lowp "
        "--save-plan wrote), so the speed and the quality runs run the same sites",
    )
    p.add_argument(
        "--precision",
        default="",
        metavar="P[,P...]",
        help="embedding table precisions to time side by side: fp32, fp16, bf16, fp8 "
        "(embedding.rounding applies); reports each one's table memory",
    )
    return p.parse_args(argv)


class _Mode:
    """A fresh model (same seed) trained in one lowp mode (or plain: mode '')."""

    def __init__(
        self, cfg, a: argparse.Namespace, mode: str, precision: str = "", peer: bool = False
    ) -> None:
        from neorec.lowp.dispatch import Dispatcher

        if precision:
            cfg = copy.deepcopy(cfg)
            for t in cfg.embedding.tables:
                t.precision = precision
        self.device = torch.device(a.device)
        self.model = _fbgemm_dlrm(cfg, a.device) if peer else build_dlrm(cfg, self.device)
        self.guard = LossGuard()
        self.table_mb = (
            sum(
                b.untyped_storage().nbytes()
                for n, b in self.model.ebc.named_buffers()
                if "weights" in n
            )
            / 2**20
        )
        self.opt = dense_optimizer(cfg.train, self.model.dense_parameters())
        self.bf16 = a.bf16 or mode == "autocast"
        self.disp = None
        if mode and mode not in ("off", "autocast"):
            tol = a.tolerance if a.tolerance is not None else 0.01
            warm = max(a.warmup, 1)
            plan = a.plan if mode == "auto" else ""
            policy = LowpConfig(
                mode=mode, tolerance=tol, probe_steps=warm, reprobe_every=0, plan=plan
            )
            self.disp = Dispatcher(self.model.dense_arch, cfg.data.batch_size, policy)
        self.times: list[float] = []

    def step(self, i: int, batch: Batch, timed: bool) -> None:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        if self.disp is not None:
            self.disp.before_step(i)
        train_step(self.model, self.opt, batch, i + 1, bf16=self.bf16, guard=self.guard)
        if self.disp is not None:
            self.disp.after_step(i)
        sync()  # a GPU step is timed to its end
        if timed:
            self.times.append(time.perf_counter() - t0)

    def result(self) -> dict:
        self.guard.check()  # the NaN guard, once (no host sync inside the timed steps)
        out = {
            "ms": 1000 * statistics.median(self.times),
            "ms_mean": 1000 * statistics.mean(self.times),
            "backend": str(getattr(getattr(self.model.ebc, "backend", None), "name", "grouped")),
            "table_mb": round(self.table_mb, 1),
        }
        if self.disp is not None:
            out["plan"] = dict(self.disp.plan)
            out["lowp_sites"] = sum(p != "fp32" for p in self.disp.plan.values())
            self.disp.close()
        return out


class _FbgemmCollection(EmbeddingCollection):
    """The embeddings of a config as FBGEMM's TBE (one table per feature, fused optimizer): the
    peer's collection, for timing only (its state and rows stay inside FBGEMM)."""

    step: torch.Tensor

    def __init__(self, cfg, device: str) -> None:
        super().__init__()
        emb = cfg.embedding
        opt = RowOptimizer.from_config(emb)
        rows = [t.rows for t in emb.tables for _ in t.features]
        self.tables = list(emb.tables)
        self.names = self.feature_names = list(emb.feature_names)
        self.dim = emb.tables[0].dim
        self.tbe = fbgemm_tbe(rows, self.dim, opt.kind, opt.lr, opt.eps, device)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))

    @property
    def output_dim(self) -> int:
        """Columns of the pooled output."""
        return len(self.names) * self.dim

    @property
    def state_names(self) -> list[str]:
        """None visible: FBGEMM keeps its optimizer state."""
        return []

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """None visible: FBGEMM keeps its optimizer state."""
        return {}

    def add_update_hook(self, hook: Any) -> None:
        """Refused: FBGEMM's TBE reports no updated rows (the peer is timed, not checkpointed)."""
        raise NotImplementedError("FBGEMM's TBE reports no updated rows")

    def table_weight(self, name: str) -> torch.Tensor:
        """Refused: the peer's rows are not read back (it is timed only)."""
        raise NotImplementedError("FBGEMM's TBE rows are not read back here")

    def forward(self, sparse: SparseFeatures) -> torch.Tensor:
        """Pooled [B, F * D], features in config order (FBGEMM's table-major offsets)."""
        sp = sparse.reorder(self.names)
        out: torch.Tensor = self.tbe(sp.values, sp.offsets())
        return out


def _fbgemm_dlrm(cfg, device: str) -> DLRM:
    """The config's DLRM with FBGEMM's TBE as its embedding collection (the peer)."""
    return DLRM(cfg.model, _FbgemmCollection(cfg, device), seed=cfg.train.seed, device=device)


def _worker(cfg: Any, a: argparse.Namespace, mode: str, precision: str) -> int:
    """One side of ``--compare torchrec`` in this (fresh) process: its step timed on the seed's
    batches, its model's shapes; one JSON line."""
    batches = make_batches(cfg, 4, a.alpha)
    tr: Any
    if a.worker == "ours":
        tr = _Mode(cfg, a, mode, precision)
        shapes = ours_shapes(tr.model)
    else:
        from neorec.bench.step_torchrec import TorchRecPeer

        # Ours in a low-precision mode: TorchRec's dense part under bf16 autocast, its own
        # mixed-precision route on the CPU (the peer LoKA's --lowp autocast baseline is too).
        tr = TorchRecPeer(cfg, bf16=a.bf16 or mode not in ("", "off"))
        shapes = torchrec_shapes(tr.model)
    # LoKA decides at the end of the warm-up; one more untimed step runs its kernels once (their
    # first call builds oneDNN's primitives). Both sides take the same number of steps.
    warm = a.warmup + (mode not in ("", "off", "autocast"))
    for i in range(warm + a.iters):
        tr.step(i, batches[i % len(batches)], timed=i >= warm)
    res = tr.result()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    extra = {"bf16_autocast": tr.bf16, "mode": mode, "threads": torch.get_num_threads()}
    print(json.dumps({"side": a.worker, **res, **extra, "shapes": shapes, "peak_rss_mb": rss_mb}))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and a JSON line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse(argv)
    a.compare = a.compare or ("fbgemm" if a.device == "cuda" else "none")
    check_gpu_bench("step", a.device, a.compare)
    if a.nproc != 1 and not a.breakdown:
        raise ConfigError(
            f"bench step --nproc {a.nproc}: only the breakdown runs distributed (add --breakdown; "
            "neorec bench dist times every sharding type)"
        )
    path = a.config or (DEFAULT_CONFIG if Path(DEFAULT_CONFIG).exists() else None)
    if path is None:  # said, not silent: the figures are of another model
        print(
            f"{DEFAULT_CONFIG} is not here (run from the repository): the built-in default config"
        )
    sets = []
    for flag, key in [
        (a.tables, "embedding.num_tables"),
        (a.rows, "embedding.rows"),
        (a.dim, "embedding.dim"),
        (a.batch, "data.batch_size"),
        (a.pooling, "embedding.pooling_factor"),
        (a.optimizer, "embedding.optimizer"),
        (a.backend, "embedding.backend"),
    ]:
        if flag is not None:
            sets.append(f"{key}={flag!r}" if isinstance(flag, str) else f"{key}={flag}")
    if a.dim is not None:
        cfg0 = load_config(path)
        sets.append(f"model.bottom_mlp={cfg0.model.bottom_mlp[:-1] + [a.dim]}")
    if a.tables is not None or a.rows is not None or a.dim is not None or a.pooling is not None:
        sets.append("embedding.tables=[]")
    cfg = load_config(path, sets + list(a.sets))
    if a.threads:
        torch.set_num_threads(a.threads)
    modes = [m.strip() for m in a.lowp.split(",") if m.strip()] if a.lowp else [""]
    if not a.lowp and cfg.lowp.mode != "off" and not a.breakdown:
        modes = [cfg.lowp.mode]  # --set lowp.mode=...: timed as --lowp would
    from neorec.lowp.dispatch import MODES

    known = (*MODES, "autocast")  # LoKA's modes and the plain-autocast baseline

    bad = [m for m in modes if m and m not in known]
    if bad:
        raise SystemExit(f"neorec bench step: --lowp {bad[0]!r}: modes are {', '.join(known)}")
    if a.plan and "auto" not in modes:
        raise SystemExit(f"neorec bench step: --plan {a.plan}: only the auto arm runs a plan")
    precisions = [p.strip() for p in a.precision.split(",") if p.strip()] or [""]
    bad = [p for p in precisions if p and p not in PRECISIONS]
    if bad:
        raise SystemExit(
            f"neorec bench step: --precision {bad[0]!r}: one of {', '.join(PRECISIONS)}"
        )
    rounds = check_compare_args(a, modes, precisions)
    if a.worker:
        return _worker(cfg, a, modes[0], precisions[0])
    if rounds and not a.breakdown:
        return run_compare(cfg, a, argv, rounds)
    batches = [b.to(a.device) for b in make_batches(cfg, 4, a.alpha)]
    if a.breakdown:
        if a.device != "cpu" or a.lowp or a.precision or a.compare != "none":
            raise ConfigError(
                "bench step --breakdown: one CPU model (lowp and precision by --set, no --compare)"
            )
        return run_breakdown(cfg, a, batches)
    # Every variant's model steps in turn (interleaved), so load on the machine hits them alike.
    trainers = {
        "/".join(x for x in (m, p) if x): _Mode(cfg, a, m, p) for m in modes for p in precisions
    }
    modes = list(trainers)
    if a.compare == "fbgemm":
        trainers["fbgemm"] = _Mode(cfg, a, "", "", peer=True)
    # LoKA decides at the end of the warm-up (its probe window): one more untimed step runs the
    # chosen kernels once (their first call builds oneDNN's primitives) before the timing.
    warm = a.warmup + any(tr.disp is not None for tr in trainers.values() if isinstance(tr, _Mode))
    for i in range(warm + a.iters):
        for tr in trainers.values():
            tr.step(i, batches[i % len(batches)], timed=i >= warm)
    runs = {m: tr.result() for m, tr in trainers.items()}
    times = {m: tr.times for m, tr in trainers.items()}  # paired by step: interleaved
    first = runs[modes[0]]
    ms = first["ms"]
    backend_name = first["backend"]
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {
        **step_shape(cfg, a, backend_name),
        "threads": torch.get_num_threads(),
        "ms_per_step": round(ms, 2),
        "ms_per_step_mean": round(first["ms_mean"], 2),
        "samples_per_s": round(cfg.data.batch_size / (ms / 1000), 1),
        "peak_rss_mb": round(rss_mb, 1),
        "device": a.device,
    }
    if a.device == "cuda":
        result["peak_hbm_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    if "fbgemm" in runs:
        fb = runs.pop("fbgemm")["ms"]
        result["fbgemm_ms_per_step"] = round(fb, 2)
        result["speedup_vs_fbgemm"] = round(fb / ms, 3)
    print(f"{'metric':<22}{'value':>14}")
    for k in ("tables", "rows", "dim", "batch", "pooling", "alpha", "optimizer", "backend"):
        print(f"{k:<22}{result[k]!s:>14}")
    for k in ("bf16_dense", "ms_per_step", "ms_per_step_mean", "samples_per_s", "peak_rss_mb"):
        print(f"{k:<22}{result[k]!s:>14}")
    for k in ("device", "peak_hbm_mb", "fbgemm_ms_per_step", "speedup_vs_fbgemm"):
        if k in result:
            print(f"{k:<22}{result[k]!s:>14}")
    if a.precision:
        result["precision"] = {
            m: {"ms_per_step": round(r["ms"], 2), "speedup_vs_first": round(ms / r["ms"], 3),
                "table_mb": r["table_mb"]}
            for m, r in runs.items()
        }  # fmt: skip
        print(f"{'variant':<16}{'ms/step':>10}{'vs first':>10}{'table MB':>10}")
        for m, r in result["precision"].items():
            print(f"{m:<16}{r['ms_per_step']:>10.2f}{r['speedup_vs_first']:>9.2f}x"
                  f"{r['table_mb']:>10.1f}")  # fmt: skip
    elif a.lowp:
        ref = "off" if "off" in runs else modes[0]
        result["lowp"] = {
            m: {
                "ms_per_step": round(r["ms"], 2),
                # speedup: off's step time over this mode's, paired by step, 95% interval
                "speedup_vs_off": paired_ratio(times[ref], times[m]).to_dict(),
                **({"plan": r["plan"], "lowp_sites": r["lowp_sites"]} if "plan" in r else {}),
            }
            for m, r in runs.items()
        }
        if a.plan:
            result["lowp_plan_file"] = a.plan
        if "auto" in runs and "autocast" in runs:  # > 1: auto is faster than plain autocast
            result["auto_vs_autocast"] = paired_ratio(times["autocast"], times["auto"]).to_dict()
        print(f"{'lowp mode':<12}{'ms/step':>10}{'speedup vs ' + ref:>26}{'lowp sites':>12}")
        for m, r in result["lowp"].items():
            iv, sites = r["speedup_vs_off"], r.get("lowp_sites", 0)
            cell = f"{iv['value']:.3f}x [{iv['lo']:.3f}, {iv['hi']:.3f}]"
            print(f"{m:<12}{r['ms_per_step']:>10.2f}{cell:>26}{sites:>12}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":  # a --compare torchrec worker: python -m neorec.bench.step ... --worker
    sys.exit(main())
