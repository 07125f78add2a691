"""ExFM student parts beside the serving model: the Student Adapter and the losses of the
auxiliary head and the adapter, with their gradients written by hand.

The adapter reads only data (the FM's logit, the student's detached logit, the dense features),
so nothing upstream needs its gradient, and the aux head is one linear layer on the top MLP's
penultimate layer. On a small student, autograd's bookkeeping for these few hundred weights (~40
nodes a step) costs more than their arithmetic, so each loss here is one autograd node: the
forward computes the losses and every gradient in a dozen tensor ops, the backward scales them.
They equal the autograd formulation (``StudentAdapter.forward`` + BCE, ``Linear`` + soft BCE) up
to float rounding (``tests/test_exfm_chain.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["StudentAdapter", "aux_soft_bce", "adapter_and_aux_losses"]


class StudentAdapter(nn.Module):
    """ExFM's Student Adapter: ``(fm_logit, student_logit, dense)`` -> a corrected FM logit [B].

    Inputs x = [fm_logit, student_logit (detached), the dense features] (n values):
    ``out = <a, x> + c + w2 . relu(W1 x + b1) + b2``, a linear part plus a one-hidden-layer MLP.
    The parameters are packed: ``first`` [H + 1, n + 1] = [[W1, b1], [a, c]] (one GEMM for the
    MLP's first layer and the linear part) and ``second`` [H + 1] = [w2, b2]. The linear part
    starts as the identity on the FM logit (a = e_0, c = 0) and ``second`` at zero, so an
    untrained adapter passes the FM logit through. Trained on the true labels it learns the FM's
    staleness and the FM / VM gap: a scale and shift of its logit, what the fresh student knows
    that the FM does not, and the part that is a function of the dense features.
    """

    def __init__(self, hidden: int, num_dense: int = 0, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        n = 2 + num_dense
        self.hidden, self.inputs = hidden, n
        first = torch.zeros(hidden + 1, n + 1)
        first[:hidden, :n] = torch.randn(hidden, n, generator=g) * math.sqrt(2.0 / (n + hidden))
        first[:hidden, n] = torch.randn(hidden, generator=g) * 0.1
        first[hidden, 0] = 1.0
        self.first = nn.Parameter(first)
        self.second = nn.Parameter(torch.zeros(hidden + 1))

    def features(self, fm_logit: Tensor, student_logit: Tensor, dense: Tensor | None) -> Tensor:
        """The adapter's input rows ``[fm, student, dense..., 1]`` [B, n + 1] (no gradient)."""
        b = fm_logit.shape[0]
        x = torch.empty(b, self.inputs + 1, dtype=torch.float32, device=fm_logit.device)
        x[:, 0] = fm_logit.detach()
        x[:, 1] = student_logit.detach()
        if self.inputs > 2:
            if dense is None:
                raise ValueError("this adapter reads the dense features: pass dense")
            x[:, 2:-1] = dense.detach()
        x[:, -1] = 1.0
        return x

    def forward(
        self, fm_logit: Tensor, student_logit: Tensor, dense: Tensor | None = None
    ) -> Tensor:
        """Corrected FM logits [B] from ``fm_logit`` [B], ``student_logit`` [B] and, when the
        adapter was built with ``num_dense``, the dense features [B, num_dense]."""
        x = self.features(fm_logit, student_logit, dense)
        h = self.hidden
        pre = x @ self.first.t()
        return pre[:, :h].relu() @ self.second[:h] + pre[:, h] + self.second[h]


def _adapter_pass(x: Tensor, labels: Tensor, first: Tensor, second: Tensor) -> tuple[Tensor, ...]:
    """The adapter's forward and gradients: (loss, corrected logits, d first, d second)."""
    b, h = x.shape[0], first.shape[0] - 1
    pre = x @ first.t()  # [B, H + 1]
    act = pre[:, :h].relu()
    out = torch.addmv(pre[:, h] + second[h], act, second[:h])  # [B]
    loss = F.binary_cross_entropy_with_logits(out, labels)
    g = (torch.sigmoid(out) - labels) / b  # d loss / d out
    dpre = torch.empty_like(pre)
    torch.mul(torch.outer(g, second[:h]), pre[:, :h] > 0, out=dpre[:, :h])
    dpre[:, h] = g
    dsecond = torch.empty_like(second)
    torch.mv(act.t(), g, out=dsecond[:h])
    dsecond[h] = g.sum()
    return loss, out, dpre.t() @ x, dsecond


def _aux_pass(
    hidden: Tensor, weight: Tensor, bias: Tensor, target: Tensor, t: float
) -> tuple[Tensor, Tensor]:
    """The aux head's soft BCE (T^2-scaled) and its gradient by the aux logit [B]."""
    b = hidden.shape[0]
    aux = torch.addmv(bias, hidden, weight[0])  # [B]
    if t == 1.0:
        q = torch.sigmoid(target)
        loss = F.binary_cross_entropy_with_logits(aux, q)
        return loss, (torch.sigmoid(aux) - q) / b
    q = torch.sigmoid(target / t)
    z = aux / t
    loss = F.binary_cross_entropy_with_logits(z, q) * (t * t)
    return loss, (torch.sigmoid(z) - q) * (t / b)


def _aux_grads(ctx_saved: tuple[Tensor, ...], grad: Tensor, need_hidden: bool) -> list[Any]:
    hidden, weight, ga = ctx_saved
    ga = ga * grad
    dh = torch.outer(ga, weight[0]) if need_hidden else None
    return [dh, (ga @ hidden)[None], ga.sum()[None]]


class _AuxSoftBCE(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor, target: Tensor, t: float
    ) -> Tensor:
        loss, ga = _aux_pass(hidden, weight, bias, target, t)
        ctx.save_for_backward(hidden, weight, ga)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        return (*_aux_grads(ctx.saved_tensors, grad, ctx.needs_input_grad[0]), None, None)


class _AdapterAndAux(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor,
        first: Tensor,
        second: Tensor,
        x: Tensor,
        labels: Tensor,
        t: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        ad_loss, out, dfirst, dsecond = _adapter_pass(x, labels, first, second)
        aux_loss, ga = _aux_pass(hidden, weight, bias, out, t)
        ctx.save_for_backward(hidden, weight, ga, dfirst, dsecond)
        ctx.mark_non_differentiable(out)
        return ad_loss, aux_loss, out

    @staticmethod
    def backward(ctx: Any, g_ad: Tensor, g_aux: Tensor, _g_out: Tensor) -> tuple[Any, ...]:
        hidden, weight, ga, dfirst, dsecond = ctx.saved_tensors
        aux = _aux_grads((hidden, weight, ga), g_aux, ctx.needs_input_grad[0])
        return (*aux, dfirst * g_ad, dsecond * g_ad, None, None, None)


def aux_soft_bce(
    hidden: Tensor, weight: Tensor, bias: Tensor, target: Tensor, temperature: float
) -> Tensor:
    """The auxiliary head's distillation loss ``T^2 BCE(aux / T, sigmoid(target / T))`` with
    ``aux = hidden @ weight.T + bias`` (``weight`` [1, H], ``bias`` [1]); gradients to
    ``hidden``, ``weight`` and ``bias`` (``target`` gets none)."""
    out: Tensor = _AuxSoftBCE.apply(hidden, weight, bias, target.detach(), float(temperature))
    return out


def adapter_and_aux_losses(
    adapter: StudentAdapter,
    head: nn.Linear,
    hidden: Tensor,
    fm_logit: Tensor,
    student_logit: Tensor,
    dense: Tensor | None,
    labels: Tensor,
    temperature: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(adapter loss, aux loss, corrected FM logits)`` of the full ExFM student in one node: the
    adapter's ``BCE(adapter(fm, student, dense), label)`` (gradients to its parameters only) and
    the aux head's soft BCE toward the adapter's detached output (gradients to ``hidden`` and the
    head); the corrected logits carry no gradient."""
    x = adapter.features(fm_logit, student_logit, dense)
    ad, aux, out = _AdapterAndAux.apply(
        hidden,
        head.weight,
        head.bias,
        adapter.first,
        adapter.second,
        x,
        labels,
        float(temperature),
    )
    return ad, aux, out
