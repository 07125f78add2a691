"""``neorec exfm``: ExFM on a stream: the FM window by window, DAS logits, the student."""

from __future__ import annotations

import argparse

HELP = "ExFM on a stream: FM window by window, DAS logits, the distilled student"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``neorec exfm``."""
    p.add_argument("--config", default="configs/exfm_stream.toml", help="stream + student")
    p.add_argument("--fm-config", default="configs/exfm_fm.toml", help="the FM (same stream)")
    p.add_argument("--windows", type=int, default=0, help="windows (0 = data.windows)")
    p.add_argument("--out", default="runs/exfm", help="new or empty folder for models and DAS")
    p.add_argument("--set", action="append", default=[], help="student override section.key=v")
    p.add_argument("--fm-set", action="append", default=[], help="FM override section.key=v")


def run(args: argparse.Namespace) -> int:
    """Check everything, run the chain, print a table and a JSON line."""
    from neorec.train.exfm import run_exfm

    return run_exfm(args)
