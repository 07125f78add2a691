"""Where a benchmark's result came from, recorded by the benchmark process itself.

``neorec bench NAME ...`` runs the benchmark, then prints one more JSON line after the benchmark's
own: ``{"provenance": {...}}`` with the exact argv the process received, the neorec commit it ran
(``+dirty`` when its source differed from it), the CPU, the CPUs this process may use, the
1-minute load before and after, and a digest: the SHA-256 of the benchmark's JSON line together
with every other provenance field. ``neorec bench report`` stores both lines; a stored row whose
result or provenance was edited by hand no longer matches its digest (``verify``), and
``--ingest`` refuses a log whose recorded argv is not the entry's command.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from neorec.machine import cpu_model_and_flags

__all__ = [
    "FIELDS",
    "begin",
    "finish",
    "digest",
    "line",
    "split_output",
    "verify",
    "source_commit",
    "usable_cpus",
    "cpu_label",
    "run_recorded",
]

FIELDS = ("argv", "commit", "cpu", "cores", "load_before", "load_after", "date")
"""What every stored result's provenance holds (and ``digest``, over these and the result)."""


SOURCE_PATHS = ("neorec", "configs", "pyproject.toml", "constraints.txt")
"""What a result depends on: the package, the configs, the dependencies (``bench-results.json``
and the README, which ``bench report`` itself rewrites, are not)."""


def source_commit() -> str:
    """The commit of the neorec source this process runs (``<sha>+dirty`` when its
    ``SOURCE_PATHS`` differ from it; ``unknown`` outside a git checkout)."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30
        ).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--", *SOURCE_PATHS)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if len(sha) != 40:
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def cpu_label() -> str:
    """This CPU's model and its widest vector ISA (AVX2 / AVX-512 / AMX), as rows name it."""
    model, flags = cpu_model_and_flags()
    f = set(flags)
    isa = (
        "AMX" if "amx_tile" in f else "AVX-512" if "avx512f" in f else "AVX2" if "avx2" in f else ""
    )
    if isa == "AVX-512" and "avx512_bf16" in f:
        isa += " BF16"
    return f"{model} ({isa})" if isa else model


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def begin(argv: list[str], cpu: str) -> dict[str, Any]:
    """The provenance known before the benchmark runs: ``argv`` as the process received it
    (after ``neorec``), the commit, ``cpu`` (its label), the usable CPUs, the load now."""
    return {
        "argv": list(argv),
        "commit": source_commit(),
        "cpu": cpu,
        "cores": usable_cpus(),
        "load_before": round(os.getloadavg()[0], 2),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def digest(result: dict[str, Any], prov: dict[str, Any]) -> str:
    """SHA-256 of the result and every provenance field but the digest (canonical JSON)."""
    body = {"result": result, "provenance": {k: v for k, v in prov.items() if k != "digest"}}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def finish(prov: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """``prov`` completed after the run: the load now, and the digest over ``result``."""
    out = {**prov, "load_after": round(os.getloadavg()[0], 2)}
    out["digest"] = digest(result, out)
    return out


def line(prov: dict[str, Any]) -> str:
    """The provenance line a benchmark prints after its own JSON line."""
    return json.dumps({"provenance": prov}, sort_keys=True)


def _objects(stdout: str) -> list[dict[str, Any]]:
    out = []
    for text in stdout.strip().splitlines():
        text = text.strip()
        if not text.startswith("{"):
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def split_output(stdout: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A benchmark's output -> (its JSON line, its provenance or None when it printed none).

    The result is the last JSON object line before the provenance line. Raises ``ValueError``
    when there is no result line."""
    objs = _objects(stdout)
    prov = None
    if objs and set(objs[-1]) == {"provenance"}:
        prov = objs.pop()["provenance"]
    objs = [o for o in objs if set(o) != {"provenance"}]
    if not objs:
        raise ValueError("no JSON line in the benchmark's output")
    return objs[-1], prov


def verify(result: dict[str, Any], prov: dict[str, Any] | None, argv: list[str]) -> list[str]:
    """What is wrong with a stored result's provenance (empty: nothing): a field missing, an argv
    other than ``argv``, a commit that is not a full sha, a digest that does not match."""
    if not isinstance(prov, dict):
        return ["no provenance"]
    bad = [f"no '{k}'" for k in (*FIELDS, "digest") if k not in prov]
    if bad:
        return bad
    if prov["argv"] != list(argv):
        bad.append(f"argv {prov['argv']} is not the entry's {list(argv)}")
    sha = str(prov["commit"]).removesuffix("+dirty")
    if len(sha) != 40 or any(c not in "0123456789abcdef" for c in sha):
        bad.append(f"commit {prov['commit']!r} is not a commit")
    if not isinstance(prov["cores"], int) or prov["cores"] < 1:
        bad.append(f"cores {prov['cores']!r}")
    for k in ("load_before", "load_after"):
        if not isinstance(prov[k], int | float):
            bad.append(f"{k} {prov[k]!r}")
    if prov["digest"] != digest(result, prov):
        bad.append("the digest does not match the result and provenance (edited by hand?)")
    return bad


class _Recorder:
    """A text stream that writes through to ``inner`` and keeps what was written."""

    def __init__(self, inner: TextIO) -> None:
        self.inner, self.parts = inner, list[str]()

    def write(self, text: str) -> int:
        self.parts.append(text)
        return self.inner.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding, ...
        return getattr(self.inner, name)


def run_recorded(main: Callable[[list[str]], Any], argv: list[str]) -> int:
    """Run a benchmark's ``main(argv[2:])`` (``argv``: ``["bench", NAME, *flags]``, as the
    process received it); when it exits 0 having printed a JSON line, print its provenance line
    after it."""
    prov = begin(argv, cpu_label())
    rec = _Recorder(sys.stdout)
    with contextlib.redirect_stdout(rec):  # type: ignore[type-var]
        rc = int(main(argv[2:]) or 0)
    if rc == 0:
        try:
            result, _ = split_output("".join(rec.parts))
        except ValueError:  # a listing, not a result
            return rc
        print(line(finish(prov, result)), flush=True)
    return rc
