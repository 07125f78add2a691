"""The command line: ``neorec <command>``, one module per command in ``neorec.cli``.

Every command module registers itself the same way: it is named in ``COMMANDS`` and defines
``HELP`` (its line in ``neorec --help``), ``add_arguments(parser)`` and ``run(args) -> int``. At
module level it imports nothing heavier than the standard library and the config, so ``neorec
--help`` and ``neorec <command> --help`` never load torch; ``run`` imports the work, and
``add_arguments`` what its flags need (``neorec <command>`` adds the flags of that command only). A command
whose flags belong to a tool of its own (``bench NAME ...``, ``data preprocess ...``) also
defines ``passthrough(argv) -> int | None``, which gets them unparsed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Iterable
from types import ModuleType

from neorec.errors import NeorecError

__all__ = ["COMMANDS", "main", "build_parser", "command", "line_buffered"]

COMMANDS = (
    "train",
    "runs",
    "report",
    "eval",
    "predict",
    "export",
    "serve",
    "exfm",
    "plan",
    "bench",
    "data",
    "ckpt",
    "config",
)
"""Each is ``neorec.cli.<name>``."""

EXIT_INTERRUPTED = 130

TORCH_COMMANDS = ("train", "eval", "predict", "export", "serve", "exfm")
"""Commands whose first work is importing PyTorch (most of their start-up: ``load_torch``)."""


def load_torch(after: float | None = None) -> None:
    """Import torch; when that takes more than ``after`` seconds (``neorec.phases.QUIET_S``: a
    busy machine, a cold disk) say so on stdout (stderr holds errors only), and how long it
    took, instead of staying silent. Measured with ``python -X importtime``: importing torch is
    ~90% of ``neorec train``'s start-up; neorec's own modules, numpy included, under a second on
    2 loaded cores."""
    if "torch" in sys.modules:
        return
    import threading
    import time

    from neorec.phases import QUIET_S, fmt_duration

    wait = QUIET_S if after is None else after  # (inf: quiet, as ranks other than 0 are)
    shown = threading.Event()

    def note() -> None:
        shown.set()
        print("neorec: loading PyTorch ...", flush=True)

    t0 = time.monotonic()
    timer = threading.Timer(wait, note)
    timer.daemon = True
    if wait <= 0:
        note()
    elif wait != float("inf"):
        timer.start()
    try:
        import torch  # noqa: F401
    finally:
        timer.cancel()
    if shown.is_set():
        took = fmt_duration(time.monotonic() - t0)
        print(f"neorec: PyTorch loaded in {took}", flush=True)


def command(name: str) -> ModuleType:
    """The module of command ``name``."""
    return importlib.import_module(f"neorec.cli.{name}")


def build_parser(flags_of: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser of every command, with the flags of the commands ``flags_of`` names
    (default: all; the others parse no flags: ``neorec --help`` lists the commands without
    loading what their flags need)."""
    wanted = set(COMMANDS if flags_of is None else flags_of)
    p = argparse.ArgumentParser(prog="neorec", description="Train DLRMs at scale.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        mod = command(name)
        sp = sub.add_parser(name, help=mod.HELP, description=mod.__doc__)
        if name in wanted:
            mod.add_arguments(sp)
        sp.set_defaults(func=mod.run)
    return p


def line_buffered(stream: object = None) -> None:
    """stdout (``stream``) flushed at every line when it is not a terminal (a pipe, a file, CI):
    a long command's lines arrive as they are printed, not in one block at its end."""
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    reconfigure = getattr(stream, "reconfigure", None)
    if reconfigure is not None and not (isatty is not None and isatty()):
        try:
            reconfigure(line_buffering=True)
        except (ValueError, OSError):  # a closed or detached stream: nothing to buffer
            pass


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``neorec`` command.

    A ``NeorecError`` (bad input, config, data, plan, checkpoint) is printed as one line and exits
    with its code (2); Ctrl-C prints one line and exits 130 (a rank of a distributed run stays
    quiet: its launcher prints); anything else is a defect and keeps its traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    line_buffered()
    try:
        if argv[:1] and argv[0] in COMMANDS:
            passthrough = getattr(command(argv[0]), "passthrough", None)
            code = passthrough(argv[1:]) if passthrough is not None else None
            if code is not None:
                return int(code)
        args = build_parser(argv[:1]).parse_args(argv)
        if argv[0] in TORCH_COMMANDS:
            load_torch(None if os.environ.get("RANK", "0") == "0" else float("inf"))
        return int(args.func(args))
    except NeorecError as e:
        print(f"neorec: error: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # the reader of stdout ended (`neorec plan ... | head -1`): its choice
        from neorec.train.tee import silence

        silence(sys.stdout)
        return 0
    except KeyboardInterrupt:
        from neorec.launch.worker import is_worker

        if not is_worker():
            print("neorec: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
