"""Session hooks: the fault campaigns' summary table (see ``tests/faults.py``)."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable

import pytest
from faults import OUTCOMES, REGISTRY


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    """Counts per fault campaign: tried / clear error / handled / crash / silent / data lost."""
    ran = {name: c for name, c in REGISTRY.items() if c.cases}  # campaigns this session ran
    if not ran:
        return
    tr = terminalreporter
    tr.section("fault campaigns")
    head = f"{'campaign':<28}{'tried':>7}" + "".join(f"{o:>19}" for o in OUTCOMES)
    tr.write_line(head)
    rows = {}
    for name in sorted(ran):
        c = ran[name].counts()
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
