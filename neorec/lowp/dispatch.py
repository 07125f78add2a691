"""LoKA's dispatch: per site, the fastest precision whose probed error is within tolerance.

Rules (:func:`choose`): a candidate is *safe* at a site when the upper confidence bound of its
worse error (forward output, input gradient, weight gradient) over the probed steps is at most
``tolerance``; among the safe ones the fastest measured one wins, and only if it takes at most
``MIN_GAIN`` (90%) of fp32's time (never a slower one, nor one within the timing noise). Forced modes (``bf16``, ``fp16``, ``fp8``) run every GEMM site in that
format whatever the probe says, except where a mod keeps a site in fp32 (the first and last
layers with ``keep_ends``).

The chosen precision is installed by switching the module's class to a subclass with the same
parameters and state-dict keys (:class:`LowpLinear`, :class:`LowpDot`), so checkpoints, DDP and
the optimizer see the same model; :func:`uninstall` switches back.

:class:`Dispatcher` drives it during training: probe the first steps, choose, then re-probe every
``reprobe_every`` steps and choose again; between probes it watches each low-precision site's
output amax, and a site whose amax grows past ``drift`` times what the probe saw, or whose output
is not finite, falls back to fp32 at once and is probed again on the next step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from neorec.config import LowpConfig
from neorec.lowp.formats import CANDIDATES, Candidate, candidate
from neorec.lowp.kernels import dot_bmm, linear
from neorec.lowp.plan_file import check_plan, load_plan
from neorec.lowp.probe import Probe, SiteStats, upper_bound
from neorec.lowp.timing import Timings
from neorec.modules.dlrm import DotInteraction

__all__ = [
    "MODES",
    "LowpLinear",
    "LowpDot",
    "choose",
    "install",
    "uninstall",
    "Decision",
    "Dispatcher",
]

MODES = ("off", "auto", "bf16", "fp16", "fp8")
MIN_GAIN = 0.9
"""A candidate must take at most this fraction of fp32's time: timings are noisy, and a switch
that only measures as faster within the noise costs casts and can be slower in the run."""
FP32 = candidate("fp32")


def _amax(y: Tensor) -> float:
    """``max |y|`` in one pass without a temporary (``aminmax``; ``abs().amax()`` writes a
    tensor of ``|y|`` first: a second and third pass over every watched output, each step);
    NaN if ``y`` holds one."""
    if not y.numel():
        return 0.0
    lo, hi = torch.aminmax(y.detach())
    return max(-float(lo), float(hi)) if not math.isnan(float(hi)) else math.nan


class LowpLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run in ``precision`` (fp32 master weights).

    ``keep_low`` (set by ``install``): the output stays in the site's bf16 / fp16 format instead
    of being widened to fp32, because its only consumer is a ReLU whose output feeds a Linear
    of the same format, which casts it there. A ReLU of a value in the format is exact in it and
    the casts on the way were exact, so outputs and gradients are bit for bit those of the
    widened path, with three passes over the activation (and two over its gradient) fewer."""

    precision: Candidate = FP32
    watch: Callable[[Tensor], None] | None = None
    keep_low: bool = False

    def forward(self, x: Tensor) -> Tensor:
        """``x W^T + b`` in the site's precision."""
        y = linear(x, self.weight, self.bias, self.precision, self.keep_low)
        if self.watch is not None:
            self.watch(y)
        return y


class LowpDot(DotInteraction):
    """The DLRM dot interaction with its batched GEMM in ``precision``."""

    precision: Candidate = FP32
    watch: Callable[[Tensor], None] | None = None
    row_scale: bool = True  # the mod: power-of-two row scaling before the cast

    def gram(self, t: Tensor) -> Tensor:
        """``t @ t^T`` per sample in the site's precision."""
        z = dot_bmm(t, self.precision, self.row_scale)
        if self.watch is not None:
            self.watch(z)
        return z


_SWAP: dict[type, type] = {nn.Linear: LowpLinear, DotInteraction: LowpDot}


def _root(dense: nn.Module) -> nn.Module:
    return getattr(dense, "module", dense)


def install(dense: nn.Module, plan: dict[str, str]) -> None:
    """Run each site named in ``plan`` in its precision (fp32 sites keep the plain class)."""
    mods = dict(_root(dense).named_modules())
    for name, prec in plan.items():
        m = mods.get(name)
        if m is None:
            continue
        base = next((b for b in _SWAP if type(m) in (b, _SWAP[b])), None)
        if base is None:
            continue
        cand = candidate(prec)
        m.__class__ = base if cand.kind == "fp32" else _SWAP[base]
        if cand.kind != "fp32":
            m.precision = cand  # type: ignore[assignment]
    _keep_low(_root(dense))


def _keep_low(root: nn.Module) -> None:
    """``keep_low`` on each low-precision Linear followed, in an ``nn.Sequential``, by a ReLU
    and a Linear of the same bf16 / fp16 format (an MLP's inner layers); off elsewhere."""
    for m in root.modules():
        m.__dict__.pop("keep_low", None)
    for seq in root.modules():
        if not isinstance(seq, nn.Sequential):
            continue
        ch = list(seq)
        for a, r, c in zip(ch, ch[1:], ch[2:]):
            if (
                type(a) is LowpLinear
                and type(r) is nn.ReLU
                and type(c) is LowpLinear
                and a.precision.kind in ("bf16", "fp16")
                and a.precision.dtype == c.precision.dtype
            ):
                a.keep_low = True


def uninstall(dense: nn.Module) -> None:
    """Every site back to fp32 (its plain class)."""
    for m in _root(dense).modules():
        for base, swapped in _SWAP.items():
            if type(m) is swapped:
                m.__class__ = base
                m.__dict__.pop("precision", None)
                m.__dict__.pop("watch", None)
                m.__dict__.pop("keep_low", None)


WIRE = ("fp16", "bf16")
"""Wire formats dispatch may pick for the pooled all-to-all, fewest bytes first then most
precise: the codecs cast exactly as the probe emulates them (fp8's wire codec scales by a power
of two per row, not by the probe's amax scale, so it is left to ``comm.*``)."""


def choose_wire(r: SiteStats, tolerance: float) -> dict[str, str]:
    """Codecs of the pooled site's all-to-all: forward (the vectors) and backward (their
    gradients), each the first wire format whose probed bound is within ``tolerance``."""
    out = {}
    for direction, what in (("forward", "fwd"), ("backward", "grad")):
        pick = "fp32"
        for name in WIRE:
            v = r.errors.get(name, {}).get(what)
            if v and upper_bound(v) <= tolerance:
                pick = name
                break
        out[f"{r.site.name}.{direction}"] = pick
    return out


def choose(
    results: dict[str, SiteStats],
    times: dict[str, dict[str, float]],
    tolerance: float,
    mode: str = "auto",
    keep_fp32: frozenset[str] = frozenset(),
) -> dict[str, str]:
    """Precision per GEMM site (``linear`` / ``interaction``) under the rules above."""
    plan: dict[str, str] = {}
    for name, r in results.items():
        if r.site.kind not in ("linear", "interaction"):
            continue
        if name in keep_fp32 or mode == "off":
            plan[name] = "fp32"
            continue
        if mode != "auto":
            forced = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8-e4m3-row"}[mode]
            plan[name] = forced
            continue
        t = times.get(name, {})
        base = t.get("fp32", math.inf)
        best, best_t = "fp32", base
        for cand_name in r.errors:
            bound = r.bound(cand_name)
            ms = t.get(cand_name, math.inf)
            if (
                math.isfinite(bound)
                and bound <= tolerance
                and ms <= MIN_GAIN * base
                and ms < best_t
            ):
                best, best_t = cand_name, ms
        plan[name] = best
    return plan


@dataclass
class Decision:
    """A dispatch decision: the plan and what it was based on (for the report)."""

    step: int
    plan: dict[str, str]
    times: dict[str, dict[str, float]]
    fallbacks: list[str] = field(default_factory=list)


class Dispatcher:
    """Probe, choose and install precisions on a model's dense part during training.

    Call :meth:`before_step` before each step's forward and :meth:`after_step` after its backward
    (and optimizer step); the trainer does this when ``lowp.mode`` is not ``off``.

    ``policy``: the ``lowp`` section (mode, tolerance, ``probe_steps``, ``reprobe_every``, drift
    and the ``keep_ends`` / ``row_scale`` mods); ``batch``: the rows of a GEMM site whose shape
    does not say (this rank's batch size).
    """

    def __init__(
        self,
        dense: nn.Module,
        batch: int,
        policy: LowpConfig,
        timings: Timings | None = None,
        weights: Callable[[], dict[str, Tensor]] | None = None,
        candidates: tuple[Candidate, ...] = CANDIDATES,
        sync: Callable[[dict[str, str]], dict[str, str]] | None = None,
        any_rank: Callable[[bool], bool] | None = None,
        wire: Callable[[str, str], None] | None = None,
    ) -> None:
        mode = policy.mode
        if mode not in MODES:
            raise ValueError(f"lowp.mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.dense, self.batch, self.mode = dense, batch, mode
        self.tolerance, self.probe_steps, self.reprobe, self.drift = (
            policy.tolerance,
            policy.probe_steps,
            policy.reprobe_every,
            policy.drift,
        )
        self.timings = timings if timings is not None else Timings()
        self.row_scale = row_scale = policy.row_scale
        # several ranks: the plan is rank 0's (sync), and a drift on any rank sends every
        # low-precision site back to fp32 on every rank (any_rank: a collective OR)
        self.sync, self.any_rank = sync, any_rank
        # wire(direction, codec): sets the pooled all-to-all's codec (distributed auto runs whose
        # comm.forward / comm.backward were left at fp32)
        self.wire = wire
        self.probe = Probe(
            dense,
            candidates,
            self.probe_steps,
            self.reprobe,
            weights=weights,
            row_scale=row_scale,
        )
        gemm = [s for s in self.probe.sites if s.kind in ("linear", "interaction")]
        linears = [s.name for s in gemm if s.kind == "linear"]
        self.keep_fp32 = frozenset(
            [linears[0], linears[-1]] if policy.keep_ends and len(linears) > 1 else []
        )
        self.plan: dict[str, str] = {s.name: "fp32" for s in gemm}
        # lowp.plan: the plan installed at every choice instead of choosing (checked now, before
        # any step); sites that drifted since stay fp32
        self.pinned: dict[str, str] | None = None
        if policy.plan:
            self.pinned = load_plan(policy.plan)
            check_plan(self.pinned, [s.name for s in gemm], policy.plan)
        self._fell_back: set[str] = set()
        self.decisions: list[Decision] = []
        self._drifted: list[str] = []
        self._force_probe = False

    # ---- the training hooks ---------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        """Arm the probe on sampled steps (and on the step after a fallback)."""
        if self.probe.step_begin(step) or self._force_probe:
            self.probe._active = True

    def after_step(self, step: int) -> None:
        """Measure a sampled step; decide after the first probe window and on each re-probe."""
        measured = self.probe.collect()
        drifted = bool(self._drifted)
        if self.any_rank is not None and any(p != "fp32" for p in self.plan.values()):
            drifted = self.any_rank(drifted)
            if drifted:
                self._drifted = [n for n, p in self.plan.items() if p != "fp32"]
        if drifted:
            self._fall_back(step)
        elif measured and step + 1 >= self.probe_steps:  # the first window's end, a re-probe
            self._force_probe = False
            self.decide(step)

    def decide(self, step: int) -> dict[str, str]:
        """Choose and install the plan from what the probe has seen so far."""
        times = self.site_times()
        if self.pinned is not None:
            plan = {n: "fp32" if n in self._fell_back else p for n, p in self.pinned.items()}
        else:
            plan = choose(self.probe.results, times, self.tolerance, self.mode, self.keep_fp32)
            pooled = self.probe.results.get("pooled")
            if self.wire is not None and self.mode == "auto" and pooled is not None:
                plan.update(choose_wire(pooled, self.tolerance))
        if self.sync is not None:
            plan = self.sync(plan)
        self.plan = plan
        uninstall(self.dense)
        install(self.dense, plan)
        self._set_wire(plan)
        self._watch()
        self.decisions.append(Decision(step, dict(plan), times))
        if len(self.decisions) == 1:
            # Re-probes measure only what can be chosen here (a kernel exists, or the mode
            # forces it); the first window's table keeps the rest (fp8 on a CPU, the weights).
            keep = {c for row in times.values() for c, ms in row.items() if math.isfinite(ms)}
            keep |= set(plan.values())
            self.probe.candidates = [c for c in self.probe.candidates if c.name in keep]
            self.probe.weights = None
            # ... and only the sites where some candidate is fast enough to be chosen at all:
            # on a machine where nothing beats fp32, re-probing costs nothing.
            self.probe.skip = {
                n
                for n, row in times.items()
                if plan.get(n) == "fp32"
                and not any(ms <= MIN_GAIN * row["fp32"] for c, ms in row.items() if c != "fp32")
            } | {
                s.name
                for s in self.probe.sites
                if s.kind not in ("linear", "interaction")
                and not (s.kind == "pooled" and self.wire is not None and self.mode == "auto")
            }
            if len(self.probe.skip) >= len(self.probe.sites):
                self.probe.remove()  # nothing left to measure: no hooks in the way of a step
        return plan

    def site_times(self) -> dict[str, dict[str, float]]:
        """ms per candidate of every GEMM site (from the machine's timing cache)."""
        out: dict[str, dict[str, float]] = {}
        for s in self.probe.sites:
            if s.kind not in ("linear", "interaction") or not s.shape:
                continue
            rows = s.rows or self.batch
            row = {"fp32": self.timings.get(s.kind, s.shape, rows, FP32)}
            for c in self.probe.candidates:
                row[c.name] = self.timings.get(s.kind, s.shape, rows, c)
            out[s.name] = row
        if self.timings.measured:
            self.timings.save()
        return out

    def _set_wire(self, plan: dict[str, str]) -> None:
        if self.wire is None:
            return
        for direction in ("forward", "backward"):
            codec = plan.get(f"pooled.{direction}")
            if codec is not None:
                self.wire(direction, codec)

    # ---- drift --------------------------------------------------------------------------------
    def _watch(self) -> None:
        mods = dict(_root(self.dense).named_modules())
        for name, prec in self.plan.items():
            m = mods.get(name)
            if m is None or prec == "fp32":
                continue
            if isinstance(m, LowpDot):
                m.row_scale = self.row_scale
            m.watch = self._make_watch(name)  # type: ignore[assignment]

    def _make_watch(self, name: str) -> Callable[[Tensor], None]:
        state: dict[str, Any] = {"ref": None}  # the output amax of the first step after a choice

        def watch(y: Tensor) -> None:
            # note: a host sync on low-precision sites only, to catch overflow before it spreads
            amax = _amax(y)
            if state["ref"] is None:
                state["ref"] = amax
            if not math.isfinite(amax) or amax > self.drift * max(state["ref"], 1e-30):
                if name not in self._drifted:
                    self._drifted.append(name)

        return watch

    def _fall_back(self, step: int) -> None:
        plan = dict(self.plan)
        for name in self._drifted:
            plan[name] = "fp32"
            self._fell_back.add(name)
        self.plan = plan
        uninstall(self.dense)
        install(self.dense, plan)
        self._set_wire(plan)
        self._watch()
        self.decisions.append(Decision(step, dict(plan), {}, list(self._drifted)))
        self._drifted = []
        self._force_probe = True  # measure again on the next step, then choose again

    def close(self) -> None:
        """Detach the probe and return every site to fp32."""
        self.probe.remove()
        uninstall(self.dense)
