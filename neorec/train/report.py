"""``neorec report RUN``: the curves of a run as one PNG (and, with ``--html``, a small page).

Reads ``<run>/events.jsonl`` (and ``metrics.json`` when the run has finished) and draws, against
the step: the train loss with the eval log loss; the eval NE and AUC with the teacher's (synthetic
data: the best achievable) as dashed lines; the throughput; and, when the events carry them, the
communication bytes and waits per step (distributed runs) and the row cache's hit rate. Periodic
evals read the first ``train.eval_batches`` batches of the eval split; the final eval (a star)
reads all of it, as the teacher's metrics do.

matplotlib is optional (``pip install 'neorec[plot]'``); it draws with the Agg backend (no
display). ``series`` (the data of each panel) is separate from ``draw`` (the figure).
"""

from __future__ import annotations

import argparse
import base64
import html
import importlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neorec.errors import DataError, NeorecError

__all__ = [
    "ReportError",
    "Series",
    "find_run",
    "read_events",
    "read_metrics",
    "series",
    "draw",
    "summary_rows",
    "write_html",
    "make_report",
    "run_report",
]

_PLOT_EXTRA = "neorec report needs matplotlib: pip install 'neorec[plot]'"


class ReportError(NeorecError):
    """A report that cannot be made (matplotlib missing, an output that cannot be written)."""


# ---- reading ---------------------------------------------------------------------------------
def find_run(run: str, root: str = "runs") -> Path:
    """The run folder ``run`` names: a folder path, a run name under ``root``, or ``latest``."""
    p = Path(run)
    under = Path(root) / run
    for folder in (p, under):
        if folder.is_dir():
            return folder.resolve() if folder.is_symlink() else folder  # latest: the run's name
    if p.exists():
        raise DataError(f"run '{run}' is a file, not a run folder; name a run folder")
    hint = f"neorec runs --root {root} lists the runs" if Path(root).is_dir() else ""
    where = f"no folder '{run}' and no run '{run}' under '{root}'"
    raise DataError(
        f"run '{run}': {where}; pass a run folder, a run name or 'latest'"
        + (f" ({hint})" if hint else " (--root DIR names the runs folder)")
    )


def read_events(folder: Path) -> list[dict[str, Any]]:
    """The records of ``folder/events.jsonl``, in order.

    A last line cut short (the run was killed while writing it) is left out; any other line that
    is not a JSON object with a step is a ``DataError`` naming the file and line."""
    path = folder / "events.jsonl"
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise DataError(
            f"{path} does not exist: not a run folder of neorec train (or the run never started)"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    out: list[dict[str, Any]] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ok = isinstance(rec, dict) and isinstance(rec.get("step"), int)
        except ValueError:
            rec, ok = None, False
        if not ok:
            if i == len(lines):  # the last line, cut by an interruption
                break
            raise DataError(
                f"{path} line {i}: not an event (a JSON object with an integer 'step'): "
                f"{line[:60]!r}"
            )
        out.append(rec)
    if not out:
        raise DataError(f"{path} has no events yet: the run logged no step (nothing to plot)")
    return out


def read_metrics(folder: Path) -> dict[str, Any] | None:
    """``folder/metrics.json`` (written when the run ends); None when there is none."""
    path = folder / "metrics.json"
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(
            f"{path}: not readable as JSON ({e}); remove it to report the events"
        ) from None
    if not isinstance(d, dict):
        raise DataError(f"{path}: not a JSON object; remove it to report the events")
    return d


# ---- the data of each panel ------------------------------------------------------------------
@dataclass
class Series:
    """What each panel shows: (steps, values) per curve; a panel without data is left out."""

    loss: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    samples_per_s: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    eval: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    """Periodic evals: ``auc``, ``ne``, ``logloss``, ``calibration``."""
    final: dict[str, float] = field(default_factory=dict)
    """The final eval (the whole split) and its ``step``; empty when the run did not finish."""
    comm_bytes: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    comm_wait_ms: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    cache_hit_rate: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    teacher: dict[str, float] = field(default_factory=dict)
    eval_batches: int = 0
    """Batches each periodic eval read (0: the whole split, or not recorded)."""

    @property
    def has_comm(self) -> bool:
        """Whether a communication panel is drawn."""
        return bool(self.comm_bytes[0] or self.comm_wait_ms[0])

    @property
    def has_cache(self) -> bool:
        """Whether a cache panel is drawn."""
        return bool(self.cache_hit_rate[0])


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _add(curve: tuple[list[int], list[float]], step: int, v: Any) -> None:
    x = _num(v)
    if x is not None:
        curve[0].append(step)
        curve[1].append(x)


_EVAL = ("auc", "ne", "logloss", "calibration")


def series(events: list[dict[str, Any]], metrics: dict[str, Any] | None) -> Series:
    """The panels' data from events.jsonl's records and metrics.json (teacher, final eval)."""
    s = Series()
    for rec in events:
        step = int(rec["step"])
        _add(s.loss, step, rec.get("loss"))
        _add(s.samples_per_s, step, rec.get("samples_per_s"))
        _add(s.comm_bytes, step, rec.get("comm_bytes_per_step"))
        _add(s.comm_wait_ms, step, rec.get("comm_wait_ms_per_step"))
        _add(s.cache_hit_rate, step, rec.get("cache_hit_rate"))
        if "eval_ne" not in rec:
            continue
        if rec.get("final"):
            s.final = {"step": float(step)}
            s.final.update({k: v for k in _EVAL if (v := _num(rec.get(f"eval_{k}"))) is not None})
            continue
        s.eval_batches = int(rec.get("eval_batches") or 0)
        for k in _EVAL:
            _add(s.eval.setdefault(k, ([], [])), step, rec.get(f"eval_{k}"))
    if metrics:
        teacher = metrics.get("teacher") or {}
        if isinstance(teacher, dict):
            s.teacher = {k: v for k in _EVAL if (v := _num(teacher.get(k))) is not None}
        final = metrics.get("eval")
        if not s.final and isinstance(final, dict):
            last = (metrics.get("train") or {}).get("steps")
            if isinstance(last, int):
                s.final = {"step": float(last)}
                s.final.update({k: v for k in _EVAL if (v := _num(final.get(k))) is not None})
    return s


def summary_rows(metrics: dict[str, Any] | None, events: list[dict[str, Any]]) -> list[tuple]:
    """(label, value) rows of the run's summary table (the HTML page's)."""
    if not metrics:
        last = events[-1]["step"]
        return [("status", "running or stopped (no metrics.json)"), ("last logged step", last)]
    run, tr = metrics.get("run") or {}, metrics.get("train") or {}
    ev, te = metrics.get("eval") or {}, metrics.get("teacher") or {}

    def f(v: Any, fmt: str) -> str:
        return "-" if _num(v) is None else format(v, fmt)

    rows: list[tuple] = [
        ("run", run.get("name", "-")),
        ("started / ended (UTC)", f"{run.get('start_utc', '-')} / {run.get('end_utc', '-')}"),
        ("world size", run.get("world_size", "-")),
        ("steps", f(tr.get("steps"), ",d")),
        ("samples", f(tr.get("samples"), ",d")),
        ("train seconds", f(tr.get("seconds"), ",.1f")),
        ("samples/s", f(tr.get("samples_per_s"), ",.0f")),
        ("final train loss", f(tr.get("final_loss"), ".4f")),
    ]
    for k in _EVAL:
        rows.append((f"eval {k}", f(ev.get(k), ".4f")))
        if te:
            rows.append((f"teacher {k}", f(te.get(k), ".4f")))
    gap = _num(metrics.get("eval_ne_gap_vs_teacher"))
    if gap is not None:
        rows.append(("eval NE vs teacher", f"{100 * gap:+.2f}%"))
    cpu = run.get("cpu") or {}
    rows += [
        ("neorec / torch", f"{run.get('neorec_version', '-')} / {run.get('torch_version', '-')}"),
        ("git commit", run.get("git_commit") or "-"),
        ("host / CPU", f"{run.get('host', '-')} / {cpu.get('model') or '-'}"),
    ]
    return rows


# ---- drawing ---------------------------------------------------------------------------------
def _pyplot() -> Any:
    try:
        mpl = importlib.import_module("matplotlib")
    except ImportError:
        raise ReportError(_PLOT_EXTRA) from None
    mpl.use("Agg", force=True)
    return importlib.import_module("matplotlib.pyplot")


def _teacher_line(ax: Any, s: Series, key: str) -> None:
    v = s.teacher.get(key)
    if v is not None:
        ax.axhline(v, color="tab:green", linestyle="--", linewidth=1.2, label=f"teacher {v:.4f}")


def _final_point(ax: Any, s: Series, key: str, color: str) -> None:
    if key in s.final:
        v = s.final[key]
        ax.plot(
            [s.final["step"]],
            [v],
            marker="*",
            markersize=12,
            color=color,
            linestyle="none",
            label=f"final eval (whole split) {v:.4f}",
        )


def _unit(values: list[float]) -> tuple[float, str]:
    top = max(values, default=0.0)
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= scale:
            return scale, name
    return 1.0, "bytes"


def _comm_panel(ax: Any, s: Series) -> None:
    """Bytes rank 0 sent per step (left axis) and ms it waited per step (right axis)."""
    lines: list[Any] = []
    if s.comm_bytes[0]:
        scale, unit = _unit(s.comm_bytes[1])
        ys = [v / scale for v in s.comm_bytes[1]]
        lines += ax.plot(s.comm_bytes[0], ys, color="tab:blue", label=f"{unit} sent per step")
        ax.set_ylabel(f"{unit} per step")
        ax.set_ylim(bottom=0)
    if s.comm_wait_ms[0]:
        ax2 = ax.twinx()
        lines += ax2.plot(*s.comm_wait_ms, color="tab:red", label="ms waited per step")
        ax2.set_ylabel("ms per step")
        ax2.set_ylim(bottom=0)
        ax = ax2  # the legend above both curves
    ax.legend(lines, [x.get_label() for x in lines], loc="best", fontsize=8, framealpha=0.7)
    ax.set_title("communication per step (rank 0)")


def draw(s: Series, out: Path, title: str) -> None:
    """Draw the panels of ``s`` into the PNG ``out`` (matplotlib, Agg backend)."""
    plt = _pyplot()
    part = f"first {s.eval_batches} batches" if s.eval_batches else "eval split"
    eval_label = f"eval ({part})"
    panels = ["loss", "ne", "auc", "throughput"]
    if s.has_comm:
        panels.append("comm")
    if s.has_cache:
        panels.append("cache")
    rows = math.ceil(len(panels) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 3.9 * rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    for name, ax in zip(panels, flat):
        ax.grid(True, alpha=0.3)
        ax.set_xlabel("step")
        if name == "loss":
            ax.plot(*s.loss, color="tab:blue", label="train loss (mean since the last line)")
            ev = s.eval.get("logloss")
            if ev and ev[0]:
                ax.plot(*ev, color="tab:orange", marker="o", label=f"{eval_label} logloss")
            _final_point(ax, s, "logloss", "tab:red")
            _teacher_line(ax, s, "logloss")
            ax.set_title("loss (binary cross-entropy)")
        elif name in ("ne", "auc"):
            ev = s.eval.get(name)
            if ev and ev[0]:
                ax.plot(*ev, color="tab:orange", marker="o", label=eval_label)
            _final_point(ax, s, name, "tab:red")
            _teacher_line(ax, s, name)
            better = "lower" if name == "ne" else "higher"
            ax.set_title(f"eval {name.upper()} ({better} is better)")
            if not (ev and ev[0]) and name not in s.final:
                ax.text(0.5, 0.5, "no eval yet", ha="center", va="center", transform=ax.transAxes)
        elif name == "throughput":
            ax.plot(
                *s.samples_per_s,
                color="tab:purple",
                label="samples/s (mean since the process started)",
            )
            ax.set_ylim(bottom=0)
            ax.set_title("throughput (samples/s)")
        elif name == "comm":
            _comm_panel(ax, s)
            continue  # (its own legend)
        elif name == "cache":
            pct = [100 * v for v in s.cache_hit_rate[1]]
            ax.plot(s.cache_hit_rate[0], pct, color="tab:brown", label="row cache hit rate")
            ax.set_ylim(0, 100)
            ax.set_ylabel("%")
            ax.set_title("row cache hit rate (%)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8, framealpha=0.7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:
        raise ReportError(f"{out}: cannot write the report: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def _title(folder: Path, metrics: dict[str, Any] | None, events: list[dict[str, Any]]) -> str:
    if not metrics:
        return f"run {folder.name} (not finished: no metrics.json; last step {events[-1]['step']})"
    run, tr, ev = metrics.get("run") or {}, metrics.get("train") or {}, metrics.get("eval") or {}
    text = f"run {run.get('name', folder.name)}: {tr.get('steps', '?')} steps"
    world = run.get("world_size")
    if world:
        text += f", {world} rank{'s' if world != 1 else ''}"
    if _num(ev.get("ne")) is not None:
        text += f"; final eval NE {ev['ne']:.4f}, AUC {ev.get('auc', float('nan')):.4f}"
    gap = _num(metrics.get("eval_ne_gap_vs_teacher"))
    if gap is not None:
        text += f" ({100 * gap:+.2f}% NE vs the teacher)"
    return text


def write_html(png: Path, out: Path, title: str, rows: list[tuple]) -> None:
    """A self-contained page: the PNG embedded (base64) and the summary table."""
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    table = "\n".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows
    )
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse}}
th,td{{padding:2px 10px;border-bottom:1px solid #ddd;text-align:left}}img{{max-width:100%}}</style>
</head><body><h2>{html.escape(title)}</h2>
<img alt="curves of the run" src="data:image/png;base64,{data}">
<h3>Summary</h3><table>
{table}
</table></body></html>
"""
    try:
        out.write_text(page)
    except OSError as e:
        raise ReportError(f"{out}: cannot write the page: {e.strerror or e}") from None


def make_report(folder: Path, out: Path | None = None, as_html: bool = False) -> list[Path]:
    """Write ``report.png`` (default: in ``folder``) and, with ``as_html``, ``report.html``
    beside it; returns the files written."""
    events = read_events(folder)
    metrics = read_metrics(folder)
    png = out if out is not None else folder / "report.png"
    if png.suffix.lower() != ".png":
        raise ReportError(f"--out {png}: the report is a PNG: name a file ending in .png")
    if not png.parent.is_dir():
        raise ReportError(f"--out {png}: the folder {png.parent} does not exist")
    title = _title(folder, metrics, events)
    draw(series(events, metrics), png, title)
    written = [png]
    if as_html:
        page = png.with_suffix(".html")
        write_html(png, page, title, summary_rows(metrics, events))
        written.append(page)
    return written


def run_report(args: argparse.Namespace) -> int:
    """``neorec report``: write the report of a run; print what was written."""
    _pyplot()  # the extra is checked before any reading
    folder = find_run(args.run, args.root)
    for path in make_report(folder, Path(args.out) if args.out else None, args.html):
        print(f"wrote {path}")
    return 0
