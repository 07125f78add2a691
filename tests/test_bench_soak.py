"""``neorec bench soak``: a tiny run (0.25 min) reports every series and a verdict for each.

No timing assertions: the machine is shared; only the shape of the JSON line is checked.
"""

from __future__ import annotations

from faults import run_cli

from neorec.bench.report import last_json


def test_soak_reports_series_and_verdicts(tmp_path) -> None:
    r = run_cli(
        ["bench", "soak", "--minutes", "0.25", "--interval", "1", "--dir", str(tmp_path)],
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    out = last_json(r.stdout)  # (its provenance line follows it)
    assert out["bench"] == "soak" and out["minutes"] == 0.25
    n = len(out["t_s"])
    assert n >= 1
    want = {f"{p}.{m}" for p in ("rank0", "rank1", "cached") for m in ("rss_mb", "fds", "memfds")}
    want |= {"shm_mb", "dist.samples_per_s", "cached.samples_per_s"}
    want |= {"dist.samples_per_cpu_s", "cached.samples_per_cpu_s"}
    assert want <= set(out["series"]), sorted(out["series"])
    assert all(len(v) == n for v in out["series"].values()) and len(out["load"]) == n
    assert set(out["verdict"]) == set(out["series"])
    assert set(out["verdict"].values()) <= {"flat", "grows", "falls", "short"}
    assert isinstance(out["ok"], bool) and "rss_mb" in out["tolerance"]
    assert out["series"]["rank0.rss_mb"][-1] > 0
