"""The fused lookup of serving tables (``neorec.ops.quant_lookup``) against its specification:
the loader's ``Table.rows(ids)`` (dequantized fp32 rows) times the weights, summed per bag by
``index_add_`` (``standalone.Predictor``'s NumPy path); and the exported artifacts that use it.

Tolerance: the kernel computes every term with the specification's roundings (code * scale, then
+ offset, then * weight; no fused multiply-add), so only the order of a bag's additions may differ,
which ``index_add_`` does not promise. A bag of k terms of magnitude <= m summed in another order
differs by at most about k * k * eps * m; the checks allow rtol 1e-6 and atol 1e-6 * max|row|
(bags here hold <= 12 ids). On torch 2.x here the two are bitwise equal (``test_..._bitwise``
records it, so a change in torch's order shows up as that test alone failing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from neorec.errors import NeorecError
from neorec.ops import quant_lookup as ql
from neorec.ops.quant import dequantize_rows, int_rowwise_quantize
from neorec.serve import standalone

KINDS = list(ql.KINDS)
DIMS = (1, 3, 5, 7, 8, 12, 13, 16, 24, 72)  # odd, not multiples of 2 / 4 / 8, > 64 columns

pytestmark = pytest.mark.skipif(ql.native_lib() is None, reason="no C compiler")


def _table(tmp: Path, w: torch.Tensor, kind: str) -> standalone.Table:
    """The loader's Table over ``w`` stored as ``kind`` (as ``neorec export`` writes it)."""
    q = ql.quantize_rows(w, kind)
    name = f"{kind}_{w.shape[1]}.npy"
    np.save(tmp / name, q.data)
    key = "rows" if kind in ql.INT_KINDS else "weight"
    spec: dict[str, Any] = {"name": "t", "rows": w.shape[0], "dim": w.shape[1]}
    spec.update(quantization=kind, files={key: name})
    if kind in ql.INT_KINDS:
        spec.update(bits=ql.KINDS[kind], scale_unit=q.scale_unit, offset_unit=q.offset_unit)
    return standalone.Table(str(tmp), spec, {name: {}})


def _spec(table: standalone.Table, ids: np.ndarray, offsets: np.ndarray, w: Any, mean: bool):
    rows = table.rows(ids)
    if w is not None:
        rows = rows * torch.from_numpy(w).unsqueeze(1)
    lens = torch.from_numpy(np.diff(offsets))
    seg = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    pooled = torch.zeros(lens.numel(), table.dim).index_add_(0, seg, rows)
    return pooled / lens.clamp(min=1).to(pooled.dtype).unsqueeze(1) if mean else pooled


def _bags(rows: int, g: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Bags of 0..12 ids (some empty), the last row and row 0 among them."""
    lens = torch.randint(0, 13, (17,), generator=g)
    lens[3] = lens[9] = 0
    ids = torch.randint(0, rows, (int(lens.sum()),), generator=g)
    ids[0], ids[-1] = rows - 1, 0
    offsets = np.concatenate([[0], np.cumsum(lens.numpy())])
    return ids.numpy(), offsets


@pytest.mark.parametrize("kind", KINDS)
def test_pooled_equals_dequantize_then_pool(kind: str, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    for dim in DIMS:
        w = torch.randn(50, dim, generator=g) * 0.03 + 0.01
        table = _table(tmp_path, w, kind)
        ids, offsets = _bags(50, g)
        weights = torch.rand(ids.size, generator=g).numpy() * 2 - 0.5
        big = float(table.rows(np.arange(50)).abs().max())
        for wt in (None, weights):
            for mean in (False, True):
                got = ql.pooled(table, ids, offsets, wt, mean)
                want = _spec(table, ids, offsets, wt, mean)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * big)
                assert not got[3].any() and not got[9].any()  # empty bags: zeros


def test_pooled_equals_the_specification_bitwise_on_this_torch(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    for kind in KINDS:
        for dim in (5, 16, 72):
            table = _table(tmp_path, torch.randn(40, dim, generator=g), kind)
            ids, offsets = _bags(40, g)
            weights = torch.rand(ids.size, generator=g).numpy()
            got = ql.pooled(table, ids, offsets, weights, True)
            assert torch.equal(got, _spec(table, ids, offsets, weights, True)), (kind, dim)


def test_threads_do_not_change_the_result(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    table = _table(tmp_path, torch.randn(300, 16, generator=g), "int4")
    lens = torch.randint(0, 6, (500,), generator=g)
    ids = torch.randint(0, 300, (int(lens.sum()),), generator=g).numpy()
    offsets = np.concatenate([[0], np.cumsum(lens.numpy())])
    assert torch.equal(
        ql.pooled(table, ids, offsets, threads=1), ql.pooled(table, ids, offsets, threads=2)
    )


def test_codes_are_the_codecs(tmp_path: Path) -> None:
    """The stored rows decode to ``neorec.ops.quant``'s rows; chunks of very different ranges
    share one unit per table without changing a value."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 7, generator=g)
    w[:32] *= 1e-3  # the first chunk's units are 2^10 below the second's
    old = ql.CHUNK_ROWS
    ql.CHUNK_ROWS = 32
    try:
        for kind in ql.INT_KINDS:
            table = _table(tmp_path, w, kind)
            bits = ql.KINDS[kind]
            want = torch.cat(
                [
                    dequantize_rows(int_rowwise_quantize(w[lo : lo + 32], bits, bits <= 4))
                    for lo in (0, 32)
                ]
            )
            assert torch.equal(table.rows(np.arange(64)), want), kind
    finally:
        ql.CHUNK_ROWS = old


def test_bytes_per_row() -> None:
    """Default model's dim 16: int4 12 bytes a row (8 of codes + float16 scale and offset), 0.1875x
    fp32's 64 (float32 scale and offset would make it 16: 0.25x)."""
    got = {k: ql.row_bytes(k, 16) for k in KINDS}
    assert got == {"none": 64, "fp16": 32, "int8": 20, "int4": 12, "int2": 8}
    assert got["int4"] <= 0.2 * got["none"]
    assert ql.row_bytes("int4", 7) == 4 + 4 and ql.row_bytes("int2", 5) == 2 + 4


def test_bad_input_is_one_clear_error(tmp_path: Path) -> None:
    table = _table(tmp_path, torch.randn(10, 8), "int8")
    off = np.array([0, 2, 3])
    for ids, match in (([1, 10, 2], "id 10 at position 1"), ([1, 2, -1], "id -1 at position 2")):
        with pytest.raises(NeorecError, match=match):
            ql.pooled(table, np.array(ids), off)
    with pytest.raises(NeorecError, match="offsets of bag 1"):
        ql.pooled(table, np.array([1, 2, 3]), np.array([0, 2, 1, 3]))
    with pytest.raises(NeorecError, match="offsets of bag 1"):
        ql.pooled(table, np.array([1, 2, 3]), np.array([0, 2, 4]))
    with pytest.raises(NeorecError, match="weights must be shaped like ids"):
        ql.pooled(table, np.array([1, 2, 3]), off, np.ones(2, dtype=np.float32))
    with pytest.raises(NeorecError, match="does not fit float16"):
        ql.quantize_rows(torch.full((2, 3), 7e4), "fp16", name="t0")
    with pytest.raises(NeorecError, match="uint8"):
        ql.pooled(ql.QuantRows("int4", np.zeros((3, 5), np.float32), 2), np.array([0]), off[:2])


# ---- exported artifacts: the predictor's fused path against its NumPy path --------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An untrained model of dim 12 (not a multiple of 8), mean pooling, exported at every width,
    and one batch of weighted bags (empty bags and the last row among them)."""
    from test_trainer import tiny_cfg

    from neorec.builder import build_dlrm
    from neorec.serve import save_model
    from neorec.serve.export import export_model

    root = tmp_path_factory.mktemp("qserve")
    cfg = tiny_cfg(root, "embedding.dim=12", "model.bottom_mlp=[16, 12]", "embedding.pooling=mean")
    save_model(build_dlrm(cfg), cfg, root / "model")
    arts = {q: export_model(root, root / f"art-{q}", q) for q in KINDS}
    g = torch.Generator().manual_seed(5)
    b, sparse = 6, {}
    for f in ("t0", "t1", "t2"):
        lens = torch.randint(0, 4, (b,), generator=g)
        lens[2] = 0
        ids = torch.randint(0, 200, (int(lens.sum()),), generator=g)
        ids[-1] = 199
        sparse[f] = (lens.numpy(), ids.numpy(), torch.rand(ids.numel(), generator=g).numpy())
    dense = torch.randn(b, 13, generator=g).numpy()
    return {"root": root, "arts": arts, "dense": dense, "sparse": sparse}


@pytest.mark.parametrize("kind", ["int8", "int4", "int2", "fp16"])
def test_predictor_fused_equals_numpy_path(exported: dict[str, Any], kind: str) -> None:
    """Tolerance 1e-6 on the logits: the pooled inputs differ by the order of a bag's additions
    at most (see the module docstring; bitwise the same here)."""
    art = exported["arts"][kind]
    fast = standalone.load(str(art))
    slow = standalone.load(str(art), fused=False)
    assert fast._fused is not None and slow._fused is None
    got = fast.logits(exported["dense"], exported["sparse"])
    want = slow.logits(exported["dense"], exported["sparse"])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    ref = standalone.load(str(exported["arts"]["none"]), fused=False)
    assert not torch.equal(got, ref.logits(exported["dense"], exported["sparse"]))  # quantized


def test_fp32_tables_keep_their_path_bitwise(exported: dict[str, Any]) -> None:
    art = exported["arts"]["none"]
    a = standalone.load(str(art)).logits(exported["dense"], exported["sparse"])
    b = standalone.load(str(art), fused=False).logits(exported["dense"], exported["sparse"])
    assert torch.equal(a, b)


def test_artifact_bytes(exported: dict[str, Any]) -> None:
    """Each kind's tables hold row_bytes(kind, dim) per row (+ the .npy headers)."""
    import json

    for kind, art in exported["arts"].items():
        m = json.loads((art / "manifest.json").read_text())
        for t in m["tables"]:
            assert t["quantization"] == kind
            assert 0 <= t["bytes"] - t["rows"] * ql.row_bytes(kind, t["dim"]) <= 128


def test_bench_qlookup_prints_its_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from neorec.bench import qlookup
    from neorec.bench.report_render import quant_lookup

    argv = ["--shapes", "2x50x8,1x40x5", "--rounds", "2", "--iters", "1", "--warmup", "0"]
    assert qlookup.main(argv) == 0
    j = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(c["shape"], c["ids"]) for c in j["cases"]] == [
        ("2x50x8", "uniform"), ("2x50x8", "zipf"), ("1x40x5", "uniform"), ("1x40x5", "zipf")
    ]  # fmt: skip
    case = j["cases"][0]
    assert set(case["speedup_vs_fp32"]) == {"fp16", "int8", "int4", "int2", "numpy"}
    assert case["rel_error"]["none"] == 0 and 0 < case["rel_error"]["int2"] < 1
    assert "2 × 50 × 8 uniform" in quant_lookup(j)
    with pytest.raises(NeorecError, match="--shapes"):
        qlookup.main(["--shapes", "8x10"])


def test_neorec_predict_reads_artifacts(exported: dict[str, Any], tmp_path: Path) -> None:
    """``neorec predict --model ARTIFACT`` reads the model's eval data (its config is in the
    manifest) through the artifact's tables: fp32 as the saved model predicts (1e-6: the
    exported dense program), int2 off by its codes' error."""
    from neorec.cli import main

    small = ["--set", "data.eval_samples=256"]
    got = {}
    for name, model in (("model", exported["root"]), *exported["arts"].items()):
        out = tmp_path / f"{name}.npy"
        assert main(["predict", "--model", str(model), "--out", str(out), *small]) == 0
        got[name] = np.load(out)
    assert got["model"].shape == (256,)
    assert np.abs(got["none"] - got["model"]).max() <= 1e-6
    for kind in ("fp16", "int8", "int4", "int2"):
        assert 0 < np.abs(got[kind] - got["none"]).max() <= 0.15, kind


def test_the_loader_and_the_kernel_know_the_same_kinds() -> None:
    assert {"none", *standalone.FUSED} == set(ql.KINDS)
    assert {k: ql.KINDS[k] for k in ql.INT_KINDS} == standalone.INT_BITS
