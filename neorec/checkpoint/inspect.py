"""``neorec ckpt ls ROOT`` and ``neorec ckpt inspect PATH``: chains, sizes, bits, restore reads."""

from __future__ import annotations

import sys
from typing import TextIO

from neorec.checkpoint.catalog import (
    chain_problem,
    load_chain,
    order_key,
    resolve_checkpoint,
    scan,
    split_path,
    verify_checkpoint,
)
from neorec.checkpoint.format import NoCheckpointError
from neorec.checkpoint.storage import open_storage

__all__ = ["format_ls", "format_inspect", "run_ckpt_command"]


def _mb(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def format_ls(root: str) -> str:
    """One line per checkpoint directory under ``root``, in write order; unreadable, unfinished
    and broken-chain ones are listed and marked, never skipped. A missing root is an error."""
    storage = open_storage(root, fsync=False)
    if not storage.exists(""):
        raise NoCheckpointError(f"{root}: no such checkpoint directory")
    entries = scan(storage)
    by_name = {e.name: e for e in entries}
    ckpts = sorted((e.manifest for e in entries if e.manifest is not None), key=order_key)
    lines = [
        f"{'name':<34} {'step':>8} {'kind':<9} {'policy':<11} {'bits':>4} {'opt':>4} "
        f"{'rows':>10} {'size':>12} {'chain':>5} {'restore reads':>14}"
    ]
    broken = 0
    for m in ckpts:
        chain = [by_name[n].manifest for n in m["chain"] if n in by_name]
        reads = sum(c["bytes"] for c in chain if c is not None)
        problem = chain_problem(by_name, m)
        broken += bool(problem)
        lines.append(
            f"{m['name']:<34} {m['step']:>8} {m['kind']:<9} {m['policy']:<11} {m['bits']:>4} "
            f"{m['opt_bits']:>4} {m['rows']:>10,} {_mb(m['bytes']):>12} {len(m['chain']):>5} "
            f"{_mb(reads):>14}{f'  (BROKEN: {problem})' if problem else ''}"
        )
    for e in entries:
        if e.status == "corrupt":
            lines.append(f"{e.name:<34} (CORRUPT: {e.problem})")
        elif e.status == "incomplete":
            lines.append(f"{e.name:<34} (unfinished: no manifest; not a checkpoint)")
    bad = sum(e.status == "corrupt" for e in entries)
    unfinished = sum(e.status == "incomplete" for e in entries)
    total = sum(m["bytes"] for m in ckpts)
    lines.append(
        f"{len(ckpts)} checkpoints, {_mb(total)} held under {root}"
        + (f"; {broken} BROKEN (chain incomplete)" if broken else "")
        + (f"; {bad} CORRUPT" if bad else "")
        + (f"; {unfinished} unfinished" if unfinished else "")
    )
    return "\n".join(lines)


def format_inspect(path: str, verify: bool = False) -> str:
    """Manifest summary of one checkpoint (or a root's latest): chain, tables, what restore reads."""
    root, name = split_path(path)
    storage = open_storage(root, fsync=False)
    name = resolve_checkpoint(storage, name)
    chain = load_chain(storage, name)
    m = chain[-1]
    lines = [
        f"checkpoint {storage.path(name)}",
        f"  format {m['format']} v{m['format_version']}, step {m['step']}, {m['kind']} "
        f"({m['policy']}), world_size {m['world_size']}, optimizer {m['optimizer']}",
        f"  run lineage {m['lineage']}, write #{m['seq']}",
        f"  embeddings {m['bits']} bits{' (adaptive range)' if m['adaptive_range'] else ''}, "
        f"optimizer state {m['opt_bits'] or 'not stored'}{' bits' if m['opt_bits'] else ''}, "
        f"snapshot pause {m['snapshot_ms']:.1f} ms, write {m['write_s']:.2f} s",
        "  chain (restore applies in this order):",
    ]
    for c in chain:
        lines.append(
            f"    {c['name']:<30} step {c['step']:>8} {c['kind']:<9} {len(c['pieces']):>5} pieces "
            f"{c['rows']:>10,} rows {_mb(c['bytes']):>12}"
        )
    lines.append(
        f"  {'table':<16} {'rows':>12} {'dim':>4} {'pieces':>7} {'rows read':>12} {'reads':>12}"
    )
    for t, spec in m["tables"].items():
        ps = [p for c in chain for p in c["pieces"] if p["table"] == t]
        lines.append(
            f"  {t:<16} {spec['rows']:>12,} {spec['dim']:>4} {len(ps):>7} "
            f"{sum(p['n'] for p in ps):>12,} {_mb(sum(p['bytes'] for p in ps)):>12}"
        )
    total = sum(c["bytes"] for c in chain)
    lines.append(
        f"  restore reads {_mb(total)} in {sum(len(c['pieces']) + 1 for c in chain)} files"
    )
    lines.append(
        "  (one process; a rank of a sharded run reads only the pieces its shards overlap)"
    )
    if verify:
        v = verify_checkpoint(storage, name)
        lines.append(f"  verified: {v['files']} files, {_mb(v['bytes'])}, sizes and crc32 match")
    return "\n".join(lines)


def run_ckpt_command(
    action: str, path: str, verify: bool = False, out: TextIO | None = None
) -> int:
    """The ``neorec ckpt`` subcommand; a CheckpointError propagates (the CLI: one line, exit 2)."""
    out = out or sys.stdout
    text = format_ls(path) if action == "ls" else format_inspect(path, verify)
    print(text, file=out)
    return 0
