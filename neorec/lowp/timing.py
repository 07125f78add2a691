"""Micro-benchmarks of each site's kernel per candidate, measured once per machine and cached.

The time of a site in a candidate is the median of a few timed rounds of its forward + backward at
the run's shape (batch included), through the same functions the dispatched site runs
(:mod:`neorec.lowp.kernels`), casts included. The cache is a JSON file keyed by the machine (CPU
model, its vector and matrix ISA flags, torch version, thread count, device) and the site's shape,
so a second run on the same machine measures nothing; ``NEOREC_LOWP_TIMINGS`` names the file
(default ``~/.cache/neorec/lowp_timings.json``). fp8 has a kernel only on CUDA: elsewhere its time
is recorded as unavailable (``inf``), and dispatch never picks it for speed.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from neorec.lowp.formats import Candidate
from neorec.lowp.kernels import dot_bmm, linear

__all__ = ["machine_key", "Timings", "default_cache_path", "time_site"]

TIMING_VERSION = 3
SLOW_MS = 50.0  # a call slower than this is timed twice, not in rounds (fp16 GEMMs without
# hardware support take seconds at dlrm_benchmark's shapes)  # bump when what is timed changes: older entries are then measured again
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile")


def _cpu_model_and_flags() -> tuple[str, list[str]]:
    model: str = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name":
            model = value.strip()
        elif key == "flags":
            have = set(value.split())
            flags = [f for f in _FLAGS if f in have]
            break
    return model, flags


def machine_key(device: str = "cpu") -> str:
    """What a timing depends on: CPU (or GPU) model, ISA flags, torch, threads, device."""
    if device.startswith("cuda") and torch.cuda.is_available():  # pragma: no cover - no GPU
        name = torch.cuda.get_device_name()
        return f"{name}|torch {torch.__version__}|cuda"
    model, flags = _cpu_model_and_flags()
    cap = torch.backends.cpu.get_cpu_capability()
    # oneDNN's own ISA cap changes which bf16 kernels run (e.g. none without AVX512-BF16 / AMX)
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "-"
    threads = torch.get_num_threads()
    return (
        f"{model}|{'+'.join(flags)}|{cap}|onednn {isa}|torch {torch.__version__}|threads {threads}"
    )


def default_cache_path() -> Path:
    """``NEOREC_LOWP_TIMINGS``, else ``~/.cache/neorec/lowp_timings.json``."""
    env = os.environ.get("NEOREC_LOWP_TIMINGS")
    return Path(env) if env else Path.home() / ".cache" / "neorec" / "lowp_timings.json"


def time_site(kind: str, shape: tuple[int, ...], batch: int, cand: Candidate, device: str = "cpu",
              rounds: int = 5, min_s: float = 0.02) -> float:  # fmt: skip
    """ms of one forward + backward of a site of ``kind`` / ``shape`` at ``batch`` rows (the
    fastest of ``rounds`` timed rounds)."""
    if cand.kind == "fp8" and not (device.startswith("cuda") and hasattr(torch, "_scaled_mm")):
        return math.inf
    gen = torch.Generator().manual_seed(0)
    if kind == "linear":
        n_in, n_out = shape
        x = torch.randn(batch, n_in, generator=gen).to(device).requires_grad_()
        w = torch.randn(n_out, n_in, generator=gen).to(device).requires_grad_()
        b = torch.zeros(n_out, device=device, requires_grad=True)

        gy = torch.randn(batch, n_out, generator=gen).to(device)

        def run() -> None:
            # a dense, contiguous output gradient as in training (``.sum()``'s is a stride-0
            # expansion, which sends the backward GEMMs down slow paths)
            linear(x, w, b, cand).backward(gy)

    elif kind == "interaction":
        n, d = shape
        t = torch.randn(batch, n, d, generator=gen).to(device).requires_grad_()

        gz = torch.randn(batch, n, n, generator=gen).to(device)

        def run() -> None:
            dot_bmm(t, cand).backward(gz)

    else:
        raise ValueError(f"no kernel to time for a {kind!r} site")
    run()  # warm-up (and first-call dispatch)
    t0 = time.perf_counter()
    run()
    once = (time.perf_counter() - t0) * 1e3
    if once > SLOW_MS:  # an emulated or unaccelerated kernel: one more call tells enough
        t0 = time.perf_counter()
        run()
        return min(once, (time.perf_counter() - t0) * 1e3)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_s or reps < 2:
        run()
        reps += 1
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        times.append((time.perf_counter() - t0) / reps * 1e3)
    # the fastest round: what the kernel costs when nothing else (a loader thread) interferes
    return min(times)


class Timings:
    """The timing cache of one machine (a view on the shared JSON file)."""

    def __init__(self, path: Path | str | None = None, device: str = "cpu") -> None:
        self.path = Path(path) if path is not None else default_cache_path()
        self.device = device
        self.machine = machine_key(device)
        self.measured = 0  # entries this process measured (not read from the cache)
        self._all: dict[str, dict[str, float]] = {}
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text())
            except (OSError, ValueError):
                data = {}  # an unreadable cache is re-measured and rewritten, never trusted
            if isinstance(data, dict):
                self._all = {k: v for k, v in data.items() if isinstance(v, dict)}

    def _key(self, kind: str, shape: tuple[int, ...], batch: int, cand: Candidate) -> str:
        return f"v{TIMING_VERSION}:{kind}:{'x'.join(map(str, shape))}:b{batch}:{cand.name}"

    def get(self, kind: str, shape: tuple[int, ...], batch: int, cand: Candidate) -> float:
        """ms of the site in ``cand`` (from the cache, else measured now and cached)."""
        mine = self._all.setdefault(self.machine, {})
        key = self._key(kind, shape, batch, cand)
        if key not in mine:
            mine[key] = time_site(kind, shape, batch, cand, self.device)
            self.measured += 1
        return float(mine[key])

    def set(
        self, kind: str, shape: tuple[int, ...], batch: int, cand: Candidate, ms: float
    ) -> None:
        """Record a time (tests force timings through this)."""
        self._all.setdefault(self.machine, {})[self._key(kind, shape, batch, cand)] = ms

    def save(self) -> None:
        """Write the cache (atomically: a temp file renamed over it)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        data: dict[str, Any] = {k: v for k, v in self._all.items()}
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))  # inf as Infinity
        os.replace(tmp, self.path)
