"""The C kernel of an ExFM student's losses (``neorec.ops.exfm_losses``) against the torch path
it replaces on the CPU (``neorec.train.distill`` with ``FAST_LOSSES`` off, the specification):
the same losses and gradients up to float rounding for plain distillation, the aux head and the
aux head + adapter, at T = 1 and 2, with one and two dense blocks; bitwise the same across runs;
a non-finite FM logit refused before any update; the torch path where the kernel does not apply."""

from __future__ import annotations

import pytest
import torch
from test_distill import AUX, cfg_of, model_of, with_fm

import neorec.train.distill as distill
from neorec.builder import dense_optimizer
from neorec.data.batch import Batch
from neorec.errors import DataError
from neorec.ops.exfm_losses import exfm_losses, native_lib
from neorec.train.losses import make_loss
from neorec.train.steps import train_step

pytestmark = pytest.mark.skipif(native_lib() is None, reason="no C compiler")

SETUPS = {
    "plain": ["distill.enabled=true", "distill.weight=0.4"],
    "aux": [*AUX, "distill.aux_weight=0.7"],
    "aux+adapter": [*AUX, "distill.aux_weight=0.7", "distill.adapter=true"],
}


def _batches(cfg, n: int = 3) -> list[Batch]:
    from neorec.data.synthetic import SyntheticClickData

    data = SyntheticClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        b = data.batch("train", i, 64)
        out.append(with_fm(b, torch.randn(b.size, generator=g) * 2.0))
    return out


def _run(cfg, batches, fast: bool, monkeypatch) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of a few steps and the parameters after them; grads of the first step."""
    monkeypatch.setattr(distill, "FAST_LOSSES", fast)
    torch.manual_seed(0)
    m = model_of(cfg)
    opt = dense_optimizer(cfg.train, m.dense_parameters())
    losses, grads = [], {}
    for step, b in enumerate(batches, 1):
        losses.append(float(train_step(m, opt, b, step, loss_fn=make_loss(cfg.distill))))
        if step == 1:
            grads = {
                n: p.grad.clone() for n, p in m.dense_arch.named_parameters() if p.grad is not None
            }
    state = {f"dense.{k}": v for k, v in m.dense_arch.state_dict().items()}
    state["ebc"] = m.ebc.weights.detach().clone()
    return losses, {**state, **{f"grad.{k}": v for k, v in grads.items()}}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("blocks", [1, 2])
def test_kernel_equals_torch_path(setup, temperature, blocks, monkeypatch, fast_paths):
    cfg = cfg_of(
        *SETUPS[setup], f"distill.temperature={temperature}", f"train.dense_blocks={blocks}"
    )
    batches = _batches(cfg)
    la, sa = _run(cfg, batches, False, monkeypatch)
    assert fast_paths()["exfm_losses.forward"] == 0, "the torch path is the specification"
    lb, sb = _run(cfg, batches, True, monkeypatch)
    ran = fast_paths()  # the C kernel computed every step's losses and their gradients
    assert ran["exfm_losses.forward"] == ran["exfm_losses.backward"] == len(batches)
    assert all(abs(x - y) <= 2e-7 for x, y in zip(la, lb)), (la, lb)
    assert sa.keys() == sb.keys()
    for k in sa:
        scale = max(1.0, float(sa[k].abs().max()))
        assert torch.allclose(sa[k], sb[k], rtol=0, atol=2e-6 * scale), (
            k,
            (sa[k] - sb[k]).abs().max(),
        )
    if setup == "aux+adapter":  # the adapter's and the aux head's parameters did train
        assert any(k.startswith("grad.adapter.") for k in sb)
        assert any(k.startswith("grad.aux_head.") for k in sb)
    # deterministic: a second run is bitwise the first
    lc, sc = _run(cfg, batches, True, monkeypatch)
    assert la != [] and lb == lc and all(torch.equal(sb[k], sc[k]) for k in sb)


def test_parts_and_gradients_against_autograd():
    """Each of the four losses and its gradients against the formulas written with autograd."""
    import torch.nn.functional as F

    from neorec.modules.exfm_heads import StudentAdapter

    g = torch.Generator().manual_seed(1)
    b, h, nd, t = 32, 6, 3, 1.5
    out = torch.randn(b, 1 + h, generator=g, requires_grad=True)
    labels = (torch.rand(b, generator=g) < 0.3).float()
    fm, dense = torch.randn(b, generator=g), torch.randn(b, nd, generator=g)
    head = torch.nn.Linear(h, 1)
    ad = StudentAdapter(5, nd, seed=3)
    with torch.no_grad():
        ad.second.copy_(torch.randn(6, generator=g))  # not the pass-through init
    coef = (0.9, 0.3, 0.7, 1.1)
    res = exfm_losses(
        out, labels, fm, coef, t, (head.weight, head.bias), (ad.first, ad.second), dense
    )
    assert res is not None
    total, parts, adapted = res
    total.backward()
    got = [out.grad, head.weight.grad, head.bias.grad, ad.first.grad, ad.second.grad]
    for p in (out, head.weight, head.bias, ad.first, ad.second):
        p.grad = None
    z = out[:, 0]
    serving = F.binary_cross_entropy_with_logits(z, labels)
    soft = t * t * F.binary_cross_entropy_with_logits(z / t, torch.sigmoid(fm / t))
    o = ad(fm, z, dense)
    adapter = F.binary_cross_entropy_with_logits(o, labels)
    aux_logit = head(out[:, 1:]).squeeze(1)
    aux = t * t * F.binary_cross_entropy_with_logits(aux_logit / t, torch.sigmoid(o.detach() / t))
    want = torch.stack([serving, soft, aux, adapter])
    assert torch.allclose(parts, want.detach(), rtol=1e-6, atol=1e-7), (parts, want)
    assert torch.allclose(adapted, o.detach(), rtol=1e-6, atol=1e-6)
    ref_total = sum(c * x for c, x in zip(coef, want))
    assert abs(float(total.detach()) - float(ref_total.detach())) <= 1e-6
    ref_total.backward()
    ref = [out.grad, head.weight.grad, head.bias.grad, ad.first.grad, ad.second.grad]
    for name, x, y in zip(["out", "w", "b", "first", "second"], got, ref):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-7), (name, (x - y).abs().max())


def test_non_finite_fm_refused_before_any_update(monkeypatch):
    monkeypatch.setattr(distill, "FAST_LOSSES", True)
    cfg = cfg_of(*SETUPS["aux+adapter"])
    b = _batches(cfg, 1)[0]
    fm = b.fm_logits.clone()
    fm[7] = float("nan")
    m = model_of(cfg)
    opt = dense_optimizer(cfg.train, m.dense_parameters())
    before = {k: v.clone() for k, v in m.dense_arch.state_dict().items()}
    emb = m.ebc.weights.detach().clone()
    with pytest.raises(DataError, match="1 non-finite value"):
        train_step(m, opt, with_fm(b, fm), 1, loss_fn=make_loss(cfg.distill))
    assert all(torch.equal(v, m.dense_arch.state_dict()[k]) for k, v in before.items())
    assert torch.equal(m.ebc.weights, emb)


def test_torch_path_where_the_kernel_does_not_apply():
    out = torch.randn(8, 3, dtype=torch.float64)
    labels, fm = torch.zeros(8), torch.zeros(8)
    w, b = torch.zeros(1, 2), torch.zeros(1)
    assert exfm_losses(out, labels, fm, (1, 0, 1, 0), 1.0, (w, b)) is None  # float64
    assert exfm_losses(out.float(), labels, fm, (1, 0, 1, 0), 1.0) is None  # [B, 1 + H], no head
    assert exfm_losses(out.float(), labels, fm, (1, 0, 1, 0), 1.0, (torch.zeros(1, 5), b)) is None


@pytest.mark.parametrize("blocks", [1, 2])
def test_alone_step_takes_the_kernel_and_equals_torch_bce(blocks, fast_paths):
    """A step without distillation with ``fused_bce`` (``bench distill``'s ``alone``) computes its
    BCE and gradient by the same C kernel as the distilled setups: the kernel ran once forward and
    once backward per step, and losses and parameters equal torch's per-block BCE (the default)."""
    cfg = cfg_of(f"train.dense_blocks={blocks}")
    batches = _batches(cfg)

    def run(fused: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        m = model_of(cfg)
        opt = dense_optimizer(cfg.train, m.dense_parameters())
        losses = [
            float(train_step(m, opt, b, i, loss_fn=make_loss(fused_bce=fused)))
            for i, b in enumerate(batches, 1)
        ]
        state = {k: v.clone() for k, v in m.dense_arch.state_dict().items()}
        return losses, {**state, "ebc": m.ebc.weights.detach().clone()}

    la, sa = run(False)
    assert fast_paths()["exfm_losses.forward"] == 0, "torch's BCE is the specification"
    lb, sb = run(True)
    ran = fast_paths()
    assert ran["exfm_losses.forward"] == ran["exfm_losses.backward"] == len(batches)
    assert all(abs(x - y) <= 2e-7 for x, y in zip(la, lb)), (la, lb)
    assert la[0] != la[-1]  # the steps trained
    for k in sa:
        scale = max(1.0, float(sa[k].abs().max()))
        assert torch.allclose(sa[k], sb[k], rtol=0, atol=2e-6 * scale), k
    # with the fast losses off, fused_bce falls back to torch's numbers exactly
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distill, "FAST_LOSSES", False)
        before = fast_paths()["exfm_losses.forward"]
        lc, sc = run(True)
        assert fast_paths()["exfm_losses.forward"] == before
    assert lc == la and all(torch.equal(sa[k], sc[k]) for k in sa)


def test_serving_bce_is_torch_bce_with_its_gradient():
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(2)
    z = (torch.randn(40, generator=g) * 3).requires_grad_()
    y = (torch.rand(40, generator=g) < 0.4).float()
    got = distill.serving_bce(z, y)
    assert got is not None
    (gz,) = torch.autograd.grad(got, z)
    want = F.binary_cross_entropy_with_logits(z, y)
    (wz,) = torch.autograd.grad(want, z)
    assert abs(float(got.detach()) - float(want.detach())) <= 1e-6
    assert torch.allclose(gz, wz, atol=1e-7)
    assert distill.serving_bce(z.double(), y.double()) is None  # not float32: torch's path
