"""Session hooks: the fault campaigns' summary table (see ``tests/faults.py``)."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable

import pytest
from faults import OUTCOMES, REGISTRY

_FROM_WORKERS: dict[str, Counter[str]] = {}
"""Counts the xdist workers reported (``make test`` runs the suite on two)."""


def _counts() -> dict[str, dict[str, int]]:
    return {name: c.counts() for name, c in REGISTRY.items() if c.cases}


def pytest_sessionfinish(session) -> None:  # type: ignore[no-untyped-def]
    out = getattr(session.config, "workeroutput", None)
    if out is not None:  # an xdist worker: its counts go to the controller
        out["fault_campaigns"] = json.dumps(_counts())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # type: ignore[no-untyped-def]
    """(xdist, on the controller) a worker's campaign counts, added up."""
    rows = json.loads(getattr(node, "workeroutput", {}).get("fault_campaigns", "{}"))
    for name, c in rows.items():
        _FROM_WORKERS.setdefault(name, Counter()).update(c)


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    """Counts per fault campaign: tried / clear error / handled / crash / silent / data lost."""
    merged: dict[str, Counter[str]] = {k: Counter(v) for k, v in _FROM_WORKERS.items()}
    for name, c in _counts().items():  # campaigns this process ran
        merged.setdefault(name, Counter()).update(c)
    if not merged:
        return
    tr = terminalreporter
    tr.section("fault campaigns")
    head = f"{'campaign':<28}{'tried':>7}" + "".join(f"{o:>19}" for o in OUTCOMES)
    tr.write_line(head)
    rows = {}
    for name in sorted(merged):
        c = {k: merged[name][k] for k in ("tried", *OUTCOMES)}
        rows[name] = c
        tr.write_line(f"{name:<28}{c['tried']:>7}" + "".join(f"{c[o]:>19}" for o in OUTCOMES))
    out = os.environ.get("NEOREC_FAULTS_JSON")
    if out:
        with open(out, "w") as fh:
            json.dump(rows, fh, indent=1, sort_keys=True)


@pytest.fixture
def fast_paths() -> Callable[[], Counter[str]]:
    """The fast paths that ran since the test began (``neorec.ops.fastpath``), as call counts: a
    test comparing a fast path with its specification asserts that the fast path ran, not a
    fallback computing the same numbers."""
    from neorec.ops.fastpath import RAN

    before = Counter(RAN)
    return lambda: RAN - before
