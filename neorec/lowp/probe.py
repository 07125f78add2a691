"""LoKA's probe: per dense site, statistics and the error of every candidate precision vs fp32.

Sites (found by walking the dense part of a model):

- ``linear``: every ``nn.Linear`` (bottom and top MLPs, DCN cross layers);
- ``interaction``: the DLRM dot interaction (a batched GEMM of the feature vectors);
- ``pooled``: the pooled embeddings entering the dense part (what the all-to-all carries forward,
  and their gradient, what it carries back);
- ``embedding``: the table weights (their storage format), when a ``weights`` callable is given.

On a sampled step (the first ``first`` steps, then every ``every``-th) forward and backward hooks
keep each site's fp32 inputs and output gradient; :meth:`Probe.collect` then computes, per
candidate, the relative error (Frobenius norm) of the forward output and of the gradients the
site's backward would give with its operands stored in that format, accumulating in fp32 as the
hardware does. Over the sampled steps each error gets an upper confidence bound (one-sided 95%,
Student t). Everything here is deterministic for a seed: the same training gives the same table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from neorec.lowp.formats import CANDIDATES, Candidate, quantize
from neorec.lowp.kernels import out_round, pow2_row_scale
from neorec.metrics import t_quantile

__all__ = ["Site", "SiteStats", "Probe", "find_sites", "tensor_stats", "upper_bound"]

_STAT_SAMPLE = 1 << 14  # percentiles over at most this many elements (a fixed stride)
MAX_ROWS = 1024  # errors of a step are measured on at most this many rows (a fixed stride)
WINDOW = 16  # error samples per site and candidate the bound is taken over
OUTLIER_RMS = 6.0  # an element is an outlier beyond this many RMS of its tensor


def upper_bound(values: list[float]) -> float:
    """One-sided 95% upper confidence bound of the mean of ``values`` (their only value if one)."""
    n = len(values)
    if n == 0:
        return math.nan
    mean = sum(values) / n
    if n == 1:
        return mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t = t_quantile(0.95, n - 1)
    return mean + t * sd / math.sqrt(n)


def tensor_stats(x: Tensor) -> dict[str, float]:
    """amax, RMS, |x| percentiles (50, 99, 99.9) and the fraction of outliers of ``x``."""
    a = x.detach().float().abs().flatten()
    if a.numel() == 0:
        return {"amax": 0.0, "rms": 0.0, "p50": 0.0, "p99": 0.0, "p999": 0.0, "outliers": 0.0}
    rms = float(a.square().mean().sqrt())
    s = a[:: max(1, a.numel() // _STAT_SAMPLE)].sort().values  # one sort for the three
    n = s.numel() - 1
    p50, p99, p999 = (float(s[round(q * n)]) for q in (0.5, 0.99, 0.999))
    out = float((a > OUTLIER_RMS * rms).float().mean()) if rms > 0 else 0.0
    return {
        "amax": float(a.max()),
        "rms": rms,
        "p50": p50,
        "p99": p99,
        "p999": p999,
        "outliers": out,
    }


def _rows(x: Tensor) -> Tensor:
    """At most ``MAX_ROWS`` rows of ``x`` (every k-th: deterministic, spread over the batch)."""
    return x[:: -(-x.shape[0] // MAX_ROWS)] if x.shape[0] > MAX_ROWS else x


def _rel(approx: Tensor, exact: Tensor) -> float:
    den = float(exact.norm())
    num = float((approx - exact).norm())
    if not math.isfinite(num):
        return math.inf
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


@dataclass
class Site:
    """One place a precision is chosen: its name (module path), kind and module."""

    name: str
    kind: str  # "linear" | "interaction" | "pooled" | "embedding"
    module: nn.Module | None = None
    shape: tuple[int, ...] = ()  # linear: (in, out); interaction: (features, dim)
    rows: int = 0  # batch rows the site saw when probed (what its kernels are timed at)


@dataclass
class SiteStats:
    """What the probe learned about a site over the sampled steps."""

    site: Site
    samples: int = 0
    stats: dict[str, dict[str, float]] = field(default_factory=dict)  # act / weight / grad
    errors: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # cand -> fwd/grad

    def bound(self, cand: str) -> float:
        """The upper confidence bound of the candidate's worse error (forward or gradient)."""
        e = self.errors.get(cand)
        if not e:
            return math.nan
        return max(upper_bound(v) for v in e.values() if v)

    def worst(self, cand: str) -> float:
        """The largest error seen for the candidate."""
        e = self.errors.get(cand, {})
        return max((max(v) for v in e.values() if v), default=math.nan)

    def _merge_stats(self, key: str, s: dict[str, float]) -> None:
        old = self.stats.get(key)
        if old is None:
            self.stats[key] = dict(s)
            return
        for k, v in s.items():  # amax and percentiles: the largest seen; rms, outliers: too
            old[k] = max(old[k], v)

    def _add_error(self, cand: str, what: str, value: float) -> None:
        v = self.errors.setdefault(cand, {}).setdefault(what, [])
        v.append(value)
        del v[:-WINDOW]  # the bound follows the recent steps (statistics drift)


def find_sites(dense: nn.Module) -> list[Site]:
    """The dense sites of a model's dense part (``DenseArch``, possibly DDP-wrapped)."""
    from neorec.modules.dlrm import DotInteraction

    root = getattr(dense, "module", dense)
    sites: list[Site] = [Site("pooled", "pooled", root)]
    for name, m in root.named_modules():
        if isinstance(m, nn.Linear):
            sites.append(Site(name, "linear", m, (m.in_features, m.out_features)))
        elif isinstance(m, DotInteraction):
            sites.append(Site(name, "interaction", m))
    return sites


class Probe:
    """Hooks on a dense part that measure every site's error per candidate on sampled steps.

    ``weights``: a callable giving ``{table: weight}`` for the embedding-weight sites (optional).
    Call :meth:`step_begin` before a step's forward, :meth:`collect` after its backward.
    """

    def __init__(
        self,
        dense: nn.Module,
        candidates: Iterable[Candidate] = CANDIDATES,
        first: int = 4,
        every: int = 100,
        weights: Callable[[], dict[str, Tensor]] | None = None,
        row_scale: bool = True,
    ) -> None:
        self.row_scale = row_scale  # measure the interaction with the row-scaling mod
        self.candidates = [c for c in candidates if c.kind != "fp32"]
        self.first, self.every = first, every
        self.sites = find_sites(dense)
        self.results: dict[str, SiteStats] = {s.name: SiteStats(s) for s in self.sites}
        self.weights = weights
        self.skip: set[str] = set()  # sites no longer measured (dispatch: nothing to choose)
        self.steps_probed = 0
        self._active = False
        self._saved: dict[str, dict[str, Any]] = {}
        self._handles: list[Any] = []
        for s in self.sites:
            assert s.module is not None
            if s.kind == "pooled":
                self._handles.append(s.module.register_forward_pre_hook(self._pooled_hook(s)))
            else:
                self._handles.append(s.module.register_forward_hook(self._fwd_hook(s)))

    # ---- scheduling ---------------------------------------------------------------------------
    def wants(self, step: int) -> bool:
        """Whether ``step`` (0-based) is a sampled step."""
        return step < self.first or (self.every > 0 and step % self.every == 0)

    def step_begin(self, step: int) -> bool:
        """Arm the hooks if ``step`` is sampled (and a site is still measured); returns whether
        it is."""
        self._active = self.wants(step) and len(self.skip) < len(self.sites)
        self._saved = {}
        return self._active

    def remove(self) -> None:
        """Detach every hook."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- hooks: keep fp32 copies of what each site saw ----------------------------------------
    def _pooled_hook(self, site: Site) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple[Any, ...]) -> None:
            if not self._active or len(args) < 2 or site.name in self.skip:
                return
            pooled = args[1]
            rec = self._saved.setdefault(site.name, {})
            rec["x"] = pooled.detach().float().clone()
            if pooled.requires_grad:
                pooled.register_hook(lambda g: rec.__setitem__("g", g.detach().float().clone()))

        return hook

    def _fwd_hook(self, site: Site) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if not self._active or site.name in self.skip:
                return
            rec = self._saved.setdefault(site.name, {})
            if "x" in rec:  # a site called per dense block: its first block stands for the step
                return
            rec["x"] = tuple(a.detach().float().clone() for a in args if isinstance(a, Tensor))
            if isinstance(out, Tensor) and out.requires_grad:  # the output's gradient, once
                out.register_hook(lambda g: rec.__setitem__("g", g.detach().float().clone()))

        return hook

    # ---- measurement ------------------------------------------------------------------------
    @torch.no_grad()
    def collect(self) -> bool:
        """Measure the sampled step's sites (no-op on other steps); returns whether it measured."""
        if not self._active:
            return False
        self._active = False
        for s in self.sites:
            rec = self._saved.get(s.name)
            if not rec or "x" not in rec or s.name in self.skip:
                continue
            r = self.results[s.name]
            if s.kind == "linear":
                self._linear(r, rec)
            elif s.kind == "interaction":
                self._interaction(r, rec)
            else:
                self._tensor_site(r, rec["x"], rec.get("g"))
        if self.weights is not None:
            for table, w in self.weights().items():
                name = f"embedding.{table}"
                if name not in self.results:
                    site = Site(name, "embedding", None, tuple(w.shape))
                    self.sites.append(site)
                    self.results[name] = SiteStats(site)
                self._tensor_site(self.results[name], w.detach().float(), None, weight=True)
        self._saved = {}
        self.steps_probed += 1
        return True

    def _linear(self, r: SiteStats, rec: dict[str, Any]) -> None:
        m = r.site.module
        assert isinstance(m, nn.Linear)
        x = rec["x"][0]
        x2 = _rows(x.reshape(-1, x.shape[-1]))
        w, b = m.weight.detach().float(), None if m.bias is None else m.bias.detach().float()
        g = rec.get("g")
        g2 = None if g is None else _rows(g.reshape(-1, g.shape[-1]))
        y = F.linear(x2, w, b)
        r.site.rows = x.numel() // x.shape[-1]  # the whole batch's rows (what is timed)
        r.samples += 1
        r._merge_stats("act", tensor_stats(x2))
        r._merge_stats("weight", tensor_stats(w))
        if g2 is not None:
            r._merge_stats("grad", tensor_stats(g2))
            dx, dw = g2 @ w, g2.t() @ x2
        for c in self.candidates:
            qx, qw = quantize(x2, c), quantize(w, c)
            yc = qx @ qw.t()
            if b is not None and c.kind != "fp8":  # the kernel adds the bias in the GEMM
                yc = yc + quantize(b, c)
            yc = out_round(yc, c)
            if b is not None and c.kind == "fp8":  # ... and after an fp8 GEMM, in fp32
                yc = yc + b
            r._add_error(c.name, "fwd", _rel(yc, y))
            if g2 is not None:
                qg = quantize(g2, c)
                # scales as a row-wise scaled GEMM takes them: rows of A, columns of B
                r._add_error(c.name, "dgrad", _rel(out_round(qg @ quantize(w.t(), c).t(), c), dx))
                # the weight gradient's operands: rows of g^T are output channels, of x^T inputs
                wg = out_round(quantize(g2.t(), c) @ quantize(x2.t(), c).t(), c)
                r._add_error(c.name, "wgrad", _rel(wg, dw))

    def _interaction(self, r: SiteStats, rec: dict[str, Any]) -> None:
        m = r.site.module
        dense, pooled = rec["x"][0], rec["x"][1]
        t = _rows(torch.cat([dense.unsqueeze(1), pooled], dim=1))  # [B, F+1, D]
        bsz, n, d = t.shape
        r.site.shape, r.site.rows = (n, d), dense.shape[0]
        z = torch.bmm(t, t.transpose(1, 2))
        r.samples += 1
        r._merge_stats("act", tensor_stats(t))
        gz = None
        g = rec.get("g")
        if g is not None:
            g = _rows(g)
            r._merge_stats("grad", tensor_stats(g))
            rows, cols = getattr(m, "rows"), getattr(m, "cols")  # noqa: B009 - buffers
            assert isinstance(rows, Tensor) and isinstance(cols, Tensor)
            gz = torch.zeros_like(z)
            gz[:, rows, cols] = g[:, d:]
            dt = torch.bmm(gz + gz.transpose(1, 2), t)
        for c in self.candidates:
            scaled = self.row_scale and c.kind in ("bf16", "fp16")
            sc = pow2_row_scale(t) if scaled else torch.ones(bsz, n, 1)
            qt = quantize((t / sc).reshape(bsz * n, d), c).view(bsz, n, d)
            zc = out_round(torch.bmm(qt, qt.transpose(1, 2)), c) * (sc * sc.transpose(1, 2))
            r._add_error(c.name, "fwd", _rel(zc, z))
            if gz is not None:
                qg = quantize(gz.reshape(bsz * n, n), c).view(bsz, n, n)
                qgt = quantize(gz.transpose(1, 2).reshape(bsz * n, n), c).view(bsz, n, n)
                tt = t.transpose(1, 2).reshape(bsz * d, n)
                qtc = quantize(tt, c).view(bsz, d, n).transpose(1, 2)  # scaled per column
                if scaled:  # the mod's backward: the same exact power-of-two scaling
                    qtc = quantize((t / sc).transpose(1, 2).reshape(bsz * d, n), c)
                    qtc = qtc.view(bsz, d, n).transpose(1, 2) * sc
                r._add_error(
                    c.name,
                    "dgrad",
                    _rel(out_round(torch.bmm(qg, qtc), c) + out_round(torch.bmm(qgt, qtc), c), dt),
                )

    def _tensor_site(self, r: SiteStats, x: Tensor, g: Tensor | None, weight: bool = False) -> None:
        """A tensor stored or sent in the candidate's format: its round-trip error (per row)."""
        r.samples += 1
        if not r.site.shape:
            r.site.shape = tuple(x.shape[1:])
        r._merge_stats("weight" if weight else "act", tensor_stats(x))
        if g is not None:
            r._merge_stats("grad", tensor_stats(g))
        x2 = _rows(x.reshape(x.shape[0], -1))
        for c in self.candidates:
            r._add_error(c.name, "fwd", _rel(quantize(x2, c), x2))
            if g is not None:
                g2 = _rows(g.reshape(g.shape[0], -1))
                r._add_error(c.name, "grad", _rel(quantize(g2, c), g2))

    # ---- report -----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """Every site's statistics and per-candidate errors (mean, bound, worst)."""
        out: dict[str, Any] = {"steps_probed": self.steps_probed, "sites": []}
        for s in self.sites:
            r = self.results[s.name]
            errs = {
                c: {
                    **{k: {"mean": sum(v) / len(v), "bound": upper_bound(v)} for k, v in e.items()},
                    "bound": r.bound(c),
                    "worst": r.worst(c),
                }
                for c, e in r.errors.items()
            }
            out["sites"].append(
                {
                    "name": s.name,
                    "kind": s.kind,
                    "shape": list(s.shape),
                    "samples": r.samples,
                    "stats": r.stats,
                    "errors": errs,
                }
            )
        return out
