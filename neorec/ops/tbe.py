"""Table-batched embedding (TBE): pooled lookups of many tables in one call, backward fused with
the row optimizer.

Backward never materializes a gradient for the weights: the backend receives the gradient of the
pooled output, sums the gradients of each distinct row of each table in a fixed order (feature
order, then position in the batch), and applies ``row_optim`` to those rows in place.

Backends (same interface, same semantics):
- ``reference``: plain PyTorch ops; the oracle for tests.
- ``cpu``: a C kernel compiled on first use (OpenMP, AVX-512 where present); see ``ops/cpu.py``.
- ``cuda``: PyTorch ops on the GPU with deterministic sort-based reductions; see ``ops/cuda.py``.
- ``triton``: ``@triton.jit`` kernels (optional ``neorec[gpu]`` extra); CUDA tensors, or CPU
  tensors under ``TRITON_INTERPRET=1`` (triton's interpreter); see ``ops/triton_tbe.py``.

The types are in ``tbe_types``, the reference backend in ``tbe_reference``, row updates outside a
kernel in ``tbe_rows``; this module is the backend registry and the autograd op, and re-exports
the names callers use.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from neorec.errors import ConfigError
from neorec.ops.tbe_checks import (
    NonFiniteGradientError,
    TBEIdError,
    TBEInputError,
    check_finite_weights,
    check_grad_output,
    check_ids,
    check_offsets,
)
from neorec.ops.tbe_reference import ReferenceBackend, row_grads
from neorec.ops.tbe_rows import apply_row_grads, group_calls, update_table_rows
from neorec.ops.tbe_types import Lookup, PoolingMode, TBEBackend, TBELayout

__all__ = [
    "PoolingMode",
    "fused_op",
    "TBELayout",
    "Lookup",
    "TBEBackend",
    "ReferenceBackend",
    "get_backend",
    "available_backends",
    "tbe_lookup",
    "row_grads",
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
    """Forward: ``run()`` (a lookup). Backward: hands d(out) to ``update``; no weight gradient."""

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

    return fused_op(anchor, run, update)


def fused_op(anchor: Tensor, run: Callable[[], Tensor], update: Callable[[Tensor], None]) -> Tensor:
    """``run()`` in the autograd graph through the zero-element ``anchor`` (``requires_grad``):
    its backward calls ``update(grad)`` and the weights get no ``.grad``; outside autograd (no
    grad, or an anchor that needs none), plainly ``run()``. The pooled and the sequence lookups
    both go through it."""
    if not (torch.is_grad_enabled() and anchor.requires_grad):
        return run()
    out: Tensor = _TBEFunction.apply(anchor, run, update)
    return out
