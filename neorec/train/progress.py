"""What a run shows while it trains: the start banner, the progress bar or lines, the eval line.

On a terminal the progress is a tqdm bar (steps, ETA, loss, samples/s). tqdm because it is small,
pure Python, has no dependencies of its own, and knows terminals (width, redraw rate); rich would
bring its own rendering stack for one bar. When stdout is not a terminal (CI, tests, a pipe, a
file), or tqdm is not installed, the same information is a plain line every ``train.log_every``
steps; ``train.log`` always gets the plain lines.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
from torch import Tensor

from neorec.phases import fmt_duration

__all__ = [
    "Progress",
    "banner",
    "eval_line",
    "fmt_duration",
    "lowp_decision",
    "whole_batches_line",
]

_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def _tqdm() -> Any:
    """The tqdm class, or None when tqdm is not installed (plain lines then)."""
    try:
        return importlib.import_module("tqdm").tqdm
    except ImportError:
        return None


KEEP_LOSSES = 50
"""Recent losses a run keeps at least (``final_loss`` is their mean)."""


@dataclass
class Progress:
    """Steps, samples and recent losses of a run; shows them as a bar or as periodic lines."""

    total: int | None
    every: int
    out: TextIO = field(default_factory=lambda: sys.stdout)
    enabled: bool = True
    start: float = field(default_factory=time.perf_counter)
    samples: int = 0
    _losses: list[float] = field(default_factory=list)
    _pending: list[Tensor] = field(default_factory=list)
    """Losses of steps since the last read, still on the device (read once per log line: no
    host sync per step on a GPU)."""
    start_samples: int = 0
    """Samples already trained when this process began (a resumed run's), left out of rates."""
    start_step: int = 0
    bar: Any = None
    extra: Any = None
    """Called at each printed line for more text (the dynamic tables' counters), or None."""

    @property
    def keep(self) -> int:
        """How many recent losses are kept: what the progress line, the summary's ``final_loss``
        (the last 50) and a checkpoint read. A run of any length holds no more."""
        return max(KEEP_LOSSES, self.every)

    @property
    def losses(self) -> list[float]:
        """The last ``keep`` steps' losses (reading moves the pending ones to the host at once)."""
        if self._pending:
            self._losses.extend(torch.stack(self._pending).double().tolist())
            self._pending.clear()
            del self._losses[: -self.keep]
        return self._losses

    @losses.setter
    def losses(self, values: list[float]) -> None:
        self._losses, self._pending = list(values)[-self.keep :], []

    def begin(self, step: int = 0, bar: bool | None = None) -> None:
        """Start the clock at ``step``: rates count what this process trains from now on.

        ``bar``: show a tqdm bar (default: when enabled, the output is a terminal and tqdm is
        installed)."""
        self.start, self.start_samples, self.start_step = time.perf_counter(), self.samples, step
        isatty = getattr(self.out, "isatty", None)
        if bar is None:
            bar = self.enabled and bool(isatty and isatty())
        cls = _tqdm() if bar and self.enabled else None
        if cls is None:
            return
        stream = getattr(self.out, "stream", self.out)  # the terminal behind a Tee
        try:
            width = os.get_terminal_size(stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            width = 0
        self.bar = cls(
            total=self.total,
            initial=step,
            file=stream,
            unit="step",
            desc="train",
            dynamic_ncols=width > 0,  # a terminal that reports no size (0 x 0): 100 x 24
            ncols=None if width > 0 else 100,
            nrows=None if width > 0 else 24,
            mininterval=0.5,
            leave=True,
        )
        if hasattr(self.out, "bar"):
            self.out.bar = self.bar  # the Tee clears the bar around other lines

    def rate(self, elapsed: float) -> float:
        """Samples per second this process trained over ``elapsed`` seconds."""
        return (self.samples - self.start_samples) / max(elapsed, 1e-9)

    def eta(self, step: int, elapsed: float) -> float | None:
        """Seconds left at this process's pace (None when the run's length is unknown)."""
        done = step - self.start_step
        if not self.total or done <= 0:
            return None
        return elapsed / done * max(0, self.total - step)

    def update(self, step: int, batch_size: int, loss: Tensor) -> dict[str, Any] | None:
        """Record a step; every ``every`` steps (and at the last) return the logged values and
        show them (a plain line, or the bar's postfix with the line in train.log only)."""
        self.samples += batch_size
        self._pending.append(loss.detach().reshape(()))
        if self.bar is not None:
            self.bar.update(1)
        if step % self.every and step != self.total:
            return None
        elapsed = time.perf_counter() - self.start
        rate = self.rate(elapsed)
        recent = self.losses[-self.every :]
        mean = sum(recent) / len(recent)
        logged = {"step": step, "loss": mean, "samples_per_s": rate, "elapsed_s": elapsed}
        if not self.enabled:
            return logged
        total = f"/{self.total}" if self.total else ""
        eta = self.eta(step, elapsed)
        left = "" if eta is None or step == self.total else f"  eta {fmt_duration(eta)}"
        line = f"step {step}{total}  loss {mean:.4f}  {rate:,.0f} samples/s  {elapsed:.1f}s{left}"
        more = self.extra() if self.extra is not None else ""
        line += f"  {more}" if more else ""
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {mean:.4f}, {rate:,.0f} samples/s", refresh=False)
            log_only = getattr(self.out, "log_only", None)
            if log_only is not None:
                log_only(line + "\n")
        else:
            print(line, file=self.out, flush=True)
        return logged

    def close(self) -> None:
        """End the bar (the lines after it print below it)."""
        if self.bar is not None:
            self.bar.close()
            if hasattr(self.out, "bar"):
                self.out.bar = None
            self.bar = None


def eval_line(e: dict[str, Any], batches: int = 0) -> str:
    """The printed line of a periodic eval (``batches``: at most how many it read, 0 = all)."""
    part = f" ({int(e['samples']):,} samples)" if batches and "samples" in e else ""
    return (
        f"eval at step {e['step']}{part}  auc {e['auc']:.4f}  logloss {e['logloss']:.4f}  "
        f"ne {e['ne']:.4f}  calibration {e['calibration']:.3f}"
    )


def _mlp(n_in: int | str, widths: list[int]) -> str:
    return "-".join(str(w) for w in [n_in, *widths])


def _capacity(t: Any) -> int:
    """Rows a table holds: a dynamic table's capacity slots (0 = its id space), else its rows."""
    if getattr(t, "kind", "fixed") == "dynamic":
        return int(getattr(t, "capacity", 0) or t.rows)
    return int(t.rows)


def banner(
    cfg: Any,
    *,
    folder: str,
    resumed: bool,
    world: int,
    dense_params: int,
    total_steps: int | None,
    eval_every: int,
    plan: Any = None,
    towers: list[list[str]] | None = None,
) -> str:
    """The lines printed when a run starts: what is trained, on what, where it is written; the
    towers (``towers``: their tables), dynamic tables' capacities, the low-precision mode and the
    plan's summary when the run has them."""
    m, e, t, d = cfg.model, cfg.embedding, cfg.train, cfg.data
    tables = list(e.tables)
    if m.interaction == "dot":
        inter = "dot interaction" + (" (with self terms)" if m.dot_self else "")
    else:
        low = f", rank {m.dcn_low_rank}" if m.dcn_low_rank else ""
        inter = f"DCNv2 interaction ({m.dcn_layers} layers{low})"
    features = sum(len(x.features) for x in tables)
    dims = sorted({x.dim for x in tables})
    precisions = Counter(getattr(x, "precision", "") or "fp32" for x in tables)
    storages = Counter(x.storage for x in tables if x.storage != "memory")
    rows = sum(_capacity(x) for x in tables)
    emb_params = sum(_capacity(x) * int(x.dim) for x in tables)
    emb_bytes = sum(
        _capacity(x) * int(x.dim) * _BYTES.get(getattr(x, "precision", "") or "fp32", 4)
        for x in tables
    )
    prec = ", ".join(f"{k} x{n}" if len(precisions) > 1 else k for k, n in precisions.items())
    where = "; " + ", ".join(f"{k} x{n}" for k, n in storages.items()) if storages else ""
    dim = "dim " + "/".join(str(x) for x in dims)
    lines = [
        f"run      {folder}" + (" (resumed)" if resumed else ""),
        f"model    bottom MLP {_mlp(m.num_dense, m.bottom_mlp)} | {inter} | "
        f"top MLP {_mlp('in', m.top_mlp)}",
        f"tables   {len(tables)} tables, {features} features, {rows:,} rows, {dim}, {prec}, "
        f"pooling {e.pooling}, {e.optimizer} lr {e.lr:g}{where}",
        f"params   dense {dense_params:,} | embedding {emb_params:,} "
        f"({emb_bytes / 2**20:,.1f} MiB of weights)",
    ]
    dyn = [x for x in tables if getattr(x, "kind", "fixed") == "dynamic"]
    if dyn:
        lines.append(
            "dynamic  "
            + "; ".join(
                f"{x.name}: capacity {_capacity(x):,} slots, id space {int(x.rows):,}" for x in dyn
            )
        )
    if towers:
        tw = cfg.towers
        how = "given groups" if tw.groups else f"{tw.partitioner or 'balanced'} partition"
        lines.append(
            f"towers   {len(towers)} towers ({how}), tables per tower "
            f"{'/'.join(str(len(g)) for g in towers)}, module {tw.module}"
            + (f" ({tw.out_vectors} vectors out)" if tw.out_vectors > 1 else "")
        )
    lp = getattr(cfg, "lowp", None)
    if lp is not None and lp.mode != "off":
        if lp.mode == "auto":
            what = (
                f"auto: the first {lp.probe_steps} steps in fp32 are probed, then each dense "
                f"site runs the fastest precision within tolerance {lp.tolerance:g}"
            )
        else:
            what = f"{lp.mode} on every dense site"
        ends = " (first and last layer kept fp32)" if lp.keep_ends else ""
        lines.append(f"lowp     {what}{ends}")
    steps = f"{total_steps:,} steps" if total_steps else "length unknown"
    if t.eval_every or eval_every:
        part = f" on the first {t.eval_batches} batches" if t.eval_batches else ""
        every = "every step" if eval_every == 1 else f"every {eval_every:,} steps"
        evals = f"eval {every}{part}, the whole split at the end"
    else:
        evals = "eval at the end"
        if t.eval_fraction and not total_steps:
            evals += " (train.eval_fraction needs a known length: set train.eval_every)"
    lines.append(
        f"train    {d.source} data, batch {d.batch_size:,}, {steps}, {t.dense_optimizer} "
        f"lr {t.dense_lr:g}; {evals}"
    )
    ranks = f"world    {world} rank{'s' if world > 1 else ''}"
    if world > 1 and ((plan is not None and plan.tables) or dyn or towers):
        kinds = Counter(
            str(getattr(p.sharding_type, "value", p.sharding_type))
            for p in (plan.tables if plan is not None else [])
        )
        parts = [f"{k} x{n}" for k, n in sorted(kinds.items())]
        parts += [f"dynamic (id hash) x{len(dyn)}"] if dyn else []
        parts += [f"towers x{len(towers)} (tower-local sharding)"] if towers else []
        ranks += " | plan " + ", ".join(parts)
    lines.append(ranks)
    return "\n".join(lines)


def every_of(eval_every: int, fraction: float, total: int | None) -> int:
    """Steps between periodic evals: ``eval_every``, else ``fraction`` of ``total`` (rounded up),
    else 0 (only the final eval)."""
    if eval_every:
        return eval_every
    if not fraction or not total:
        return 0
    return max(1, math.ceil(total * fraction))


def _fp32_reason(disp: Any, name: str, times: dict[str, dict[str, float]]) -> str:
    """Why dispatch keeps site ``name`` in fp32."""
    from neorec.lowp.dispatch import MIN_GAIN

    if name in disp.keep_fp32:
        return "first / last layer, lowp.keep_ends"
    if disp.mode != "auto":
        return f"lowp.mode {disp.mode}"
    r = disp.probe.results.get(name)
    t = times.get(name, {})
    base = t.get("fp32", math.inf)
    cands = [c for c in (r.errors if r is not None else {}) if c != "fp32"]
    if not any(math.isfinite(t.get(c, math.inf)) for c in cands):
        return "no low-precision kernel on this device"
    safe = [c for c in cands if math.isfinite(r.bound(c)) and r.bound(c) <= disp.tolerance]
    if not safe:
        return f"error above lowp.tolerance {disp.tolerance:g} in every precision"
    if not any(t.get(c, math.inf) <= MIN_GAIN * base for c in safe):
        return f"no precision within tolerance is {100 * (1 - MIN_GAIN):.0f}% faster here"
    return "other"


def lowp_decision(disp: Any, step: int) -> str:
    """One line: the low-precision plan a dispatcher (``neorec.lowp.dispatch.Dispatcher``) chose
    at ``step`` and why the sites it keeps in fp32 stay there."""
    plan = {k: v for k, v in disp.plan.items() if not k.startswith("pooled.")}
    times = disp.decisions[-1].times if disp.decisions else {}
    low = Counter(v for v in plan.values() if v != "fp32")
    why = Counter(_fp32_reason(disp, k, times) for k, v in plan.items() if v == "fp32")
    n, kept = len(plan), sum(why.values())
    if not low:
        head = f"all {n} dense sites fp32"
    else:
        head = f"{n - kept} of {n} dense sites " + ", ".join(f"{k} x{c}" for k, c in low.items())
        head += f", {kept} fp32" if kept else ""
    reasons = "; ".join(f"{c} site{'s' if c > 1 else ''}: {k}" for k, c in why.items())
    wire = {k: v for k, v in disp.plan.items() if k.startswith("pooled.")}
    tail = (" | pooled wire " + ", ".join(f"{k[7:]} {v}" for k, v in wire.items())) if wire else ""
    return f"lowp {disp.mode} at step {step}: {head}" + (f" ({reasons})" if reasons else "") + tail


def whole_batches_line(cfg: Any) -> str | None:
    """For generated data (synthetic, stream) whose split sizes are not whole global batches:
    the samples actually used (the remainder of each split is dropped); None when nothing is."""
    d = cfg.data
    if d.source not in ("synthetic", "stream"):
        return None  # (files' own sources say what they drop)
    train_key = "window_samples" if d.source == "stream" else "train_samples"
    parts = []
    for name, key in (("train", train_key), ("eval", "eval_samples")):
        n = int(getattr(d, key))
        if n % d.batch_size:
            used = n // d.batch_size * d.batch_size
            parts.append(f"{name} {used:,} of data.{key} {n:,} ({n // d.batch_size:,} batches)")
    if not parts:
        return None
    return f"data     whole batches of {d.batch_size:,} only: " + "; ".join(parts)
