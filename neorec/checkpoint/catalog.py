"""Reading what is stored under a checkpoint root: manifests, listing, latest, chains, verification.

A checkpoint directory is named ``ckpt-<step>-<lineage>-<session>``: ``lineage`` is the run the
checkpoint belongs to (a resumed run keeps the lineage of the checkpoint it resumed from),
``session`` the process group that wrote it. Its manifest records the same lineage and ``seq``, the
write order under the root (one more than the largest ``seq`` there when it was written), so
"latest" means the most recently written checkpoint, never the one with the largest step.

Every manifest carries a SHA-256 of its own canonical JSON: an edited or damaged manifest is an
error, never a silently different checkpoint. Nothing in this module writes or deletes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from neorec.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    CheckpointCorruptError,
    CheckpointError,
    NoCheckpointError,
    check_manifest_checksum,
    one_line,
    verify_bytes,
)
from neorec.checkpoint.storage import FsspecStorage

__all__ = [
    "PREFIX",
    "Entry",
    "parse_name",
    "read_manifest",
    "scan",
    "order_key",
    "chain_problem",
    "list_checkpoints",
    "split_path",
    "resolve_checkpoint",
    "load_chain",
    "read_verified",
    "verify_checkpoint",
    "model_differences",
]

PREFIX = "ckpt-"
REQUIRED = (
    "name",
    "step",
    "kind",
    "policy",
    "chain",
    "baseline",
    "lineage",
    "seq",
    "bits",
    "opt_bits",
    "tables",
    "model",
    "pieces",
    "dense",
    "bytes",
    "rows",
    "created",
)
_NAME = re.compile(r"^ckpt-(\d+)-([0-9a-f]+)-([0-9a-f]+)$")


def parse_name(name: str) -> tuple[int, str, str] | None:
    """(step, lineage, session) of a checkpoint directory name; None if it is not one of ours."""
    m = _NAME.match(name)
    return (int(m.group(1)), m.group(2), m.group(3)) if m else None


def read_manifest(storage: FsspecStorage, name: str) -> dict[str, Any]:
    """The verified manifest of checkpoint ``name``; CheckpointError naming the file otherwise."""
    rel = f"{name}/{MANIFEST}"
    where = storage.path(rel)
    try:
        raw = storage.read(rel)
    except FileNotFoundError:
        if storage.exists(name):
            raise CheckpointError(
                f"{storage.path(name)}: no {MANIFEST} (an unfinished write, or the manifest was "
                f"deleted): not a complete checkpoint"
            ) from None
        raise CheckpointError(f"{storage.path(name)}: no such checkpoint") from None
    except OSError as e:
        raise CheckpointError(f"{where}: cannot read the manifest: {one_line(e)}") from None
    if not raw.strip():
        raise CheckpointCorruptError(f"{where}: empty manifest (the checkpoint is damaged)")
    try:
        m = json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise CheckpointCorruptError(f"{where}: unreadable manifest: {one_line(e)}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{where}: not a {FORMAT} manifest")
    version = m.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: format_version {version!r} is newer than this neorec reads "
            f"({FORMAT_VERSION}); upgrade neorec"
        )
    if version < FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: format_version {version} (an older neorec, manifest without checksum) is "
            f"not read by this neorec (format {FORMAT_VERSION}); start a new run"
        )
    check_manifest_checksum(m, where)
    missing = [k for k in REQUIRED if k not in m]
    if missing:
        raise CheckpointCorruptError(f"{where}: manifest lacks {', '.join(missing)}")
    if m["name"] != name:
        raise CheckpointCorruptError(
            f"{where}: the manifest is of {m['name']} but sits in {name} (renamed or copied "
            f"directory): restore it under its own name"
        )
    if not m["chain"] or m["chain"][-1] != name or m["chain"][0] != m["baseline"]:
        raise CheckpointCorruptError(f"{where}: inconsistent chain {m['chain']}")
    return m


@dataclass
class Entry:
    """One ``ckpt-*`` directory under a root and what it holds."""

    name: str
    status: str  # "complete", "corrupt" (unreadable manifest) or "incomplete" (no manifest)
    manifest: dict[str, Any] | None = None
    problem: str = ""


def scan(storage: FsspecStorage) -> list[Entry]:
    """Every ``ckpt-*`` directory under the root, each classified (nothing is skipped)."""
    out = []
    for name in storage.listdir():
        if not name.startswith(PREFIX):
            continue
        if not storage.exists(f"{name}/{MANIFEST}"):
            out.append(Entry(name, "incomplete", problem=f"no {MANIFEST}"))
            continue
        try:
            out.append(Entry(name, "complete", read_manifest(storage, name)))
        except CheckpointError as e:
            out.append(Entry(name, "corrupt", problem=str(e)))
    return out


def order_key(m: dict[str, Any]) -> tuple[int, float, str]:
    """Write order of a manifest: its sequence number, then its time, then its name."""
    return (int(m["seq"]), float(m["created"]), str(m["name"]))


def chain_problem(by_name: dict[str, Entry], m: dict[str, Any]) -> str:
    """Why the chain of manifest ``m`` cannot be restored from ``by_name`` ('' if it can)."""
    for n in m["chain"][:-1]:
        e = by_name.get(n)
        if e is None:
            return f"its chain needs {n}, which is gone"
        if e.status == "incomplete":
            return f"its chain needs {n}, which has no {MANIFEST}"
        if e.status == "corrupt":
            return f"its chain needs {n}, which is unreadable ({e.problem})"
        assert e.manifest is not None
        if e.manifest["lineage"] != m["lineage"]:
            return f"its chain needs {n}, which belongs to another run"
    return ""


def list_checkpoints(storage: FsspecStorage) -> list[dict[str, Any]]:
    """Manifests of the complete, readable checkpoints under the root, oldest write first.

    Unreadable ones are left out here; ``scan`` (and ``neorec ckpt ls``) shows them.
    """
    ms = [e.manifest for e in scan(storage) if e.manifest is not None]
    return sorted(ms, key=order_key)


def split_path(path: str) -> tuple[str, str | None]:
    """(root, checkpoint name or None) of a root directory or a checkpoint directory path."""
    p = path.rstrip("/")
    head, _, tail = p.rpartition("/")
    if tail.startswith(PREFIX):
        return head or ".", tail
    return p, None


def resolve_checkpoint(storage: FsspecStorage, name: str | None) -> str:
    """``name`` itself, or (None / 'latest') the most recently written checkpoint.

    The latest must be restorable: an unreadable manifest anywhere under the root (the latest
    cannot be told), or a latest whose chain is broken, is an error; never an older one instead.
    ``NoCheckpointError`` when the root holds no complete checkpoint.
    """
    if name not in (None, "latest"):
        return str(name)
    url = storage.url
    if not storage.exists(""):
        raise NoCheckpointError(f"no checkpoint under {url} (no such directory)")
    entries = scan(storage)
    corrupt = [e for e in entries if e.status == "corrupt"]
    if corrupt:
        raise CheckpointCorruptError(
            f"{corrupt[0].problem}; with an unreadable checkpoint under {url} the latest cannot "
            f"be told: remove {storage.path(corrupt[0].name)} or resume a checkpoint by its path"
        )
    complete = sorted((e.manifest for e in entries if e.manifest is not None), key=order_key)
    if not complete:
        n = sum(e.status == "incomplete" for e in entries)
        more = f" ({n} unfinished director{'y' if n == 1 else 'ies'} without a manifest)"
        raise NoCheckpointError(f"no checkpoint under {url}{more if n else ''}")
    latest = complete[-1]
    problem = chain_problem({e.name: e for e in entries}, latest)
    if problem:
        raise CheckpointError(
            f"latest checkpoint {storage.path(latest['name'])} (step {latest['step']}) cannot "
            f"be restored: {problem}; resume an older one by its path (neorec ckpt ls {url}) "
            f"or start a new run"
        )
    return str(latest["name"])


def load_chain(storage: FsspecStorage, name: str) -> list[dict[str, Any]]:
    """Manifests of the chain that restores ``name``: baseline first, ``name`` last."""
    m = read_manifest(storage, name)
    out = []
    for n in m["chain"][:-1]:
        try:
            c = read_manifest(storage, n)
        except CheckpointError as e:
            raise type(e)(
                f"checkpoint {name} cannot be restored: its chain needs {n}: {e}"
            ) from None
        if c["lineage"] != m["lineage"]:
            raise CheckpointCorruptError(
                f"checkpoint {name} cannot be restored: its chain needs {n}, which belongs to "
                f"another run (lineage {c['lineage']} != {m['lineage']})"
            )
        out.append(c)
    return [*out, m]


def read_verified(storage: FsspecStorage, ckpt: str, entry: dict[str, Any]) -> bytes:
    """The bytes of one file of checkpoint ``ckpt``, checked against its manifest entry."""
    rel = f"{ckpt}/{entry['file']}"
    try:
        data = storage.read(rel)
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"{storage.path(rel)}: listed in the manifest but missing"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{storage.path(rel)}: cannot read: {one_line(e)}") from None
    verify_bytes(data, entry, storage.path(rel))
    return data


def verify_checkpoint(storage: FsspecStorage, name: str) -> dict[str, int]:
    """Read every file of the chain of ``name`` and check its size and checksum."""
    files = nbytes = 0
    for m in load_chain(storage, name):
        for entry in [*m["pieces"], *(m.get("dynamic") or []), m["dense"]]:
            nbytes += len(read_verified(storage, m["name"], entry))
            files += 1
    return {"files": files, "bytes": nbytes}


def _few(names: list[str], limit: int = 4) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _only_on_one_side(saved: dict[str, Any], current: dict[str, Any], what: str) -> list[str]:
    """Lines naming the keys only the checkpoint has, and those only this model has."""
    out = []
    for keys, where in (
        ([k for k in saved if k not in current], "the checkpoint"),
        ([k for k in current if k not in saved], "this model"),
    ):
        if keys:
            out.append(f"{what} only in {where}: {_few(keys)}")
    return out


def model_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Every way the model a checkpoint describes differs from ``current`` (same layout).

    Keys missing from either side (e.g. dense shapes before the model is built) are not compared.
    """
    out: list[str] = []
    st, ct = saved.get("tables", {}), current.get("tables", {})
    if list(st) != list(ct):
        missing = _only_on_one_side(st, ct, "tables")
        out += missing or [f"table order {list(st)} != {list(ct)}"]
    for t in (t for t in st if t in ct):
        for k in ("rows", "dim", "features"):
            if k in st[t] and k in ct[t] and st[t][k] != ct[t][k]:
                out.append(f"table {t} {k} {st[t][k]} != {ct[t][k]}")
    for key, label in (
        ("pooling", "embedding.pooling"),
        ("embedding_optimizer", "embedding.optimizer"),
        ("dense_optimizer", "train.dense_optimizer"),
    ):
        if key in saved and key in current and saved[key] != current[key]:
            out.append(f"{label} {saved[key]} != {current[key]}")
    sm, cm = saved.get("model_config", {}), current.get("model_config", {})
    for k in (k for k in sm if k in cm and sm[k] != cm[k]):
        out.append(f"model.{k} {sm[k]} != {cm[k]}")
    sd, cd = saved.get("dense"), current.get("dense")
    if sd is not None and cd is not None:
        out += _only_on_one_side(sd, cd, "dense parameters")
        shapes = [f"{k} {sd[k]} != {cd[k]}" for k in sd if k in cd and sd[k] != cd[k]]
        if shapes:
            out.append(f"dense shapes (model.bottom_mlp / top_mlp / interaction): {_few(shapes)}")
    return out
