"""``neorec ckpt ls | inspect``: Check-N-Run checkpoints, their chains, sizes and bits."""

from __future__ import annotations

import argparse

HELP = "list or inspect Check-N-Run checkpoints"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``neorec ckpt``."""
    p.add_argument("action", choices=["ls", "inspect"])
    p.add_argument("path", help="checkpoint root (ls) or a checkpoint / 'ROOT' for its latest")
    p.add_argument("--verify", action="store_true", help="inspect: read and checksum every file")


def run(args: argparse.Namespace) -> int:
    """List or inspect."""
    from neorec.checkpoint.inspect import run_ckpt_command

    return run_ckpt_command(args.action, args.path, args.verify)
