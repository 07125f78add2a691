"""The kernels a dispatched site runs: a Linear and the DLRM dot interaction in a chosen precision.

Weights stay fp32 (master weights: the optimizer updates them in fp32); each step the operands are
cast to the candidate's format, the GEMM accumulates in fp32 where the hardware does (AMX,
AVX512-BF16, tensor cores) and its output is stored in the format (bf16 for fp8 GEMMs, as
``torch._scaled_mm`` returns), then widened to fp32. A bf16 / fp16 Linear adds its bias inside
the GEMM, in the format (as ``torch.autocast`` does: one pass over the output instead of two;
the probe models it so); the fp8 GEMMs add it in fp32 after. Autograd carries the gradients back through the casts, so the backward GEMMs run in the
same format.

fp8 on CUDA uses ``torch._scaled_mm`` (row-wise or tensor-wise scales) — written to the API but
not run here (no GPU): its speed is unmeasured. Elsewhere fp8 is emulated exactly
(:func:`neorec.lowp.formats.quantize`), which is correct and slow, so dispatch never picks it for
speed on a CPU; a forced ``lowp.mode = "fp8"`` runs it for its numerics.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from neorec.lowp.formats import Candidate, fp8_scale, quantize

__all__ = ["linear", "dot_bmm", "out_round", "pow2_row_scale"]


def out_round(y: Tensor, cand: Candidate) -> Tensor:
    """A GEMM's fp32 result as the candidate's kernel stores it (bf16 for fp8 GEMMs)."""
    if cand.kind == "fp32":
        return y
    dt = torch.bfloat16 if cand.kind == "fp8" else cand.dtype
    return y.to(dt).float()


class _Fp8Mm(torch.autograd.Function):
    """``a @ b`` with both operands in fp8 (scaled per row of ``a`` and per column of ``b``, or
    per tensor), output in bf16; backward: the two gradient GEMMs in the same fp8 format."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, cand: Candidate) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b)
        ctx.cand = cand
        return _fp8_mm(a, b, cand)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        cand = ctx.cand
        return _fp8_mm(g, b.t(), cand), _fp8_mm(a.t(), g, cand), None


def _fp8_mm(a: Tensor, b: Tensor, cand: Candidate) -> Tensor:
    a, b = a.float(), b.float()
    if a.is_cuda and hasattr(torch, "_scaled_mm"):  # pragma: no cover - needs an fp8 GPU
        sa = fp8_scale(a, cand.fp8, cand.scaling)
        sb = fp8_scale(b.t(), cand.fp8, cand.scaling)
        sa2 = sa.view(-1, 1) if sa.dim() else sa
        sb2 = sb.view(1, -1) if sb.dim() else sb
        qa = (a / sa2).to(cand.dtype)
        qb = (b / sb2).to(cand.dtype).t().contiguous().t()  # column-major, as cuBLASLt wants
        out = torch._scaled_mm(qa, qb, scale_a=sa2, scale_b=sb2, out_dtype=torch.bfloat16)
        return out.float()
    qa = quantize(a, cand)
    qb = quantize(b.t(), cand).t()  # scaled per column of b
    return out_round(qa @ qb, cand)


def linear(x: Tensor, w: Tensor, b: Tensor | None, cand: Candidate, keep: bool = False) -> Tensor:
    """``F.linear(x, w, b)`` with the GEMM in ``cand``'s precision (fp32 in and out; ``keep``: a
    bf16 / fp16 output stays in its format, for a consumer that casts it there anyway)."""
    if cand.kind == "fp32":
        return F.linear(x, w, b)
    if cand.kind == "fp8":
        x2 = x.reshape(-1, x.shape[-1])
        y = _Fp8Mm.apply(x2, w.t(), cand).view(*x.shape[:-1], w.shape[0])
        return y if b is None else y + b
    bias = None if b is None else b.to(cand.dtype)
    y = F.linear(x.to(cand.dtype), w.to(cand.dtype), bias)
    return y if keep else y.float()


def pow2_row_scale(t: Tensor) -> Tensor:
    """Per row of ``t`` (last dim), the power of two at or above its amax (1 for a zero row):
    dividing by it is exact in any binary float format and brings the row into [-1, 1]."""
    amax = t.detach().abs().amax(dim=-1, keepdim=True).float()
    e = torch.ceil(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax))))
    return torch.exp2(e)


def dot_bmm(t: Tensor, cand: Candidate, row_scale: bool = False) -> Tensor:
    """``t @ t^T`` per sample ([B, n, d] -> [B, n, n]) in ``cand``'s precision.

    ``row_scale`` (a LoKA mod): each feature vector is divided by a power of two bringing it into
    [-1, 1] before the cast, and the products are scaled back in fp32 (exact), so an fp16
    interaction cannot overflow however large the pooled embeddings grow."""
    if cand.kind == "fp32":
        return torch.bmm(t, t.transpose(1, 2))
    if cand.kind == "fp8":
        return torch.stack([_Fp8Mm.apply(ti, ti.t(), cand) for ti in t.unbind(0)])
    if row_scale:
        s = pow2_row_scale(t)  # [B, n, 1]
        q = (t / s).to(cand.dtype)
        return torch.bmm(q, q.transpose(1, 2)).float() * (s * s.transpose(1, 2))
    q = t.to(cand.dtype)
    return torch.bmm(q, q.transpose(1, 2)).float()
