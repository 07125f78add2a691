"""CheckpointManager: snapshot in memory, write in the background, commit by manifest, restore.

One ``save`` (every rank, same step)::

    wait for the previous write --> take dirty-row masks --> decide baseline / increment (same
    decision on every rank) --> copy rows + dense state (the only pause of training) --> background
    thread: encode pieces, write each under a temporary name + rename --> rank 0 gathers the piece
    lists, writes manifest.json last --> drops checkpoints outside the last ``keep_last`` baselines

Policies: ``full`` (always a baseline); ``one_shot`` (rows changed since the baseline); ``consecutive``
(rows changed since the previous checkpoint; restore replays the chain); ``adaptive`` (consecutive,
but a new baseline whenever replaying the chain would cost more than ``adaptive_threshold`` x a
baseline). Restore reads baseline + chain, and only the pieces that intersect this rank's shards.
"""

from __future__ import annotations

import copy
import io
import json
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from neorec.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    checksum,
    decode_piece,
    encode_piece,
    row_bytes,
    verify_bytes,
)
from neorec.checkpoint.storage import FsspecStorage, open_storage
from neorec.checkpoint.tracker import DP, DirtyRowTracker, LocalBlock, local_blocks
from neorec.config import CheckpointConfig

__all__ = [
    "CheckpointManager",
    "list_checkpoints",
    "resolve_checkpoint",
    "read_manifest",
    "load_chain",
    "verify_checkpoint",
    "split_path",
]

PREFIX = "ckpt-"


# ---- reading ---------------------------------------------------------------------------------
def read_manifest(storage: FsspecStorage, name: str) -> dict[str, Any]:
    """The manifest of checkpoint ``name`` (CheckpointError if missing or of a newer version)."""
    rel = f"{name}/{MANIFEST}"
    try:
        m: dict[str, Any] = json.loads(storage.read(rel))
    except FileNotFoundError:
        raise CheckpointError(f"{storage.path(name)}: no {MANIFEST} (incomplete)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{storage.path(rel)}: unreadable manifest: {e}") from None
    if m.get("format") != FORMAT:
        raise CheckpointError(f"{storage.path(rel)}: not a {FORMAT} manifest")
    if int(m.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{storage.path(rel)}: format_version {m['format_version']} is newer than this "
            f"neorec reads ({FORMAT_VERSION})"
        )
    return m


def list_checkpoints(storage: FsspecStorage) -> list[dict[str, Any]]:
    """Manifests of the complete checkpoints under the root, oldest first."""
    out = []
    for name in storage.listdir():
        if name.startswith(PREFIX) and storage.exists(f"{name}/{MANIFEST}"):
            try:
                out.append(read_manifest(storage, name))
            except CheckpointError:
                continue
    return sorted(out, key=lambda m: (m["step"], m["created"]))


def split_path(path: str) -> tuple[str, str | None]:
    """(root, checkpoint name or None) of a root directory or a checkpoint directory path."""
    p = path.rstrip("/")
    head, _, tail = p.rpartition("/")
    if tail.startswith(PREFIX):
        return head or ".", tail
    return p, None


def resolve_checkpoint(storage: FsspecStorage, name: str | None) -> str:
    """``name`` itself, or (None / 'latest') the newest checkpoint whose whole chain is present."""
    if name not in (None, "latest"):
        return str(name)
    complete = list_checkpoints(storage)
    names = {m["name"] for m in complete}
    for m in reversed(complete):
        if all(n in names for n in m["chain"]):
            return str(m["name"])
    raise CheckpointError(f"no complete checkpoint under {storage.url}")


def load_chain(storage: FsspecStorage, name: str) -> list[dict[str, Any]]:
    """Manifests of the chain that restores ``name``: baseline first, ``name`` last."""
    m = read_manifest(storage, name)
    return [read_manifest(storage, n) for n in m["chain"][:-1]] + [m]


def _read_verified(storage: FsspecStorage, ckpt: str, entry: dict[str, Any]) -> bytes:
    rel = f"{ckpt}/{entry['file']}"
    try:
        data = storage.read(rel)
    except FileNotFoundError:
        raise CheckpointError(f"{storage.path(rel)}: listed in the manifest but missing") from None
    verify_bytes(data, entry, storage.path(rel))
    return data


def verify_checkpoint(storage: FsspecStorage, name: str) -> dict[str, int]:
    """Read every file of the chain of ``name`` and check its size and checksum."""
    files = nbytes = 0
    for m in load_chain(storage, name):
        for entry in [*m["pieces"], m["dense"]]:
            nbytes += len(_read_verified(storage, m["name"], entry))
            files += 1
    return {"files": files, "bytes": nbytes}


# ---- snapshots -------------------------------------------------------------------------------
@dataclass
class _BlockSnap:
    block: LocalBlock
    ids: Tensor | None  # block-local rows (None = all)
    weight: Tensor
    state: dict[str, Tensor]


@dataclass
class _Snapshot:
    name: str
    step: int
    kind: str
    chain: list[str]
    blocks: list[_BlockSnap]
    dense: dict[str, Any] | None
    est_bytes: float
    pause_ms: float
    meta: dict[str, Any] = field(default_factory=dict)


def _clone(obj: Any) -> Any:
    """A deep copy with tensors detached and cloned (a point-in-time snapshot)."""
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return copy.deepcopy(obj)


def _dense_module(model: nn.Module) -> nn.Module:
    dense: nn.Module = model.dense_arch  # type: ignore[assignment]
    return getattr(dense, "module", dense)  # DDP wraps the real module


class CheckpointManager:
    """Check-N-Run checkpoints of a (sharded or unsharded) DLRM and its dense optimizer."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        model: nn.Module,
        dense_opt: torch.optim.Optimizer,
        root: str,
    ) -> None:
        self.cfg = cfg
        self.storage = open_storage(root, fsync=cfg.fsync)
        self.model = model
        self.ebc: Any = model.ebc
        self.opt = dense_opt
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.blocks = local_blocks(self.ebc, self.rank)
        self.tracker = DirtyRowTracker(self.ebc)
        self._since = self.tracker.take()  # rows changed since the end of the prefix
        self._prefix: list[str] = []  # chain the next increment extends ([] = next is a baseline)
        self._prefix_cost = 0.0  # estimated bytes of the increments in the prefix
        self._since_baseline = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.history: list[dict[str, Any]] = []
        self._group: Any = None
        self._wgroup: Any = None
        if self.rank == 0:
            self._remove_incomplete()
        run = [uuid.uuid4().hex[:8]]
        if self.distributed:
            # Own groups: the training thread's collectives and the writer thread's never mix.
            self._group = dist.new_group(backend="gloo")
            self._wgroup = dist.new_group(backend="gloo")
            dist.broadcast_object_list(run, src=0, group=self._group)
        self.run_id = run[0]
        self._base_cost = self._all_reduce_sum([self._block_bytes(None)])[0]

    # ---- helpers -------------------------------------------------------------------------
    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.distributed:
            dist.all_reduce(t, group=self._group)
        return [float(x) for x in t]

    def _state_keys(self, b: LocalBlock) -> list[str]:
        if self.cfg.opt_bits == 0:
            return []
        # a row's momentum1 is the same on every column slice: the first slice stores it
        return [k for k in b.state if k != "momentum1" or b.col_start == 0]

    def _block_bytes(self, masks: dict[str, Tensor] | None) -> float:
        """Estimated bytes this rank writes: every row (None) or the rows in ``masks``."""
        total = 0.0
        for b in self.blocks:
            if not b.writer:
                continue
            keys = self._state_keys(b)
            per = row_bytes(
                b.col_end - b.col_start,
                self.cfg.bits,
                sum(k != "momentum1" for k in keys),
                sum(k == "momentum1" for k in keys),
                self.cfg.opt_bits,
            )
            if masks is None:
                total += per * b.rows
            else:
                n = int(masks[b.space][b.space_offset : b.space_offset + b.rows].sum())
                total += (per + 4) * n
        return total

    def _remove_incomplete(self) -> None:
        """Drop leftovers of writes that never committed (a crash); run before anyone writes."""
        for name in self.storage.listdir():
            if name.startswith(PREFIX) and not self.storage.exists(f"{name}/{MANIFEST}"):
                self.storage.remove(name)

    # ---- saving ----------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until the background write (if any) has committed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"checkpoint write failed: {err}") from err

    def close(self) -> None:
        """Finish outstanding writes."""
        self.wait()

    def _decide(self, est: float) -> str:
        cfg = self.cfg
        if not self._prefix or cfg.policy == "full":
            return "baseline"
        if cfg.full_every and self._since_baseline >= cfg.full_every:
            return "baseline"
        if cfg.policy == "adaptive":
            replay = self._prefix_cost + est
            if replay > cfg.adaptive_threshold * self._base_cost:
                return "baseline"
        return "increment"

    def save(self, step: int, extra: dict[str, Any] | None = None) -> float:
        """Checkpoint now (every rank, same step); returns the training pause in ms."""
        t0 = time.perf_counter()
        self.wait()
        new = self.tracker.take()
        if DP in new and self.distributed:
            # replicas: a row touched on any rank changed everywhere
            m = new[DP].to(torch.uint8)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self._group)
            new[DP] = m.bool()
        for k in self._since:
            self._since[k] |= new[k]
        (est,) = self._all_reduce_sum([self._block_bytes(self._since)])
        kind = self._decide(est)
        name = f"{PREFIX}{step:010d}-{self.run_id}"
        chain = [name] if kind == "baseline" else [*self._prefix, name]
        cost = est if kind != "baseline" else 0.0
        snap = _Snapshot(name, step, kind, chain, self._snap_blocks(kind), None, cost, 0.0)
        if self.rank == 0:
            snap.dense = self._snap_dense(extra or {})
        self._advance(kind, name, chain, est)
        snap.pause_ms = (time.perf_counter() - t0) * 1e3
        if self.cfg.async_write:
            self._thread = threading.Thread(target=self._write_guarded, args=(snap,), daemon=True)
            self._thread.start()
        else:
            self._write_guarded(snap)
            self.wait()
        return snap.pause_ms

    def _advance(self, kind: str, name: str, chain: list[str], est: float) -> None:
        """Move the prefix and the since-prefix masks past the checkpoint just taken."""
        if kind == "baseline":
            self._prefix, self._prefix_cost, self._since_baseline = [name], 0.0, 0
        elif self.cfg.policy != "one_shot":
            self._prefix, self._prefix_cost = chain, self._prefix_cost + est
        self._since_baseline += kind != "baseline"
        if kind == "baseline" or self.cfg.policy != "one_shot":
            self._since = {k: torch.zeros_like(v) for k, v in self._since.items()}

    def _snap_blocks(self, kind: str) -> list[_BlockSnap]:
        out = []
        for b in self.blocks:
            if not b.writer:
                continue
            keys = self._state_keys(b)
            if kind == "baseline":
                out.append(
                    _BlockSnap(b, None, b.weight.clone(), {k: b.state[k].clone() for k in keys})
                )
                continue
            ids = self._since[b.space][b.space_offset : b.space_offset + b.rows].nonzero()
            ids = ids.squeeze(1)
            out.append(_BlockSnap(b, ids, b.weight[ids], {k: b.state[k][ids] for k in keys}))
        return out

    def _snap_dense(self, extra: dict[str, Any]) -> dict[str, Any]:
        ebc = self.ebc
        steps = [int(ebc.step)] + ([int(ebc.dp_step)] if hasattr(ebc, "dp_step") else [])
        return {
            "dense": _clone(_dense_module(self.model).state_dict()),
            "optimizer": _clone(self.opt.state_dict()),
            "emb_step": max(steps),
            "extra": _clone(extra),
        }

    # ---- background writer ------------------------------------------------------------------
    def _write_guarded(self, snap: _Snapshot) -> None:
        try:
            self._write(snap)
        except BaseException as e:  # surfaced by the next wait()
            self._error = e

    def _pieces(self, snap: _Snapshot) -> list[dict[str, Any]]:
        cfg, out = self.cfg, []
        for s in snap.blocks:
            b = s.block
            lo = b.row_start
            while lo < b.row_end:
                hi = min(b.row_end, (lo // cfg.chunk_rows + 1) * cfg.chunk_rows)
                a, z = lo - b.row_start, hi - b.row_start
                if s.ids is None:
                    ids, w, st = None, s.weight[a:z], {k: v[a:z] for k, v in s.state.items()}
                else:
                    sel = (s.ids >= a) & (s.ids < z)
                    ids = s.ids[sel] - a
                    w, st = s.weight[sel], {k: v[sel] for k, v in s.state.items()}
                lo = hi
                if ids is not None and ids.numel() == 0:
                    continue
                data = encode_piece(w, st, ids, z - a, cfg.bits, cfg.opt_bits, cfg.adaptive_range)
                rel = f"emb/{b.table}/r{b.row_start + a}-{b.row_start + z}.c{b.col_start}-{b.col_end}.bin"
                self.storage.write_atomic(f"{snap.name}/{rel}", data)
                out.append(
                    {
                        "table": b.table,
                        "file": rel,
                        "rows": [b.row_start + a, b.row_start + z],
                        "cols": [b.col_start, b.col_end],
                        "n": int(w.shape[0]),
                        "dense": ids is None,
                        "state": sorted(st),
                        "bytes": len(data),
                        "crc32": checksum(data),
                    }
                )
        return out

    def _write(self, snap: _Snapshot) -> None:
        t0 = time.perf_counter()
        error, pieces = "", []
        try:
            pieces = self._pieces(snap)
            dense_entry = None
            if snap.dense is not None:
                buf = io.BytesIO()
                torch.save(snap.dense, buf)
                data = buf.getvalue()
                self.storage.write_atomic(f"{snap.name}/dense.pt", data)
                dense_entry = {"file": "dense.pt", "bytes": len(data), "crc32": checksum(data)}
        except Exception as e:
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
        parts: list[Any] = [(pieces, error)]
        if self.distributed:
            gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
            dist.gather_object(parts[0], gathered, dst=0, group=self._wgroup)
            parts = gathered or []
        if self.rank != 0:
            if error:
                raise CheckpointError(error)
            return
        errors = [e for _, e in parts if e]
        if errors:
            raise CheckpointError("; ".join(errors))
        all_pieces = [p for ps, _ in parts for p in ps]
        manifest = self._manifest(snap, all_pieces, dense_entry, time.perf_counter() - t0)
        self.storage.write_atomic(
            f"{snap.name}/{MANIFEST}", json.dumps(manifest, indent=1).encode()
        )
        self.history.append(manifest)
        self._retain()

    def _manifest(
        self, snap: _Snapshot, pieces: list[dict[str, Any]], dense: Any, write_s: float
    ) -> dict[str, Any]:
        cfg = self.cfg
        tables = {t.name: {"rows": t.rows, "dim": t.dim} for t in self.ebc.tables}
        nbytes = sum(p["bytes"] for p in pieces) + (dense["bytes"] if dense else 0)
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "name": snap.name,
            "step": snap.step,
            "kind": snap.kind,
            "policy": cfg.policy,
            "chain": snap.chain,
            "baseline": snap.chain[0],
            "parent": snap.chain[-2] if len(snap.chain) > 1 else None,
            "bits": cfg.bits,
            "adaptive_range": cfg.adaptive_range and cfg.bits <= 4,
            "opt_bits": cfg.opt_bits,
            "optimizer": self.ebc.optimizer.kind,
            "chunk_rows": cfg.chunk_rows,
            "world_size": self.world,
            "tables": tables,
            "pieces": pieces,
            "dense": dense,
            "bytes": nbytes,
            "rows": sum(p["n"] for p in pieces),
            "est_bytes": snap.est_bytes,
            "snapshot_ms": round(snap.pause_ms, 3),
            "write_s": round(write_s, 4),
            "created": time.time(),
        }

    def _retain(self) -> None:
        """Keep the last ``keep_last`` baselines and every checkpoint built on them."""
        ckpts = list_checkpoints(self.storage)
        baselines = [m["name"] for m in ckpts if m["kind"] == "baseline"]
        keep = set(baselines[-self.cfg.keep_last :])
        doomed = [m for m in ckpts if m["baseline"] not in keep]
        # increments before baselines, manifest before files: never a visible orphan increment
        for m in sorted(doomed, key=lambda m: m["kind"] == "baseline"):
            self.storage.remove(f"{m['name']}/{MANIFEST}")
            self.storage.remove(m["name"])

    # ---- restoring ---------------------------------------------------------------------------
    def restore(self, which: str = "latest") -> dict[str, Any]:
        """Load a checkpoint (a name, a path, or 'latest') into the model; returns its extra state."""
        storage, name = self.storage, None
        if which.startswith(PREFIX) and "/" not in which:
            name = which  # a checkpoint of our own root
        elif which != "latest":
            root, name = split_path(which)
            storage = open_storage(root, fsync=False)
        name = resolve_checkpoint(storage, name)
        chain = load_chain(storage, name)
        restore_embeddings(storage, chain, self.blocks)
        dense = torch.load(
            io.BytesIO(_read_verified(storage, name, chain[-1]["dense"])), weights_only=True
        )
        _dense_module(self.model).load_state_dict(dense["dense"])
        self.opt.load_state_dict(dense["optimizer"])
        self.ebc.step.fill_(dense["emb_step"])
        if hasattr(self.ebc, "dp_step"):
            self.ebc.dp_step.fill_(dense["emb_step"])
        self.tracker.take()
        self._since = {k: torch.zeros_like(v) for k, v in self._since.items()}
        last, cfg = chain[-1], self.cfg
        same = (last["bits"], last["opt_bits"]) == (cfg.bits, cfg.opt_bits)
        # an increment must extend a chain stored the same way and in this root
        if same and storage.root == self.storage.root and cfg.policy != "full":
            self._prefix = list(last["chain"])
            self._prefix_cost = sum(m["est_bytes"] for m in chain[1:])
            self._since_baseline = len(chain) - 1
        else:
            self._prefix = []
        return dict(dense["extra"])


def _apply(piece_meta: dict[str, Any], dec: Any, b: LocalBlock) -> None:
    """Copy the rows of a decoded piece that fall in block ``b`` (per-row state: any columns)."""
    r0, r1 = piece_meta["rows"]
    c0, c1 = piece_meta["cols"]
    g = torch.arange(r0, r1) if dec.ids is None else dec.ids + r0
    sel = (g >= b.row_start) & (g < b.row_end)
    rows = g[sel] - b.row_start
    a, z = max(c0, b.col_start), min(c1, b.col_end)
    if a < z:
        b.weight[rows, a - b.col_start : z - b.col_start] = dec.weight[sel][:, a - c0 : z - c0]
    for k, v in dec.state.items():
        if k not in b.state:
            continue
        if v.dim() == 1:
            b.state[k][rows] = v[sel]
        elif a < z:
            b.state[k][rows, a - b.col_start : z - b.col_start] = v[sel][:, a - c0 : z - c0]


def _overlaps(p: dict[str, Any], b: LocalBlock) -> bool:
    """Piece ``p`` holds rows of ``b``: overlapping columns, or a per-row state ``b`` needs."""
    (r0, r1), (c0, c1) = p["rows"], p["cols"]
    if p["table"] != b.table or r1 <= b.row_start or b.row_end <= r0:
        return False
    return (c0 < b.col_end and b.col_start < c1) or (
        "momentum1" in p["state"] and ("momentum1" in b.state)
    )


def _area(p: dict[str, Any], b: LocalBlock) -> int:
    r = min(p["rows"][1], b.row_end) - max(p["rows"][0], b.row_start)
    c = min(p["cols"][1], b.col_end) - max(p["cols"][0], b.col_start)
    return max(r, 0) * max(c, 0)


def restore_embeddings(
    storage: FsspecStorage, chain: list[dict[str, Any]], blocks: list[LocalBlock]
) -> int:
    """Apply baseline + increments to ``blocks``, reading only overlapping pieces; bytes read."""
    base = chain[0]
    for b in blocks:
        spec = base["tables"].get(b.table)
        if spec is None:
            raise CheckpointError(f"table '{b.table}' is not in checkpoint {base['name']}")
        if b.row_end > spec["rows"] or b.col_end > spec["dim"]:
            raise CheckpointError(
                f"table '{b.table}': checkpoint has {spec['rows']}x{spec['dim']}, "
                f"the model needs rows [{b.row_start}, {b.row_end}) cols [{b.col_start}, {b.col_end})"
            )
        for s in b.state.values():
            s.zero_()  # state the checkpoint does not store restarts from zero
    covered = [0] * len(blocks)
    nbytes = 0
    for m in chain:
        for p in m["pieces"]:
            hits = [i for i, b in enumerate(blocks) if _overlaps(p, b)]
            if not hits:
                continue
            data = _read_verified(storage, m["name"], p)
            nbytes += len(data)
            dec = decode_piece(data, storage.path(f"{m['name']}/{p['file']}"))
            for i in hits:
                _apply(p, dec, blocks[i])
                if m is base:
                    covered[i] += _area(p, blocks[i])
    for b, c in zip(blocks, covered):
        if c != b.rows * (b.col_end - b.col_start):
            raise CheckpointError(
                f"table '{b.table}' rows [{b.row_start}, {b.row_end}) cols [{b.col_start}, "
                f"{b.col_end}): the baseline {base['name']} does not cover them"
            )
    return nbytes


def rng_state() -> dict[str, Any]:
    """Torch, Python and NumPy RNG states (JSON/tensor only, for ``weights_only`` loading)."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = cast(tuple, np.random.get_state())
        out["numpy"] = [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``rng_state``."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
