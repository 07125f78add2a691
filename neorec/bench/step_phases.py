"""The phase model of one training step: bytes and flops per phase from the model's shapes,
each phase's floor on this machine's measured rates, and the breakdown's summary
(``neorec bench step --breakdown``; the model is explained in ``docs/performance.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from neorec.bench.floors import Floors

__all__ = [
    "PHASES",
    "DIST_PHASES",
    "COMM_PHASE",
    "Gemm",
    "LocalLookup",
    "StepShape",
    "Work",
    "gemm_sites",
    "phase_work",
    "phase_floor_ms",
    "summarize",
]

PHASES = (
    "batch_prep",
    "tbe_forward",
    "dense_forward",
    "loss",
    "dense_backward",
    "tbe_backward_update",
    "dense_optimizer",
)
"""The phases of a one-process step, in the order they run (``train.steps.train_step``)."""

DIST_PHASES = (
    "batch_prep",
    "input_dist",
    "tbe_forward",
    "output_dist",
    "dense_forward",
    "loss",
    "dense_backward",
    "grad_dist",
    "tbe_backward_update",
    "allreduce",
    "dense_optimizer",
)
"""The phases of a distributed step (``neorec bench step --breakdown --nproc N``), in the order
they end: ``allreduce`` is DDP's wait at the end of backward, after the embeddings' update."""

COMM_PHASE = {
    "lengths": "input_dist",
    "ids": "input_dist",
    "weights": "input_dist",
    "fwd_pooled": "output_dist",
    "fwd_host_reduce": "output_dist",
    "bwd_grads": "grad_dist",
    "bwd_host_reduce": "grad_dist",
    "dp_allgather": "grad_dist",  # data-parallel tables' row gradients, before the pooled ones
    "all_reduce": "tbe_backward_update",  # column-wise slices' row-wise Adagrad sums
    "allreduce_dense": "allreduce",
}
"""The phase each collective (``CommStats`` name) of the sharded step runs in."""

F32 = 4  # bytes of an fp32 value
I64 = 8  # bytes of an id, a length


@dataclass(frozen=True)
class Gemm:
    """One GEMM site of the dense part: ``count`` products of [m, k] x [k, n] at ``dtype``."""

    name: str
    m: int
    k: int
    n: int
    count: int = 1
    dtype: str = "fp32"

    @property
    def flops(self) -> float:
        """Forward flops (2 m k n per product)."""
        return 2.0 * self.m * self.k * self.n * self.count

    @property
    def operand_bytes(self) -> float:
        """fp32 bytes of the forward's operands: input, output, weight, each once."""
        return F32 * (self.m * self.k + self.m * self.n + self.k * self.n) * self.count


@dataclass(frozen=True)
class StepShape:
    """What the phase model needs of a step: the batch, the tables and the dense part."""

    batch: int
    features: int  # F pooled features (bags per sample)
    dim: int  # D, every table's
    ids: int  # ids in the batch (B * F * mean pooling)
    unique_rows: int  # distinct rows the batch touches (over all tables)
    num_dense: int
    gemms: tuple[Gemm, ...]
    dense_params: int  # elements of the dense parameters
    emb_bytes: int = F32  # bytes of one table element (fp32 4, fp16 / bf16 2, fp8 1)
    row_state_bytes: int = F32  # optimizer state per row: rowwise Adagrad 4, SGD 0, Adam 8 D
    dense_states: int = 0  # optimizer state tensors per dense parameter (SGD 0, Adagrad 1, Adam 2)


@dataclass(frozen=True)
class Work:
    """A phase's work: bytes it must move, flops it must do (and at which dtype)."""

    bytes: float = 0.0
    flops: dict[str, float] | None = None  # dtype -> flops
    copy: float = 0.0  # bytes a collective sends (floor: the copy bandwidth, ``Floors.copy_ms``)

    @property
    def total_flops(self) -> float:
        """Flops over all dtypes."""
        return sum((self.flops or {}).values())


def gemm_sites(arch: nn.Module, batch: int, precisions: dict[str, str] | None = None) -> list[Gemm]:
    """The GEMM sites of a dense arch (``modules.dlrm.DenseArch``): each ``nn.Linear`` ([B, in]
    x [in, out]) and a dot interaction's per-sample gram ([F+1, D] x [D, F+1], B of them), each at
    its precision in ``precisions`` (a LoKA plan: site name -> format; default fp32)."""
    prec = precisions or {}
    out = []
    for name, m in arch.named_modules():
        dtype = _gemm_dtype(prec.get(name, "fp32"))
        if isinstance(m, nn.Linear):
            out.append(Gemm(name, batch, m.in_features, m.out_features, 1, dtype))
        elif type(m).__name__ == "DotInteraction":
            n = int(getattr(arch, "num_features", 0)) + 1
            d = int(getattr(arch, "emb_dim", 0))
            out.append(Gemm(name, n, d, n, batch, dtype))
    return out


def _gemm_dtype(fmt: str) -> str:
    """A LoKA format's GEMM peak class: fp32, else bf16's (fp16 and fp8 run no faster here)."""
    return "fp32" if fmt == "fp32" else "bf16"


def _flops_by_dtype(gemms: tuple[Gemm, ...], scale: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for g in gemms:
        out[g.dtype] = out.get(g.dtype, 0.0) + scale * g.flops
    return out


def phase_work(s: StepShape) -> dict[str, Work]:
    """Bytes and flops of each phase (``PHASES``) of one step of shape ``s``.

    Bytes are the least each phase must move through memory: a byte-bound phase's floor.
    """
    bags = s.batch * s.features
    pooled = F32 * bags * s.dim  # the pooled [B, F*D] (and its gradient)
    fwd_bytes = sum(g.operand_bytes for g in s.gemms)
    return {
        # the batch read once (checks): ids, lengths, dense features, labels
        "batch_prep": Work(I64 * (s.ids + bags) + F32 * s.batch * (s.num_dense + 1)),
        # ids and offsets read, one row per id read, the pooled output written
        "tbe_forward": Work(I64 * (s.ids + bags) + s.emb_bytes * s.dim * s.ids + pooled),
        "dense_forward": Work(fwd_bytes, _flops_by_dtype(s.gemms, 1.0)),
        "loss": Work(3 * F32 * s.batch),  # logits and labels read, the gradient written
        # each GEMM's input and weight gradients: twice the forward's operands and flops
        "dense_backward": Work(2 * fwd_bytes, _flops_by_dtype(s.gemms, 2.0)),
        # the pooled gradient and the ids read; each touched row and its state read and written
        "tbe_backward_update": Work(
            pooled + I64 * s.ids + 2 * s.unique_rows * (s.emb_bytes * s.dim + s.row_state_bytes)
        ),
        # weight and gradient read, weight written; each state read and written
        "dense_optimizer": Work(F32 * s.dense_params * (3 + 2 * s.dense_states)),
    }


@dataclass(frozen=True)
class LocalLookup:
    """One rank's share of a sharded lookup: each local unit (a feature on a shard) pools
    ``bags`` bags (the W ranks' samples) over ``unit_ids`` ids of ``unit_dims`` columns; each
    local table (shard) has ``table_rows`` distinct rows touched of ``table_dims`` columns."""

    bags: int
    unit_ids: tuple[int, ...]
    unit_dims: tuple[int, ...]
    table_rows: tuple[int, ...]
    table_dims: tuple[int, ...]


def sharded_tbe_work(lk: LocalLookup, emb_bytes: int, state: dict[int, int]) -> dict[str, Work]:
    """The TBE phases of one rank (``phase_work``'s, unit by unit): forward reads ids, offsets
    and rows and writes the pooled block; backward reads the pooled gradient and the ids, reads
    and writes each touched row and its state (``state``: bytes per row by dim)."""
    fwd = bwd = 0.0
    for n, d in zip(lk.unit_ids, lk.unit_dims, strict=True):
        fwd += I64 * (n + lk.bags) + emb_bytes * d * n + F32 * lk.bags * d
        bwd += F32 * lk.bags * d + I64 * n
    for u, d in zip(lk.table_rows, lk.table_dims, strict=True):
        bwd += 2 * u * (emb_bytes * d + state.get(d, 0))
    return {"tbe_forward": Work(fwd), "tbe_backward_update": Work(bwd)}


def dist_phase_work(
    local: StepShape, lk: LocalLookup, sent: dict[str, float], state: dict[int, int]
) -> dict[str, Work]:
    """Bytes and flops of each phase of one rank's distributed step (``DIST_PHASES``): the
    dense side as one process with the rank's ``local`` batch; the TBE phases of its shards
    (``sharded_tbe_work``); each collective's bytes ``sent`` per step (``CommStats`` names)
    in its phase (``COMM_PHASE``; others are not counted), at the copy bandwidth."""
    one = phase_work(local)
    tbe = sharded_tbe_work(lk, local.emb_bytes, state)
    copy = dict.fromkeys(DIST_PHASES, 0.0)
    for name, n in sent.items():
        if name in COMM_PHASE:
            copy[COMM_PHASE[name]] += n
    out = {}
    for p in DIST_PHASES:
        base = tbe.get(p) or one.get(p) or Work()
        out[p] = Work(base.bytes, base.flops, copy[p])
    return out


def phase_floor_ms(w: Work, floors: Floors) -> tuple[float, str]:
    """A phase's floor (ms) and what binds it: the larger of its bytes at the triad bandwidth
    (plus a collective's bytes at the copy bandwidth) and its flops at the GEMM peak of each
    dtype (a roofline without overlap credit)."""
    mem = floors.bytes_ms(w.bytes)
    cp = floors.copy_ms(w.copy) if w.copy else 0.0
    comp = sum(floors.flops_ms(f, dt) for dt, f in (w.flops or {}).items())
    if comp > mem + cp:
        return comp, "flops"
    return mem + cp, ("copy" if cp > mem else "bytes")


def summarize(work: dict[str, Work], ms: dict[str, float], floors: Floors, step_ms: float) -> dict:
    """The breakdown's JSON: each phase's bytes, flops, median ms, floor and time over floor;
    the whole step's; ``phase_sum_over_step`` (the phases' medians summed over the step's
    separately measured median) and ``step_over_floor`` (the step over the floors' sum)."""
    phases: list[dict[str, Any]] = []
    for name, w in work.items():
        floor, bound = phase_floor_ms(w, floors)
        t = ms.get(name, 0.0)
        phases.append(
            {
                "name": name,
                "ms": _sig(t),
                "floor_ms": _sig(floor),
                "over_floor": _sig(t / floor) if floor > 0 else None,
                "bound": bound,
                "mb": round((w.bytes + w.copy) / 2**20, 2),
                "gflop": round(w.total_flops / 1e9, 3),
            }
        )
    for name in ms.keys() - work.keys():  # timed but not modelled (e.g. lowp dispatch)
        phases.append({"name": name, "ms": _sig(ms[name]), "floor_ms": 0.0,
                       "over_floor": None, "bound": "-", "mb": 0.0, "gflop": 0.0})  # fmt: skip
    total_floor = sum(p["floor_ms"] for p in phases)
    phase_sum = sum(ms.values())
    return {
        "phases": phases,
        "step_ms": _sig(step_ms),
        "phase_sum_ms": _sig(phase_sum),
        "floor_ms": _sig(total_floor),
        "phase_sum_over_step": _sig(phase_sum / step_ms),
        "step_over_floor": _sig(step_ms / total_floor),
        "furthest": max(
            (p for p in phases if p["over_floor"] is not None),
            key=lambda p: p["ms"] - p["floor_ms"],
        )["name"],
    }


def _sig(x: float, digits: int = 5) -> float:
    """``x`` to ``digits`` significant digits (small floors stay visible)."""
    return float(f"{x:.{digits}g}")
