"""The start banner shows the run's shape: towers, dynamic tables' capacities, the low-precision
mode (and, once made, its decision with the reason), the plan's summary."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

from test_trainer import tiny_cfg

from neorec.train.progress import banner
from neorec.train.trainer import Trainer


def _banner(cfg, **kw):
    args = dict(
        folder="runs/x", resumed=False, world=1, dense_params=10, total_steps=5, eval_every=0
    )
    return banner(cfg, **{**args, **kw})


def test_towers_line(tmp_path: Path) -> None:
    cfg = tiny_cfg(tmp_path, "towers.count=2", "towers.module=mlp")
    text = _banner(cfg, towers=[["t0", "t1"], ["t2"]])
    assert "towers   2 towers (balanced partition), tables per tower 2/1, module mlp" in text
    assert "towers" not in _banner(tiny_cfg(tmp_path))  # a flat run has no towers line


def test_dynamic_table_shows_its_capacity_not_its_id_space(tmp_path: Path) -> None:
    tables = (
        "[{name='d', rows=80000, dim=8, kind='dynamic', capacity=1000}, "
        "{name='f', rows=200, dim=8}]"
    )
    text = _banner(tiny_cfg(tmp_path, f"embedding.tables={tables}"))
    assert "dynamic  d: capacity 1,000 slots, id space 80,000" in text
    assert "2 tables, 2 features, 1,200 rows" in text  # capacity 1,000 + 200, not 80,200
    assert "embedding 9,600 " in text  # (1,000 + 200) x 8 parameters


def test_plan_summary_counts_types_dynamic_and_towers(tmp_path: Path) -> None:
    plan = SimpleNamespace(
        tables=[SimpleNamespace(sharding_type=s) for s in ("table_wise", "row_wise", "row_wise")]
    )
    text = _banner(tiny_cfg(tmp_path), world=2, plan=plan)
    assert "world    2 ranks | plan row_wise x2, table_wise x1" in text
    towered = _banner(tiny_cfg(tmp_path, "towers.count=2"), world=4, towers=[["t0"], ["t1", "t2"]])
    assert "plan towers x2 (tower-local sharding)" in towered


def test_lowp_mode_in_the_banner_and_its_decision_with_the_reason(tmp_path: Path) -> None:
    assert "lowp" not in _banner(tiny_cfg(tmp_path))  # off: nothing to say
    forced = _banner(tiny_cfg(tmp_path, "lowp.mode=bf16", "lowp.keep_ends=false"))
    assert "lowp     bf16 on every dense site\n" in forced
    out = io.StringIO()
    cfg = tiny_cfg(
        tmp_path, "lowp.mode=auto", "lowp.probe_steps=2", "train.steps=3", "train.progress=true"
    )
    Trainer(cfg, out=out).fit()
    text = out.getvalue()
    assert "lowp     auto: the first 2 steps in fp32 are probed" in text
    assert "(first and last layer kept fp32)" in text
    line = next(x for x in text.splitlines() if x.startswith("lowp auto at step 2: "))
    # every site kept in fp32 has a reason: the ends by keep_ends, the others by the probe
    assert "2 sites: first / last layer, lowp.keep_ends" in line
    assert "dense sites" in line and "(" in line and "other" not in line
