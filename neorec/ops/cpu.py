"""Fast CPU TBE backend: a plain C + OpenMP kernel compiled on first use and called via ctypes.

The kernel (``csrc/tbe_cpu.c``) includes no torch headers, so it is independent of the torch
version and builds in well under a second with the system C compiler. The shared library is cached
per user, keyed by a hash of the source, the flags, the compiler and the CPU, in
``$NEOREC_CACHE_DIR``, else ``$XDG_CACHE_HOME/neorec``, else ``~/.cache/neorec``.

Semantics are those of ``ReferenceBackend`` (see ``tbe.py``/``row_optim.py``): each distinct row's
gradient is summed in (feature, batch position) order by one thread, so results are bitwise
identical for any thread count.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from neorec.ops.fastpath import ran
from neorec.ops.memory import table_empty
from neorec.ops.row_optim import RowOptimizer, state_shapes
from neorec.ops.tbe_checks import TBEIdError, TBEInputError
from neorec.ops.tbe_types import Lookup, PoolingMode, TBELayout

__all__ = ["CpuBackend", "load_kernel", "cache_dir"]

# -ffp-contract=off: no fused multiply-adds, so products round as in the torch reference.
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
_OK, _EID, _EOFFSETS, _ENOMEM = 0, 1, 2, 3  # TBE_* return codes of tbe_cpu.c
_OPT_CODES = {"sgd": 0, "rowwise_adagrad": 1, "adam": 2}
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None


class _Layout(ctypes.Structure):
    _fields_ = [
        ("F", ctypes.c_int64),
        ("B", ctypes.c_int64),
        ("T", ctypes.c_int64),
        ("total_dim", ctypes.c_int64),
        ("feature_table", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("dims", ctypes.c_void_p),
        ("elem_offsets", ctypes.c_void_p),
        ("row_offsets", ctypes.c_void_p),
        ("out_offsets", ctypes.c_void_p),
    ]


class _Optim(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int),
        ("lr", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("one_minus_beta1", ctypes.c_float),
        ("one_minus_beta2", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("bc1", ctypes.c_float),
        ("bc2", ctypes.c_float),
        ("clip_ratio", ctypes.c_float),
        ("clip_bound", ctypes.c_float),
        ("qat_strength", ctypes.c_float),
        ("qat_bits", ctypes.c_int),
        ("qat_shape", ctypes.c_int),
    ]


def cache_dir() -> Path:
    """Where compiled kernels are cached (per user)."""
    env = os.environ.get("NEOREC_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "neorec"


_SOURCES = (
    "csrc/tbe_cpu.c",
    "csrc/seq_cpu.c",
    "csrc/row_cache.c",
    "csrc/id_map.c",
    "csrc/exfm_losses.c",
    "csrc/row_split.c",
    "csrc/shm_sync.c",
    "csrc/quant_lookup.c",
)
"""Compiled together into one library: the TBE kernel and its sequence (non-pooled) form
(``neorec.ops.seq_lookup``, which reuses the TBE kernel's static functions), the row cache's
bookkeeping, the dynamic tables' id map (whose argtypes ``neorec.ops.id_map`` declares), an ExFM
student's losses (``neorec.ops.exfm_losses``), the row-range split of row-split tables' ids
(``neorec.ops.row_split``), the shared-memory transport's sequence counters
(``neorec.distributed.shm``) and the serving tables' pooled lookup (``neorec.ops.quant_lookup``)."""


def _source() -> str:
    files = resources.files("neorec.ops")
    return "\n".join(files.joinpath(name).read_text() for name in _SOURCES)


def _cpu_id() -> str:
    # -march=native code must not be reused on a different CPU sharing the same home directory.
    try:
        with open("/proc/cpuinfo") as fh:
            lines = [ln for ln in fh if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> tuple[str, str]:
    cc = os.environ.get("CC", "cc")
    path = shutil.which(cc)
    if path is None:
        raise RuntimeError(
            f"neorec's cpu TBE backend compiles a C kernel on first use, but no C compiler "
            f"'{cc}' was found on PATH; install gcc (or set CC), or use backend='reference'"
        )
    ver = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    return path, ver.stdout + ver.stderr


def _build(out: Path, src: str, cc: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="neorec-build-") as tmpd:
        c_file = Path(tmpd) / "tbe_cpu.c"
        c_file.write_text(src)
        fd, tmp_so = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
        os.close(fd)
        try:
            proc = subprocess.run(
                [cc, *_FLAGS, str(c_file), "-o", tmp_so, "-lm"],
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                raise RuntimeError(
                    f"compiling neorec's cpu TBE kernel with '{cc}' failed "
                    f"(exit {proc.returncode}):\n{proc.stderr.strip()}"
                )
            # Atomic publish: concurrent builders each rename a complete file into place.
            os.replace(tmp_so, out)
        finally:
            if os.path.exists(tmp_so):
                os.unlink(tmp_so)


def load_kernel() -> ctypes.CDLL:
    """The compiled kernel library, building it into the cache on first use."""
    global _LIB
    with _LOCK:
        if _LIB is not None:
            return _LIB
        src = _source()
        cc, version = _compiler()
        key = hashlib.sha256(
            "\0".join([src, " ".join(_FLAGS), cc, version, _cpu_id()]).encode()
        ).hexdigest()[:20]
        so = cache_dir() / f"tbe_cpu-{key}.so"
        if not so.exists():
            _build(so, src, cc)
        lib = ctypes.CDLL(str(so))
        vp, i32 = ctypes.c_void_p, ctypes.c_int
        lib.tbe_forward.argtypes = [vp, vp, vp, vp, vp, i32, vp, i32, vp]
        lib.tbe_forward.restype = i32
        lib.tbe_backward_update.argtypes = [vp, vp, vp, vp, vp, i32, vp, vp, vp, vp, vp, i32, i32]
        lib.tbe_backward_update.argtypes += [vp, ctypes.c_int64, vp, vp, vp, vp, ctypes.c_int64, vp]
        lib.tbe_backward_workspace.argtypes = [vp, vp, i32, i32, i32, i32]
        lib.tbe_backward_workspace.restype = ctypes.c_int64
        lib.tbe_backward_update.restype = i32
        i64 = ctypes.c_int64
        lib.rc_classify.argtypes = [vp, i64, vp, i64, vp, vp, i64, i32, vp, vp, vp, vp]
        lib.rc_classify.restype = i64
        lib.rc_select_victims.argtypes = [vp, vp, vp, vp, i64, i64, i64, vp, vp]
        lib.rc_select_victims.restype = i64
        lib.rc_evict_commit.argtypes = [vp, i64, vp, vp, vp, vp, i64]
        lib.rc_evict_commit.restype = i64
        lib.rc_fill_commit.argtypes = [vp, vp, i64, vp, vp, vp, vp, vp, i64, i32]
        lib.rc_fill_commit.restype = None
        lib.rc_match_sorted.argtypes = [vp, i64, vp, i64, vp, vp]
        lib.rc_match_sorted.restype = i64
        lib.rc_invalidate_sorted.argtypes = [vp, i64, vp, i64, vp]
        lib.rc_invalidate_sorted.restype = None
        lib.rc_remap.argtypes = [vp, i64, vp, vp]
        lib.rc_remap.restype = None
        lib.rc_copy_rows.argtypes = [vp, i64, vp, vp, i64, vp, i64, i64, i32]
        lib.rc_copy_rows.restype = None
        _LIB = lib
        return lib


_DECLARED: dict[str, ctypes.CDLL | None] = {}


def declared_kernel(name: str, declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """The kernel library after ``declare`` (one module's argtypes, ``name`` naming them) ran on
    it once, or None when it cannot be built (no C compiler): the callers' numpy / torch paths."""
    with _LOCK:
        if name in _DECLARED:
            return _DECLARED[name]
    try:
        lib: ctypes.CDLL | None = load_kernel()
    except (RuntimeError, OSError):
        lib = None
    with _LOCK:
        if name not in _DECLARED:
            if lib is not None:
                declare(lib)
            _DECLARED[name] = lib
        return _DECLARED[name]


def _ptr(t: Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _check_f32(name: str, t: Tensor, numel: int) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise TBEInputError(
            f"cpu TBE backend: {name} must be a contiguous float32 CPU tensor, "
            f"got {t.dtype} on {t.device} (contiguous={t.is_contiguous()})"
        )
    if t.numel() != numel:
        raise TBEInputError(f"cpu TBE backend: {name} has {t.numel()} elements, expected {numel}")


class CpuBackend:
    """TBE on the CPU with the compiled C kernel; same semantics as ``ReferenceBackend``."""

    name = "cpu"

    def __init__(self, force_pairs: bool = False) -> None:
        # force_pairs: sort (key, position) pairs even when they fit one word (tests the path
        # taken for enormous tables).
        self._force_pairs = force_pairs
        # Backward scratch (sort buffers), kept between calls so steady-state steps take no
        # page faults, on huge pages like the tables (the radix scatter writes to a thousand
        # places across it: sort -0.3 to -0.4 ms of ~5 on 8 x 1M x 64); the lock makes
        # concurrent callers take turns with it.
        self._ws = torch.empty(0, dtype=torch.uint8)
        self._ws_lock = threading.Lock()
        self._dummy = torch.empty(0)

    def _workspace(self, nbytes: int) -> Tensor:
        if self._ws.numel() < nbytes:
            self._ws = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self._ws = table_empty(nbytes, torch.uint8)
        return self._ws

    def _prepare(
        self, layout: TBELayout, weights: Tensor, lookup: Lookup
    ) -> tuple[_Layout, Tensor, Tensor, Tensor | None, int]:
        """Validate and normalize the batch; returns the C layout and int64/float32 inputs."""
        indices, offsets = lookup.indices, lookup.offsets
        per_sample_weights = lookup.per_sample_weights
        _check_f32("weights", weights, layout.total_elems)
        nf = layout.num_features
        if indices.dim() != 1 or offsets.dim() != 1:
            raise TBEInputError("cpu TBE backend: indices and offsets must be 1-D")
        for name, t in (("indices", indices), ("offsets", offsets)):
            if t.dtype not in (torch.int32, torch.int64) or t.device.type != "cpu":
                raise TBEInputError(
                    f"cpu TBE backend: {name} must be int32/int64 on CPU, got {t.dtype}"
                )
        if nf == 0 or (offsets.numel() - 1) % nf != 0 or offsets.numel() < 1:
            raise TBEInputError(
                f"cpu TBE backend: offsets has {offsets.numel()} entries; expected F*B+1 for F={nf}"
            )
        b = (offsets.numel() - 1) // nf
        if nf * b >= 2**31:
            raise TBEInputError(f"cpu TBE backend: {nf * b} bags exceed the kernel limit of 2^31")
        # One conversion each; no-ops for contiguous int64 input.
        indices = indices.to(torch.int64).contiguous()
        offsets = offsets.to(torch.int64).contiguous()
        first, last = int(offsets[0]), int(offsets[-1])
        if first < 0 or last > indices.numel():
            raise TBEInputError(
                f"cpu TBE backend: offsets span [{first}, {last}) but there are "
                f"{indices.numel()} indices"
            )
        if per_sample_weights is not None:
            psw = per_sample_weights
            # float32 like the tables: converting other dtypes would round them silently.
            if psw.dtype != torch.float32 or psw.shape != indices.shape or psw.device.type != "cpu":
                raise TBEInputError(
                    f"cpu TBE backend: per_sample_weights must be float32 on the CPU shaped like "
                    f"indices {tuple(indices.shape)}, got {psw.dtype} {tuple(psw.shape)} "
                    f"on {psw.device}"
                )
            per_sample_weights = psw.contiguous()
        meta = layout.meta(torch.device("cpu"))
        lay = _Layout(
            nf,
            b,
            layout.num_tables,
            layout.total_dim,
            *(
                meta[k].data_ptr()
                for k in ("feature_table", "rows", "dims", "elem_offsets", "row_offsets")
            ),
            meta["out_offsets"].data_ptr(),
        )
        return lay, indices, offsets, per_sample_weights, b

    def forward(self, layout: TBELayout, weights: Tensor, lookup: Lookup) -> Tensor:
        """Pooled output [B, total_dim]."""
        lib = load_kernel()
        ran("cpu.forward")
        lay, idx, off, psw, b = self._prepare(layout, weights, lookup)
        out = torch.empty(b, layout.total_dim, dtype=torch.float32)
        err = (ctypes.c_int64 * 2)()
        rc = lib.tbe_forward(
            ctypes.byref(lay),
            weights.data_ptr(),
            idx.data_ptr(),
            off.data_ptr(),
            _ptr(psw),
            int(PoolingMode(lookup.pooling) == PoolingMode.MEAN),
            out.data_ptr(),
            torch.get_num_threads(),
            err,
        )
        _raise(rc, err, layout, idx, off, b)
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
        emit_tables: Sequence[int] = (),
    ) -> list[tuple[int, Tensor, Tensor]]:
        """Sum each distinct row's gradients, then apply the optimizer to those rows, in place.

        Rows of the tables in ``emit_tables`` are not updated: their summed gradients are
        returned instead, as ``row_grads`` does (for updates that need a collective first).
        """
        lib = load_kernel()
        ran("cpu.backward")
        lay, idx, off, psw, b = self._prepare(layout, weights, lookup)
        if tuple(grad_output.shape) != (b, layout.total_dim):
            raise TBEInputError(
                f"cpu TBE backend: grad_output shape {tuple(grad_output.shape)}, "
                f"expected {(b, layout.total_dim)}"
            )
        _check_f32("grad_output", grad_output, b * layout.total_dim)
        emit = sorted(set(emit_tables))
        shapes = state_shapes(opt.kind, layout.total_rows, layout.total_elems)
        if len(emit) < layout.num_tables:
            for k, n in shapes.items():
                if k not in state:
                    raise TBEInputError(
                        f"cpu TBE backend: optimizer '{opt.kind}' needs state '{k}'"
                    )
                _check_f32(f"state['{k}']", state[k], n)
            if opt.kind == "adam" and step < 1:
                raise TBEInputError(f"adam step count must be >= 1 (1-based), got {step}")
        else:
            shapes = {}  # nothing is updated: no state needed
        o = _Optim(
            _OPT_CODES[opt.kind],
            opt.lr,
            opt.eps,
            opt.beta1,
            opt.beta2,
            1.0 - opt.beta1,
            1.0 - opt.beta2,
            opt.weight_decay,
            1.0 - opt.beta1 ** max(step, 1),
            1.0 - opt.beta2 ** max(step, 1),
            opt.clip_ratio,
            opt.clip_bound,
            opt.qat.strength if opt.qat else 0.0,
            opt.qat.bits if opt.qat else 0,
            opt.qat.code if opt.qat else 0,
        )
        emit_mask = emit_rows = emit_grads = None
        stride = 0
        if emit:
            emit_mask = torch.zeros(layout.num_tables, dtype=torch.uint8)
            emit_mask[emit] = 1
            # Upper bound of the distinct rows: the emitted tables' occurrences.
            feats = [f for f, t in enumerate(layout.feature_table) if emit_mask[t]]
            occ = sum(int(off[(f + 1) * b] - off[f * b]) for f in feats)
            stride = max(layout.dims[t] for t in emit)
            emit_rows = torch.empty(occ, dtype=torch.int64)
            emit_grads = torch.empty(occ, stride)
        count = ctypes.c_int64(0)
        err = (ctypes.c_int64 * 2)()
        nt = torch.get_num_threads()
        mean = int(PoolingMode(lookup.pooling) == PoolingMode.MEAN)
        with self._ws_lock:
            nbytes = lib.tbe_backward_workspace(
                ctypes.byref(lay), off.data_ptr(), psw is not None, mean, nt, self._force_pairs
            )
            ws = self._workspace(nbytes)
            rc = lib.tbe_backward_update(
                ctypes.byref(lay),
                weights.data_ptr(),
                idx.data_ptr(),
                off.data_ptr(),
                _ptr(psw),
                mean,
                grad_output.data_ptr(),
                ctypes.byref(o),
                _ptr(state.get("momentum1") if "momentum1" in shapes else None),
                _ptr(state.get("exp_avg") if "exp_avg" in shapes else None),
                _ptr(state.get("exp_avg_sq") if "exp_avg_sq" in shapes else None),
                nt,
                int(self._force_pairs),
                ws.data_ptr(),
                ws.numel(),
                err,
                _ptr(emit_mask),
                _ptr(emit_rows),
                _ptr(emit_grads),
                stride,
                ctypes.byref(count),
            )
        _raise(rc, err, layout, idx, off, b)
        if not emit:
            return []
        assert emit_rows is not None and emit_grads is not None
        n_rows = count.value
        rows, grads = emit_rows[:n_rows], emit_grads[:n_rows]
        # Sorted by global row, so grouped by table in table order.
        bounds = torch.searchsorted(rows, torch.tensor(layout.row_offsets, dtype=torch.int64))
        out = []
        for t in emit:
            lo, hi = int(bounds[t]), int(bounds[t + 1])
            if hi > lo:
                ids = rows[lo:hi] - layout.row_offsets[t]
                out.append((t, ids, grads[lo:hi, : layout.dims[t]]))
        return out

    def row_grads(
        self, layout: TBELayout, lookup: Lookup, grad_output: Tensor
    ) -> list[tuple[int, Tensor, Tensor]]:
        """Per looked-up table: (t, sorted distinct ids [U], summed gradients [U, D]); the same
        sums, in the same order, as the fused update uses (and ``ReferenceBackend.row_grads``)."""
        # Weights are read by nothing (every table is emitted) but must look the part: one
        # never-touched buffer (address space only) is kept and sliced, not allocated per call.
        if self._dummy.numel() < layout.total_elems:
            self._dummy = torch.empty(layout.total_elems)
        return self.backward_update(
            layout,
            self._dummy[: layout.total_elems],
            {},
            lookup,
            grad_output,
            RowOptimizer(kind="sgd"),
            1,
            emit_tables=range(layout.num_tables),
        )


def _raise(rc: int, err: ctypes.Array, layout: TBELayout, idx: Tensor, off: Tensor, b: int) -> None:
    """Turn a kernel return code into a Python error that names the culprit."""
    if rc == _OK:
        return
    if rc == _EID:
        pos = int(err[0])
        bag = int(torch.searchsorted(off, torch.tensor(pos), right=True)) - 1
        f = bag // b
        t = layout.feature_table[f]
        raise TBEIdError(
            f"feature {f} (table {t}, rows {layout.rows[t]}): id {int(idx[pos])} at position "
            f"{pos} (sample {bag % b}) is out of range [0, {layout.rows[t]})"
        )
    if rc == _EOFFSETS:
        raise TBEInputError(
            f"cpu TBE backend: offsets decrease at bag {int(err[0])} "
            f"(feature {int(err[0]) // b}, sample {int(err[0]) % b})"
        )
    if rc == _ENOMEM:  # a bug on our side, not bad input
        raise RuntimeError("cpu TBE backend: workspace smaller than the kernel asked for")
    raise RuntimeError(f"cpu TBE backend: kernel returned unknown code {rc}")
