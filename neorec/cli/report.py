"""``neorec report RUN``: a run's curves as one PNG (and, with ``--html``, a small page)."""

from __future__ import annotations

import argparse

HELP = "plot a run's curves: report.png (and --html)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``neorec report``."""
    p.add_argument("run", metavar="RUN", help="a run folder, a run name under --root, or 'latest'")
    p.add_argument("--root", default="runs", help="the runs folder (train.runs_dir; default runs)")
    p.add_argument("--out", metavar="FILE.png", help="where to write (default: RUN/report.png)")
    p.add_argument(
        "--html", action="store_true", help="also a self-contained report.html beside the PNG"
    )


def run(args: argparse.Namespace) -> int:
    """Write the report of a run; print what was written."""
    from neorec.train.report import run_report

    return run_report(args)
