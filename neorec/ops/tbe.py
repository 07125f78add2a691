"""Table-batched embedding (TBE): pooled lookups of many tables in one call, backward fused with
the row optimizer.

All tables of a module live in one flat float32 ``weights`` tensor (table ``t`` occupies
``weights[elem_offsets[t]:elem_offsets[t+1]]`` as a row-major [rows_t, dim_t] block). A batch is
feature-major (see ``neorec.sparse``): feature ``f`` looks up table ``feature_table[f]``; its
pooled output occupies columns ``out_offsets[f]:out_offsets[f+1]`` of the [B, sum(dims)] output.

Backward never materializes a gradient for the weights: the backend receives the gradient of the
pooled output, sums the gradients of each distinct row of each table in a fixed order (feature
order, then position in the batch), and applies ``row_optim`` to those rows in place.

Backends (same interface, same semantics):
- ``reference``: plain PyTorch ops; the oracle for tests.
- ``cpu``: a C kernel compiled on first use (OpenMP, AVX-512 where present); see ``ops/cpu.py``.
- ``cuda``: PyTorch ops on the GPU with deterministic sort-based reductions; see ``ops/cuda.py``.
- ``triton``: ``@triton.jit`` kernels (optional ``neorec[gpu]`` extra); CUDA tensors, or CPU
  tensors under ``TRITON_INTERPRET=1`` (triton's interpreter); see ``ops/triton_tbe.py``.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from neorec.errors import ConfigError
from neorec.ops.row_optim import RowOptimizer, apply_rows
from neorec.ops.tbe_checks import (
    NonFiniteGradientError,
    TBEIdError,
    TBEInputError,
    check_finite_weights,
    check_grad_output,
    check_grad_shape,
    check_ids,
    check_offsets,
    check_per_sample_weights,
)

_Item = TypeVar("_Item", bound=tuple[Any, ...])

__all__ = [
    "PoolingMode",
    "TBELayout",
    "Lookup",
    "TBEBackend",
    "ReferenceBackend",
    "get_backend",
    "available_backends",
    "tbe_lookup",
    "update_table_rows",
    "apply_row_grads",
    "group_calls",
    "TBEInputError",
    "TBEIdError",
    "NonFiniteGradientError",
    "check_offsets",
    "check_ids",
    "check_grad_output",
    "check_finite_weights",
]


class PoolingMode(str, Enum):
    """How the rows of a bag are combined."""

    SUM = "sum"
    MEAN = "mean"


@dataclass(frozen=True)
class TBELayout:
    """Static shape of a table batch: tables (rows, dim) and which table each feature reads."""

    rows: tuple[int, ...]
    dims: tuple[int, ...]
    feature_table: tuple[int, ...]
    elem_offsets: tuple[int, ...] = field(init=False)
    row_offsets: tuple[int, ...] = field(init=False)
    out_offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.dims):
            raise ValueError(f"{len(self.rows)} row counts for {len(self.dims)} dims")
        for t, (r, d) in enumerate(zip(self.rows, self.dims)):
            if r < 0 or d <= 0:
                raise ValueError(f"table {t}: rows must be >= 0 and dim > 0, got rows={r} dim={d}")
        for f, t in enumerate(self.feature_table):
            if not 0 <= t < len(self.rows):
                raise ValueError(f"feature {f} maps to table {t}, but there are {len(self.rows)}")
        elem, row, out = [0], [0], [0]
        for r, d in zip(self.rows, self.dims):
            elem.append(elem[-1] + r * d)
            row.append(row[-1] + r)
        for t in self.feature_table:
            out.append(out[-1] + self.dims[t])
        object.__setattr__(self, "elem_offsets", tuple(elem))
        object.__setattr__(self, "row_offsets", tuple(row))
        object.__setattr__(self, "out_offsets", tuple(out))

    @property
    def num_tables(self) -> int:
        """T."""
        return len(self.rows)

    @property
    def num_features(self) -> int:
        """F."""
        return len(self.feature_table)

    @property
    def total_dim(self) -> int:
        """Columns of the pooled output."""
        return self.out_offsets[-1]

    @property
    def total_rows(self) -> int:
        """Rows over all tables."""
        return self.row_offsets[-1]

    @property
    def total_elems(self) -> int:
        """Elements of the flat weights."""
        return self.elem_offsets[-1]

    def table(self, weights: Tensor, t: int) -> Tensor:
        """View of table ``t`` as [rows, dim]."""
        lo, hi = self.elem_offsets[t], self.elem_offsets[t + 1]
        return weights[lo:hi].view(self.rows[t], self.dims[t])

    @functools.lru_cache(maxsize=8)  # noqa: B019 - layouts are few and immutable
    def meta(self, device: torch.device) -> dict[str, Tensor]:
        """The offsets as int64 tensors on ``device`` (for kernels)."""
        mk = functools.partial(torch.tensor, dtype=torch.int64, device=device)
        return {
            "rows": mk(self.rows),
            "dims": mk(self.dims),
            "feature_table": mk(self.feature_table),
            "elem_offsets": mk(self.elem_offsets),
            "row_offsets": mk(self.row_offsets),
            "out_offsets": mk(self.out_offsets),
        }


@dataclass(frozen=True, eq=False)
class Lookup:
    """The batch's lookup input: what every backend takes (F features, B samples, N ids)."""

    indices: Tensor
    """int64 [N]: the ids, feature-major (feature f's B bags, then feature f+1's)."""
    offsets: Tensor
    """int64 [F*B+1]: bag ``i`` is ``indices[offsets[i]:offsets[i+1]]``."""
    per_sample_weights: Tensor | None
    """float [N]: each id's weight in its bag (None: all 1)."""
    pooling: PoolingMode
    """How a bag's rows are combined."""


class TBEBackend(Protocol):
    """A kernel implementation of the TBE forward and fused backward-update.

    Every method takes the batch as one ``Lookup``; feature ``f`` reads table
    ``layout.feature_table[f]``, and its pooled output occupies columns
    ``layout.out_offsets[f]:out_offsets[f+1]`` of the [B, layout.total_dim] output.

    Optional (``row_grads`` the module function falls back to the reference's):
    ``row_grads(layout, lookup, grad_output)``, per looked-up table (t, sorted distinct ids [U],
    summed gradients [U, D]), the sums ``backward_update`` applies; the GPU backends'
    ``row_grads_padded(layout, lookup, grad_output, bounds)``, the same in blocks of host-known
    size (``padded_rows``).
    """

    name: str

    def forward(self, layout: TBELayout, weights: Tensor, lookup: Lookup) -> Tensor:
        """Pooled output [B, layout.total_dim] of ``lookup`` over the flat ``weights``."""
        ...

    def backward_update(
        self,
        layout: TBELayout,
        weights: Tensor,
        state: dict[str, Tensor],
        lookup: Lookup,
        grad_output: Tensor,
        opt: RowOptimizer,
        step: int,
    ) -> None:
        """Apply ``opt`` in place to the rows ``lookup`` touched (``weights`` and ``state``),
        from d(loss)/d(output) ``grad_output`` [B, layout.total_dim]: each distinct row's
        gradients summed in (feature, batch position) order, then one update per row."""
        ...


def _bag_ids(offsets: Tensor, n: int) -> Tensor:
    """For each of the ``n`` ids, the index of the bag (segment of ``offsets``) holding it."""
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)[
        :n
    ]


class ReferenceBackend:
    """Plain PyTorch; the test oracle. Readable, not fast. Checks every input before it reads
    or writes anything (Python's negative indexing would otherwise wrap a bad id silently)."""

    name = "reference"

    def _check(self, layout: TBELayout, weights: Tensor, lookup: Lookup) -> None:
        indices, offsets = lookup.indices, lookup.offsets
        if weights.numel() != layout.total_elems:
            raise TBEInputError(
                f"weights has {weights.numel()} elements, expected {layout.total_elems}"
            )
        b = check_offsets(offsets, indices.numel(), layout.num_features)
        check_ids(layout, indices, offsets, b)
        check_per_sample_weights(lookup.per_sample_weights, indices, weights)

    def forward(self, layout: TBELayout, weights: Tensor, lookup: Lookup) -> Tensor:
        """Pooled output [B, total_dim]."""
        self._check(layout, weights, lookup)
        indices, offsets = lookup.indices, lookup.offsets
        per_sample_weights, pooling = lookup.per_sample_weights, lookup.pooling
        nf = layout.num_features
        b = (offsets.numel() - 1) // nf
        out = torch.zeros(b, layout.total_dim, dtype=weights.dtype, device=weights.device)
        for f, t in enumerate(layout.feature_table):
            lo, hi = int(offsets[f * b]), int(offsets[(f + 1) * b])
            seg = offsets[f * b : (f + 1) * b + 1] - lo
            ids = indices[lo:hi]
            rows = layout.table(weights, t)[ids]  # [n, D]
            if per_sample_weights is not None:
                rows = rows * per_sample_weights[lo:hi].unsqueeze(1).to(rows.dtype)
            pooled = torch.zeros(b, layout.dims[t], dtype=weights.dtype, device=weights.device)
            pooled.index_add_(0, _bag_ids(seg, hi - lo), rows)
            if pooling == PoolingMode.MEAN:
                lens = (seg[1:] - seg[:-1]).clamp(min=1).to(pooled.dtype)
                pooled = pooled / lens.unsqueeze(1)
            out[:, layout.out_offsets[f] : layout.out_offsets[f + 1]] = pooled
        return out

    def row_grads(
        self, layout: TBELayout, lookup: Lookup, grad_output: Tensor
    ) -> list[tuple[int, Tensor, Tensor]]:
        """Per looked-up table: (t, sorted distinct ids [U], summed gradients [U, D])."""
        indices, offsets = lookup.indices, lookup.offsets
        per_sample_weights, pooling = lookup.per_sample_weights, lookup.pooling
        nf = layout.num_features
        b = (offsets.numel() - 1) // nf
        ids_by_table: list[list[Tensor]] = [[] for _ in range(layout.num_tables)]
        grads_by_table: list[list[Tensor]] = [[] for _ in range(layout.num_tables)]
        for f, t in enumerate(layout.feature_table):
            lo, hi = int(offsets[f * b]), int(offsets[(f + 1) * b])
            seg = offsets[f * b : (f + 1) * b + 1] - lo
            bag = _bag_ids(seg, hi - lo)
            g = grad_output[:, layout.out_offsets[f] : layout.out_offsets[f + 1]][bag]  # [n, D]
            if pooling == PoolingMode.MEAN:
                lens = (seg[1:] - seg[:-1]).clamp(min=1).to(g.dtype)
                g = g / lens[bag].unsqueeze(1)
            if per_sample_weights is not None:
                g = g * per_sample_weights[lo:hi].unsqueeze(1).to(g.dtype)
            ids_by_table[t].append(indices[lo:hi])
            grads_by_table[t].append(g)
        out = []
        for t in range(layout.num_tables):
            if not ids_by_table[t]:
                continue
            ids = torch.cat(ids_by_table[t])
            g = torch.cat(grads_by_table[t])
            uniq, inv = torch.unique(ids, sorted=True, return_inverse=True)
            # index_add_ on CPU accumulates sequentially in occurrence order: deterministic.
            summed = torch.zeros(uniq.numel(), g.shape[1], dtype=g.dtype, device=g.device)
            summed.index_add_(0, inv, g)
            out.append((t, uniq, summed))
        return out

    def backward_update(
        self,
        layout: TBELayout,
        weights: Tensor,
        state: dict[str, Tensor],
        lookup: Lookup,
        grad_output: Tensor,
        opt: RowOptimizer,
        step: int,
    ) -> None:
        """Sum each distinct row's gradients, then apply the optimizer to those rows."""
        self._check(layout, weights, lookup)
        check_grad_shape(grad_output, layout, lookup.offsets)
        grads = self.row_grads(layout, lookup, grad_output)
        for t, uniq, g in grads:
            update_table_rows(layout, weights, state, t, uniq, g, opt, step)


def row_grads(
    backend: Any, layout: TBELayout, lookup: Lookup, grad_output: Tensor
) -> list[tuple[int, Tensor, Tensor]]:
    """Per looked-up table (t, sorted distinct ids, summed gradients): ``backend``'s own when it
    has one (the cpu kernel), else the reference's; the same sums in the same order."""
    impl = getattr(backend, "row_grads", None) or ReferenceBackend().row_grads
    out: list[tuple[int, Tensor, Tensor]] = impl(layout, lookup, grad_output)
    return out


def apply_row_grads(
    backend: Any,
    layout: TBELayout,
    weights: Tensor,
    state: dict[str, Tensor],
    grads: Sequence[tuple[int, Tensor, Tensor]],
    opt: RowOptimizer,
    step: int,
) -> None:
    """Apply gradients given as (table, ids [n], grads [n, dim]) with ``backend``'s fused update.

    Ids may repeat: a row's gradients are added to zero in the order given, then the optimizer
    updates each distinct row once, exactly as ``backward_update`` does for a batch's lookups
    (each (id, gradient) pair is passed as a bag of one id whose output gradient is that row).
    Tables go in as few calls as keep the padded output gradient within twice the payload (a
    call's bags per table are its largest table's pair count).
    """
    for grp in group_calls(layout, [it for it in grads if it[1].numel()]):
        lay = TBELayout(
            rows=layout.rows, dims=layout.dims, feature_table=tuple(t for t, _, _ in grp)
        )
        bags = max(ids.numel() for _, ids, _ in grp)
        lengths = torch.zeros(len(grp), bags, dtype=torch.int64)
        grad_out = torch.zeros(bags, lay.total_dim, dtype=weights.dtype, device=weights.device)
        for f, (_, ids, g) in enumerate(grp):
            lengths[f, : ids.numel()] = 1
            grad_out[: ids.numel(), lay.out_offsets[f] : lay.out_offsets[f + 1]] = g
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths.view(-1), 0, out=offsets[1:])
        indices = torch.cat([ids for _, ids, _ in grp]).to(device=weights.device)
        lookup = Lookup(indices, offsets.to(weights.device), None, PoolingMode.SUM)
        backend.backward_update(lay, weights, state, lookup, grad_out, opt, step)


def group_calls(layout: TBELayout, items: Sequence[_Item]) -> list[list[_Item]]:
    """``items`` (table, ids, ...) grouped into fused-update calls (each in table order): as few
    as keep a call's padded output gradient (its largest pair count times its width) within twice
    the payload."""
    groups: list[list[_Item]] = []
    for it in sorted(items, key=lambda x: (-x[1].numel(), x[0])):
        if groups:
            grp = [*groups[-1], it]
            width = sum(layout.dims[x[0]] for x in grp)
            payload = sum(x[1].numel() * layout.dims[x[0]] for x in grp)
            if grp[0][1].numel() * width <= 2 * payload:
                groups[-1] = grp
                continue
        groups.append([it])
    return [sorted(grp, key=lambda x: x[0]) for grp in groups]


def update_table_rows(
    layout: TBELayout,
    weights: Tensor,
    state: dict[str, Tensor],
    t: int,
    ids: Tensor,
    grads: Tensor,
    opt: RowOptimizer,
    step: int,
) -> None:
    """Apply ``opt`` to distinct rows ``ids`` of table ``t`` (weights and state) in place."""
    w_t = layout.table(weights, t)
    w = w_t[ids]
    st = _gather_state(layout, state, t, ids)
    apply_rows(opt, w, grads.to(w.dtype), st, step)
    w_t[ids] = w  # distinct ids: no write conflicts
    _scatter_state(layout, state, t, ids, st)


def _gather_state(layout: TBELayout, state: dict[str, Tensor], t: int, uniq: Tensor) -> dict:
    out = {}
    for k, s in state.items():
        if k == "momentum1":
            out[k] = s[layout.row_offsets[t] + uniq]
        else:
            out[k] = layout.table(s, t)[uniq]
    return out


def _scatter_state(
    layout: TBELayout, state: dict[str, Tensor], t: int, uniq: Tensor, st: dict[str, Tensor]
) -> None:
    for k, s in state.items():
        if k == "momentum1":
            s[layout.row_offsets[t] + uniq] = st[k]
        else:
            layout.table(s, t)[uniq] = st[k]


_BACKENDS: dict[str, Callable[[], Any]] = {"reference": ReferenceBackend}


def _load_cpu() -> Any:
    from neorec.ops.cpu import CpuBackend

    return CpuBackend()


def _load_cuda() -> Any:
    from neorec.ops.cuda import CudaBackend

    return CudaBackend()


def _load_triton() -> Any:
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"TBE backend 'triton' needs the triton package ({e}): pip install 'neorec[gpu]'"
        ) from None
    from neorec.ops.triton_tbe import TritonBackend

    return TritonBackend()


_BACKENDS["cpu"] = _load_cpu
_BACKENDS["cuda"] = _load_cuda
_BACKENDS["triton"] = _load_triton


@functools.cache
def _triton_importable() -> bool:
    """Whether the triton package is installed (found without importing it)."""
    return importlib.util.find_spec("triton") is not None


def available_backends() -> Sequence[str]:
    """Backend names that can be asked for."""
    return tuple(_BACKENDS)


@functools.cache
def _make(name: str) -> Any:
    return _BACKENDS[name]()


def get_backend(name: str, device: torch.device | str = "cpu") -> TBEBackend:
    """Backend by name; ``auto`` picks ``triton`` (or ``cuda`` without triton) for CUDA weights,
    else ``cpu``. ``triton`` on the CPU needs ``TRITON_INTERPRET=1`` (its interpreter)."""
    device = torch.device(device)
    if name == "auto" and device.type not in ("cpu", "cuda"):
        raise ConfigError(f"no TBE backend runs on device {device}; use cpu or cuda")
    if name == "auto":
        if device.type == "cuda":
            name = "triton" if _triton_importable() else "cuda"
        else:
            name = "cpu"
        if name == "cpu" and not _cpu_kernel_available():
            name = "reference"
    if not isinstance(name, str) or name not in _BACKENDS:
        raise ConfigError(
            f"unknown TBE backend {name!r}, expected auto or one of {list(_BACKENDS)}"
        )
    if name == "cuda" and device.type != "cuda":
        raise ConfigError("TBE backend 'cuda' needs weights on a CUDA device")
    if name == "cpu" and device.type != "cpu":
        raise ConfigError(f"TBE backend 'cpu' needs weights on the CPU, not {device}")
    if name == "triton":
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(
                f"TBE backend 'triton' needs weights on a CUDA device (or the CPU under "
                f"TRITON_INTERPRET=1), not {device}"
            )
        backend = _make(name)  # a missing triton is a ConfigError here
        if device.type == "cpu" and not backend.interpret:
            raise ConfigError(
                "TBE backend 'triton' needs weights on a CUDA device, or TRITON_INTERPRET=1 in "
                "the environment (set before neorec.ops.triton_tbe is first imported, kept while "
                "it runs) for triton's interpreter to run its kernels on CPU tensors"
            )
        return backend
    return _make(name)


@functools.cache
def _cpu_kernel_available() -> bool:
    """Whether the C kernel compiles and loads here; warn once and use the reference if not."""
    try:
        from neorec.ops.cpu import load_kernel

        load_kernel()
        return True
    except (RuntimeError, OSError) as e:
        warnings.warn(
            f"neorec: the fast CPU TBE kernel is unavailable ({e}); using the (slow) reference "
            f"backend. Install a C compiler (cc) for the fast one.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False


class _TBEFunction(torch.autograd.Function):
    """Forward: pooled lookup. Backward: hands d(out) to ``update``; no weight gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, anchor: Tensor, run: Callable[[], Tensor], update: Callable[[Tensor], None]
    ) -> Tensor:
        ctx.update = update
        return run()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[None, None, None]:  # type: ignore[override]
        ctx.update(grad_output.contiguous())
        return None, None, None


def tbe_lookup(
    anchor: Tensor,
    backend: TBEBackend,
    layout: TBELayout,
    weights: Tensor,
    lookup: Lookup,
    update: Callable[[Tensor], None],
) -> Tensor:
    """Pooled lookup [B, total_dim] of ``lookup`` whose backward calls ``update(grad_output)``.

    ``anchor`` is a zero-element tensor with ``requires_grad=True``: it puts the op in the autograd
    graph so that backward runs, while the weights themselves never receive a ``.grad``.
    """
    expected, offsets = layout.num_features, lookup.offsets
    if (offsets.numel() - 1) % max(expected, 1) != 0:
        raise TBEInputError(
            f"offsets has {offsets.numel()} entries; expected F*B+1 for F={expected} features"
        )

    def run() -> Tensor:
        return backend.forward(layout, weights, lookup)

    if not (torch.is_grad_enabled() and anchor.requires_grad):
        return run()
    out: Tensor = _TBEFunction.apply(anchor, run, update)
    return out
