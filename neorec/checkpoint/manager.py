"""CheckpointManager: snapshot in memory, write in the background, commit by manifest, restore.

One ``save`` (every rank, same step)::

    wait for the previous write --> take dirty-row masks --> decide baseline / increment (same
    decision on every rank) --> copy rows + dense state (the only pause of training; a dram/ssd
    table: its resident rows only, ``snapshot``) --> background thread: read the rest of the
    dram/ssd rows from their stores, encode pieces, write each under a temporary name + rename
    --> rank 0 gathers the piece lists, writes manifest.json last --> drops this run's
    checkpoints outside its last ``keep_last`` baseline families

Each run has a lineage (a fresh run's own id; a resumed run keeps the checkpoint's): it is in every
checkpoint's name and manifest, and retention and the cleaning of unfinished directories touch only
the run's own lineage, never another run's checkpoints under the same root.

Policies: ``full`` (always a baseline); ``one_shot`` (rows changed since the baseline); ``consecutive``
(rows changed since the previous checkpoint; restore replays the chain); ``adaptive`` (consecutive,
but a new baseline whenever replaying the chain would cost more than ``adaptive_threshold`` x a
baseline). Restore reads baseline + chain, and only the pieces that intersect this rank's shards,
after checking that the checkpoint describes this model (``restore.check_model``). Reading and
listing are in ``catalog``, the restore arithmetic in ``restore``.
"""

from __future__ import annotations

import io
import threading
import time
import uuid
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from neorec.checkpoint.catalog import (
    PREFIX,
    list_checkpoints,
    load_chain,
    order_key,
    parse_name,
    read_manifest,
    resolve_checkpoint,
    scan,
    split_path,
    verify_checkpoint,
)
from neorec.checkpoint.dynamic import (
    DynamicCheckpoints,
    dynamic_part,
    fixed_part,
    restore_dynamic,
    set_steps,
)
from neorec.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    checksum,
    row_bytes,
    seal_manifest,
)
from neorec.checkpoint.restore import (
    apply_dense,
    check_model,
    dense_module,
    describe_model,
    load_dense,
    model_tables,
    restore_embeddings,
    rng_state,
    set_rng_state,
)
from neorec.checkpoint.snapshot import (
    BlockSnap,
    Snapshot,
    TieredSnap,
    clone,
    snap_block,
    write_pieces,
)
from neorec.checkpoint.stateful import Stateful, load_states, merged_state
from neorec.checkpoint.storage import open_storage
from neorec.checkpoint.tracker import DP, DirtyRowTracker, LocalBlock, local_blocks
from neorec.config import CheckpointConfig
from neorec.modules.collection import EmbeddingCollection

__all__ = [
    "CheckpointManager",
    "list_checkpoints",
    "resolve_checkpoint",
    "read_manifest",
    "load_chain",
    "verify_checkpoint",
    "split_path",
    "rng_state",
    "set_rng_state",
    "PREFIX",
]


class _RetentionError(CheckpointError):
    """A checkpoint was committed, but deleting older ones (``keep_last``) failed."""


class CheckpointManager:
    """Check-N-Run checkpoints of a (sharded or unsharded) DLRM and its dense optimizer."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        model: Any,
        dense_opt: torch.optim.Optimizer,
        root: str,
    ) -> None:
        self.cfg = cfg
        self.storage = open_storage(root, fsync=cfg.fsync)
        self.model = model
        self.ebc: EmbeddingCollection = model.ebc
        self.opt = dense_opt
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        fixed, dyn = fixed_part(self.ebc), dynamic_part(self.ebc)
        self.blocks = local_blocks(fixed, self.rank) if fixed is not None else []
        self.tracker = DirtyRowTracker(fixed) if fixed is not None else None
        self.dyn = DynamicCheckpoints(dyn, self.rank) if dyn is not None else None
        """Dynamic tables: their pieces by raw id (``neorec.checkpoint.dynamic``)."""
        self._since = self._take()  # rows changed since the end of the prefix
        self._prefix: list[str] = []  # chain the next increment extends ([] = next is a baseline)
        self._prefix_cost = 0.0  # estimated bytes of the increments in the prefix
        self._since_baseline = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # The newest commits' name, baseline and step (bounded: a run of any length keeps 64)
        self.history: deque[dict[str, Any]] = deque(maxlen=64)
        self.commits = 0  # checkpoints committed by this manager
        self._group: Any = None
        self._wgroup: Any = None
        self._cleaned = False  # unfinished directories of this lineage removed (first save)
        run = [uuid.uuid4().hex[:8]]
        if self.distributed:
            # Own groups: the training thread's collectives and the writer thread's never mix.
            self._group = dist.new_group(backend="gloo")
            self._wgroup = dist.new_group(backend="gloo")
            dist.broadcast_object_list(run, src=0, group=self._group)
        self.run_id = run[0]
        """This process group's session id (part of every checkpoint name it writes)."""
        self.lineage = run[0]
        """The run's lineage: a fresh run's own id; ``restore`` adopts the checkpoint's."""
        self.extra_description: dict[str, Any] = {}
        """Merged into the manifest's model description (the trainer adds its model config)."""
        self.last_committed: str | None = None
        """Name of the last checkpoint whose manifest this process wrote (rank 0)."""
        self._newest: tuple[str, int] | None = None  # newest complete (name, step) we know of
        self._failed: tuple[str, int] | None = None  # the snapshot whose write failed
        self._base_cost = self._all_reduce_sum([self._block_bytes(None)])[0]
        self.states: dict[str, Stateful] = {}
        """Parts saved beside the model and loaded after a restore (``register``)."""

    def register(self, name: str, part: Stateful) -> None:
        """Keep ``part``'s state in every checkpoint's extra state (``checkpoint.stateful``)."""
        self.states[name] = part

    # ---- helpers -------------------------------------------------------------------------
    def _take(self) -> dict[str, Tensor]:
        """The fixed tables' dirty-row masks since the last take (none without fixed tables)."""
        return self.tracker.take() if self.tracker is not None else {}

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
        if self.dyn is not None:
            bits, opt_bits = self.cfg.bits, self.cfg.opt_bits
            if masks is None:
                total += self.dyn.base_bytes(bits, opt_bits)
            else:
                total += self.dyn.est_bytes(False, bits, opt_bits)
        return total

    def _remove_incomplete(self) -> None:
        """Drop unfinished directories of this run's lineage (writes that a crash cut short).

        Runs on rank 0 at the first save, so a failed resume deletes nothing. Directories of other
        lineages (another run may be writing them) and this session's own are left alone.
        """
        for name in self.storage.listdir():
            parsed = parse_name(name)
            if parsed is None or parsed[1] != self.lineage or parsed[2] == self.run_id:
                continue
            if not self.storage.exists(f"{name}/{MANIFEST}"):
                self.storage.remove(name)

    # ---- saving ----------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until the background write (if any) has committed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, _RetentionError):  # the checkpoint itself is complete
                raise CheckpointError(str(err)) from None
            self._prefix = []  # the failed checkpoint is no chain's link: the next is a baseline
            name, step = self._failed or ("?", -1)
            if self._newest is None:
                usable = "no complete checkpoint of this run yet"
            else:
                usable = (
                    f"the newest complete checkpoint, {self._newest[0]} (step {self._newest[1]}), "
                    f"is intact: --resume latest continues from it"
                )
            raise CheckpointError(
                f"checkpoint of step {step} not written to {self.storage.url} ({name}): {err}; "
                f"{usable}"
            ) from err

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
        """Checkpoint now (every rank, same step), with the registered parts' state and ``extra``;
        returns the training pause in ms."""
        t0 = time.perf_counter()
        extra = {**merged_state(self.states), **(extra or {})}
        self.wait()
        if not self._cleaned:
            if self.rank == 0:
                self._remove_incomplete()
            self._cleaned = True
        new = self._take()
        if self.dyn is not None:
            self.dyn.collect()
        if DP in new and self.distributed:
            # replicas: a row touched on any rank changed everywhere
            m = new[DP].to(torch.uint8)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self._group)
            new[DP] = m.bool()
        for k in self._since:
            self._since[k] |= new[k]
        (est,) = self._all_reduce_sum([self._block_bytes(self._since)])
        kind = self._decide(est)
        name = f"{PREFIX}{step:010d}-{self.lineage}-{self.run_id}"
        chain = [name] if kind == "baseline" else [*self._prefix, name]
        cost = est if kind != "baseline" else 0.0
        snap = Snapshot(name, step, kind, chain, self._snap_blocks(kind), None, cost, 0.0)
        try:
            if self.dyn is not None:
                snap.meta["dynamic"] = self.dyn.snapshot(kind == "baseline")
            if self.rank == 0:
                snap.dense = self._snap_dense(extra)
        except BaseException:
            for b in snap.blocks:
                b.close()
            raise
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
        if self.dyn is not None:
            self.dyn.advance(kind == "baseline" or self.cfg.policy != "one_shot")

    def _snap_blocks(self, kind: str) -> list[BlockSnap | TieredSnap]:
        out = []
        for b in self.blocks:
            if not b.writer:
                continue
            ids = None
            if kind != "baseline":
                ids = self._since[b.space][b.space_offset : b.space_offset + b.rows].nonzero()
                ids = ids.squeeze(1)
            out.append(snap_block(b, ids, self._state_keys(b)))
        return out

    def _snap_dense(self, extra: dict[str, Any]) -> dict[str, Any]:
        ebc = self.ebc
        return {
            "dense": clone(dense_module(self.model).state_dict()),
            "optimizer": clone(self.opt.state_dict()),
            "emb_step": ebc.fused_steps(),
            "extra": clone(extra),
        }

    # ---- background writer ------------------------------------------------------------------
    def _write_guarded(self, snap: Snapshot) -> None:
        try:
            self._write(snap)
        except _RetentionError as e:
            self._error = e
        except BaseException as e:  # surfaced by the next wait()
            self._error, self._failed = e, (snap.name, snap.step)
        else:
            # rank 0 committed it; another rank: its pieces are written and rank 0 commits
            self._newest = (snap.name, snap.step)

    def _write(self, snap: Snapshot) -> None:
        t0 = time.perf_counter()
        error, pieces = "", []
        try:
            pieces = write_pieces(self.storage, self.cfg, snap)
            if self.dyn is not None:
                pieces += self.dyn.pieces(snap.name, snap.meta["dynamic"], self.storage, self.cfg)
            dense_entry = None
            if snap.dense is not None:
                buf = io.BytesIO()
                torch.save(snap.dense, buf)
                data = buf.getvalue()
                self.storage.write_atomic(f"{snap.name}/dense.pt", data)
                dense_entry = {"file": "dense.pt", "bytes": len(data), "crc32": checksum(data)}
        except Exception as e:
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
        finally:
            for b in snap.blocks:
                b.close()  # (dram/ssd tables: their stores' copy-on-write ends)
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
            self._drop(snap.name)
            raise CheckpointError("; ".join(errors))
        all_pieces = [p for ps, _ in parts for p in ps if "full" not in p]
        dyn_pieces = [p for ps, _ in parts for p in ps if "full" in p]
        entries = scan(self.storage)
        seq = 1 + max((int(e.manifest["seq"]) for e in entries if e.manifest), default=0)
        manifest = self._manifest(snap, all_pieces, dense_entry, time.perf_counter() - t0, seq)
        if self.dyn is not None:
            manifest["dynamic"] = dyn_pieces
            manifest["bytes"] += sum(p["bytes"] for p in dyn_pieces)
        try:
            self.storage.write_atomic(f"{snap.name}/{MANIFEST}", seal_manifest(manifest))
        except BaseException:
            self._drop(snap.name)
            raise
        self.history.append({k: manifest[k] for k in ("name", "baseline", "step")})
        self.commits += 1
        self.last_committed = snap.name
        self._newest = (snap.name, snap.step)
        try:
            self._retain([e.manifest for e in entries if e.manifest] + [manifest])
        except OSError as e:
            raise _RetentionError(
                f"checkpoint of step {snap.step} written ({snap.name}), but removing older "
                f"checkpoints of {self.storage.url} failed (keep_last={self.cfg.keep_last}): "
                f"{type(e).__name__}: {e}"
            ) from None

    def _drop(self, name: str) -> None:
        """Rank 0, after a failed write (every rank has finished writing it): remove the
        unfinished directory, to give a full disk its space back. Best effort: on a read-only
        root it stays, has no manifest, is never taken as a checkpoint, and is swept later."""
        try:
            self.storage.remove(name)
        except Exception:  # noqa: BLE001 - the write's own error is the one reported
            pass

    def _manifest(
        self, snap: Snapshot, pieces: list[dict[str, Any]], dense: Any, write_s: float, seq: int
    ) -> dict[str, Any]:
        cfg = self.cfg
        tables = {t.name: {"rows": t.rows, "dim": t.dim} for t in model_tables(self.model)}
        nbytes = sum(p["bytes"] for p in pieces) + (dense["bytes"] if dense else 0)
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "name": snap.name,
            "lineage": self.lineage,
            "seq": seq,
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
            "model": {**describe_model(self.model, self.opt), **self.extra_description},
            "pieces": pieces,
            "dense": dense,
            "bytes": nbytes,
            "rows": sum(p["n"] for p in pieces),
            "est_bytes": snap.est_bytes,
            "snapshot_ms": round(snap.pause_ms, 3),
            "write_s": round(write_s, 4),
            "created": time.time(),
        }

    def _retain(self, manifests: list[dict[str, Any]]) -> None:
        """Keep this lineage's last ``keep_last`` baseline families (by their latest write).

        A family is a baseline and every checkpoint built on it. Only this run's lineage is
        counted and deleted; a checkpoint whose baseline is gone is left as it is.
        """
        own = sorted((m for m in manifests if m["lineage"] == self.lineage), key=order_key)
        baselines = {m["name"] for m in own if m["kind"] == "baseline"}
        recency: dict[str, int] = {}  # baseline -> position of its family's latest write
        for i, m in enumerate(own):
            if m["baseline"] in baselines:
                recency[m["baseline"]] = i
        keep = set(sorted(recency, key=recency.__getitem__)[-self.cfg.keep_last :])
        doomed = [m for m in own if m["baseline"] in baselines and m["baseline"] not in keep]
        # newest first, manifest before files: what is left of a family always has its chain
        for m in reversed(doomed):
            self.storage.remove(f"{m['name']}/{MANIFEST}")
            self.storage.remove(m["name"])

    # ---- restoring ---------------------------------------------------------------------------
    def locate(self, which: str = "latest") -> tuple[Any, str]:
        """(storage, checkpoint name) that ``which`` (a name, a path or 'latest') refers to."""
        storage, name = self.storage, None
        if which.startswith(PREFIX) and "/" not in which:
            name = which  # a checkpoint of our own root
        elif which != "latest":
            root, name = split_path(which)
            storage = open_storage(root, fsync=False)
        return storage, resolve_checkpoint(storage, name)

    def restore(self, which: str = "latest") -> dict[str, Any]:
        """Load a checkpoint (a name, a path, or 'latest') into the model; returns its extra state.

        Everything is read and checked (chain, model description, dense state) before the first
        tensor of the model changes; a failure changes nothing and deletes nothing.
        """
        storage, name = self.locate(which)
        return self.restore_from(storage, name)

    def restore_from(self, storage: Any, name: str) -> dict[str, Any]:
        """``restore`` of checkpoint ``name`` of ``storage`` (as ``locate`` returns them); the
        registered parts load its extra state last."""
        chain = load_chain(storage, name)
        last, cfg = chain[-1], self.cfg
        check_model(storage.path(name), last["model"], describe_model(self.model, self.opt))
        dense = load_dense(storage, name, last["dense"])
        dynamic = restore_dynamic(storage, chain, self.ebc)  # read and checked, not applied
        restore_embeddings(storage, chain, self.blocks)
        apply_dense(storage.path(name), dense, self.model, self.opt)
        for apply in dynamic:
            apply()
        set_steps(self.ebc, int(dense["emb_step"]))  # every part counts the same steps
        self._take()
        self._since = {k: torch.zeros_like(v) for k, v in self._since.items()}
        if self.dyn is not None:
            self.dyn.reset()
        self.lineage = str(last["lineage"])
        if storage.root == self.storage.root:
            self._newest = (name, int(last["step"]))
        same = (last["bits"], last["opt_bits"]) == (cfg.bits, cfg.opt_bits)
        # an increment must extend a chain stored the same way and in this root
        if same and storage.root == self.storage.root and cfg.policy != "full":
            self._prefix = list(last["chain"])
            self._prefix_cost = sum(m["est_bytes"] for m in chain[1:])
            self._since_baseline = len(chain) - 1
        else:
            self._prefix = []
        load_states(self.states, dict(dense["extra"]), storage.path(name))
        return dict(dense["extra"])
