"""The losses of an ExFM student's step as one autograd node computed by a C kernel
(``csrc/exfm_losses.c``): serving BCE, plain soft distillation, the aux head's soft BCE and the
Student Adapter's BCE, with their gradients, in one pass over the batch.

The torch formulation (``neorec.train.distill``'s ops, ``neorec.modules.exfm_heads``) is the
specification; this is its fast CPU form on each rank (one dense block, float32, CPU), the
same numbers up to float rounding (``tests/test_exfm_losses.py``). ``exfm_losses`` returns None
where it does not apply (no C compiler, another device or dtype), and the caller takes the torch
path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from neorec.ops.fastpath import ran

__all__ = ["exfm_losses", "native_lib", "NonFiniteFM"]

_COEFS: dict[tuple[float, ...], Tensor] = {}  # (read-only, so shared across steps)


class NonFiniteFM(ValueError):
    """A batch's FM logit is NaN or infinite (``index``: the first such sample)."""

    def __init__(self, index: int, count: int) -> None:
        super().__init__(f"{count} non-finite FM logit(s), the first at sample {index}")
        self.index, self.count = index, count


def native_lib() -> Any:
    """The compiled library with the ExFM loss functions declared, or None (no C compiler)."""
    from neorec.ops.cpu import declared_kernel

    return declared_kernel("exfm_losses", _declare)


def _declare(lib: Any) -> None:
    vp, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.exfm_losses_forward.argtypes = [i64, vp, i64, vp, vp, vp, f32, i64, vp, vp]
    lib.exfm_losses_forward.argtypes += [i64, i64, vp, vp, vp, vp, vp, vp, vp, vp]
    lib.exfm_losses_forward.argtypes += [vp, vp, vp]
    lib.exfm_losses_forward.restype = i64
    lib.exfm_losses_backward.argtypes = [i64, i64, i64, i64, vp, vp, vp, vp, vp, vp]
    lib.exfm_losses_backward.restype = None


def _ok(t: Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu")


@dataclass(frozen=True)
class _Targets:
    """What a step's losses read and no gradient reaches: the labels [B], the FM's logits [B],
    the adapter's dense inputs [B, num_dense] (or None), the four weights (a float32 [4]) and
    the soft losses' temperature."""

    labels: Tensor
    fm: Tensor
    dense: Tensor | None
    coef: Tensor
    temperature: float


class _ExfmLosses(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        out: Tensor,
        head_w: Tensor | None,
        head_b: Tensor | None,
        first: Tensor | None,
        second: Tensor | None,
        targets: _Targets,
    ) -> tuple[Tensor, Tensor, Tensor]:
        labels, fm, dense, coef = targets.labels, targets.fm, targets.dense, targets.coef
        temperature = targets.temperature
        lib = native_lib()
        ran("exfm_losses.forward")
        b = out.shape[0]
        h = 0 if head_w is None else head_w.shape[1]
        a = 0 if first is None else first.shape[0] - 1
        n = 0 if first is None else first.shape[1] - 1
        ostride = out.stride(0)
        buf = torch.empty((h + 1) + (a + 1) * (n + 2) + (n + 1) + (a + 1) * (n + 2))
        o = 0
        dhead, o = buf[o : o + h + 1], o + h + 1
        dfirst, o = buf[o : o + (a + 1) * (n + 1)], o + (a + 1) * (n + 1)
        dsecond, o = buf[o : o + a + 1], o + a + 1
        scratch = buf[o:]
        parts, total, adapted = torch.empty(4), torch.empty(()), torch.empty(b if a else 0)
        unit = torch.empty(b, 1 + h) if out.dim() == 2 else torch.empty(b)
        bad = lib.exfm_losses_forward(
            b,
            out.data_ptr(),
            ostride,
            labels.data_ptr(),
            fm.data_ptr(),
            coef.data_ptr(),
            float(temperature),
            h,
            None if head_w is None else head_w.data_ptr(),
            None if head_b is None else head_b.data_ptr(),
            a,
            n,
            None if dense is None else dense.data_ptr(),
            None if first is None else first.data_ptr(),
            None if second is None else second.data_ptr(),
            parts.data_ptr(),
            total.data_ptr(),
            unit.data_ptr(),
            dhead.data_ptr(),
            dfirst.data_ptr(),
            dsecond.data_ptr(),
            adapted.data_ptr(),
            scratch.data_ptr(),
        )
        if bad >= 0:
            raise NonFiniteFM(int(bad), int((~torch.isfinite(fm)).sum()))
        ctx.dims = (b, h, a, n)
        ctx.save_for_backward(unit, dhead, dfirst, dsecond, coef)
        ctx.mark_non_differentiable(parts, adapted)
        return total, parts, adapted

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _g_parts: Tensor, _g_adapted: Tensor) -> tuple[Any, ...]:
        unit, dhead, dfirst, dsecond, coef = ctx.saved_tensors
        b, h, a, n = ctx.dims
        grad = grad.detach().to(torch.float32).contiguous()
        ran("exfm_losses.backward")
        native_lib().exfm_losses_backward(
            b,
            h,
            a,
            n,
            grad.data_ptr(),
            coef.data_ptr(),
            unit.data_ptr(),
            dhead.data_ptr(),
            dfirst.data_ptr(),
            dsecond.data_ptr(),
        )
        dw = dhead[:h].view(1, h) if h else None
        db = dhead[h:] if h else None
        df = dfirst.view(a + 1, n + 1) if a else None
        ds = dsecond if a else None
        return unit, dw, db, df, ds, None


def exfm_losses(
    out: Tensor,
    labels: Tensor,
    fm: Tensor,
    coef: tuple[float, float, float, float],
    temperature: float,
    head: tuple[Tensor, Tensor] | None = None,
    adapter: tuple[Tensor, Tensor] | None = None,
    dense: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(total, parts [4], adapted)`` of one step, or None where the kernel does not apply.

    ``out``: the serving logits [B], or with ``head`` the model's ``[B, 1 + H]`` (serving logit,
    then the top MLP's penultimate layer). ``coef``: the weights of (serving BCE, plain soft BCE,
    aux soft BCE, adapter BCE) in ``total``; ``parts`` are those four losses (detached).
    ``head``: the aux head's ``(weight [1, H], bias [1])``; ``adapter``: the Student Adapter's
    ``(first, second)`` (it reads ``dense`` [B, num_dense] when built with dense inputs).
    ``adapted`` [B] (detached): the adapter's corrected FM logits (empty without an adapter).
    Gradients reach ``out`` and the head's and adapter's parameters. Raises ``NonFiniteFM``
    before anything is updated when an FM logit is not finite."""
    b = out.shape[0]
    tensors = (out, labels, fm, dense, *(head or ()), *(adapter or ()))
    if not all(_ok(t) for t in tensors) or native_lib() is None:
        return None
    if (out.dim() == 2) != (head is not None) or out.dim() == 2 and out.stride(1) != 1:
        return None
    if adapter is not None:
        first = adapter[0]
        n = first.shape[1] - 1
        if n - 2 != (0 if dense is None else dense.shape[1]):
            return None
    if head is not None and (head[0].shape[1] != out.shape[1] - 1):
        return None
    labels, fm = labels.detach().contiguous(), fm.detach().contiguous()
    dense = None if dense is None or adapter is None else dense.detach().contiguous()
    if labels.shape != (b,) or fm.shape != (b,):
        return None
    hw, hb = (head[0].contiguous(), head[1].contiguous()) if head else (None, None)
    fi, se = (adapter[0].contiguous(), adapter[1].contiguous()) if adapter else (None, None)
    c = _COEFS.get(coef)
    if c is None:
        c = _COEFS[coef] = torch.tensor(coef, dtype=torch.float32)
    targets = _Targets(labels, fm, dense, c, float(temperature))
    res: tuple[Tensor, Tensor, Tensor] = _ExfmLosses.apply(out, hw, hb, fi, se, targets)
    return res
