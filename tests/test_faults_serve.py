"""Fault campaign of the serving artifact (issue 40): damaged files are named, the manifest
carries checksums that loading verifies, and predict refuses non-finite dense features."""

from __future__ import annotations

import errno
import importlib.util
import json
import shutil
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from faults import campaign
from test_trainer import tiny_cfg

from neorec.checkpoint.format import checksum, manifest_checksum
from neorec.data.batch import Batch
from neorec.errors import NeorecError
from neorec.serve import save_model
from neorec.serve.artifact import load_artifact
from neorec.serve.evaluate import predict_batches
from neorec.serve.export import export_model
from neorec.sparse import SparseFeatures


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """An untrained model's artifact (fp32 and int8), and one batch of inputs."""
    from neorec.builder import build_dlrm

    root = tmp_path_factory.mktemp("serve")
    cfg = tiny_cfg(root)
    model = build_dlrm(cfg)
    save_model(model, cfg, root / "model")
    out = {q: export_model(root, root / f"art-{q}", q) for q in ("none", "int8")}
    g = torch.Generator().manual_seed(0)
    b, keys = 4, ["t0", "t1", "t2"]
    lengths = torch.randint(1, 4, (3 * b,), generator=g)
    values = torch.randint(0, 200, (int(lengths.sum()),), generator=g)
    sp = SparseFeatures(keys, values, lengths)
    sparse = {}
    for f in keys:
        v, ln, _ = sp.feature(f)
        sparse[f] = (ln.numpy(), v.numpy())
    dense = torch.randn(b, 13, generator=g)
    return SimpleNamespace(root=root, out=out, model=model, sp=sp, dense=dense, sparse=sparse)


def _serving(artifact: Path) -> ModuleType:
    """The artifact's own serving.py (the loader without neorec)."""
    name = f"serving_faults_{artifact.name.replace('-', '_')}"
    spec = importlib.util.spec_from_file_location(name, artifact / "serving.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _copy(art: SimpleNamespace, q: str, tmp: Path, name: str) -> Path:
    dst = tmp / name
    shutil.copytree(art.out[q], dst)
    return dst


def _table(a: Path, key: str = "weight") -> Path:
    m = json.loads((a / "manifest.json").read_text())
    return a / m["tables"][1]["files"][key]


def _truncate(p: Path, keep: float = 0.5) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * keep)])


def _flip(p: Path, at: int = -5, bit: int = 6) -> None:
    data = bytearray(p.read_bytes())
    data[at] ^= 1 << bit
    p.write_bytes(bytes(data))


def _damages(a: Path) -> list[tuple[str, Any, str]]:
    """(case, damage of the artifact dir ``a``, the file the error must name)."""
    table = str(_table(a).relative_to(a))

    def edit_manifest(a: Path) -> None:
        m = json.loads((a / "manifest.json").read_text())
        m["tables"][0]["rows"] += 0  # re-written without its checksum field's agreement
        m["num_dense"] = 12
        (a / "manifest.json").write_text(json.dumps(m))

    return [
        ("truncated manifest.json", lambda a: _truncate(a / "manifest.json"), "manifest.json"),
        ("garbage manifest.json", lambda a: (a / "manifest.json").write_bytes(b"\xff{"), "manifest"),
        ("edited manifest.json", edit_manifest, "manifest.json"),
        ("truncated table", lambda a: _truncate(_table(a)), table),
        ("table cut by 3 bytes", lambda a: _truncate(_table(a), 1.0 - 3 / _table(a).stat().st_size), table),
        ("bit flip in a table", lambda a: _flip(_table(a)), table),
        ("bit flip in a table header", lambda a: _flip(_table(a), at=60, bit=0), table),
        ("table removed", lambda a: _table(a).unlink(), table),
        ("truncated dense.pt2", lambda a: _truncate(a / "dense.pt2"), "dense.pt2"),
        ("bit flip in dense.pt2", lambda a: _flip(a / "dense.pt2", at=-200), "dense.pt2"),
        ("dense.pt2 removed", lambda a: (a / "dense.pt2").unlink(), "dense.pt2"),
        # a flip inside the loader's docstring: the code still runs, and checks itself
        ("bit flip in serving.py", lambda a: _flip(a / "serving.py", at=200), "serving.py"),
    ]  # fmt: skip


def test_damaged_artifact_names_the_file(art: SimpleNamespace, tmp_path: Path) -> None:
    """A damaged manifest, table or dense program: one line naming the file, from neorec's
    ``load_artifact`` (a NeorecError) and from the artifact's own serving.py (its ValueError)."""
    c = campaign("serving artifact")
    want = art.out["none"]
    ref = _serving(want).load(str(want))(art.dense.numpy(), art.sparse)
    for i, (name, damage, names) in enumerate(_damages(art.out["none"])):
        a = _copy(art, "none", tmp_path, f"a{i}")
        damage(a)
        c.expect_error(name, lambda a=a: load_artifact(a), (str(a), names))
        try:
            probs = _serving(a).load(str(a))(art.dense.numpy(), art.sparse)
            same = np.array_equal(probs, ref)
            c.record(f"serving.py: {name}", "silently accepted", f"{probs} (same: {same})")
        except ValueError as e:
            msg = str(e)
            ok = names in msg and "\n" not in msg.strip()
            c.record(f"serving.py: {name}", "clear error" if ok else "crash", msg)
        except Exception as e:  # noqa: BLE001 - a crash is what we are counting
            c.record(f"serving.py: {name}", "crash", f"{type(e).__name__}: {e}")
    # int8 tables: the rows file (codes, scale and offset of each row) is checked, its last
    # row's offset and its first row's codes
    for at in (-2, 200):
        a = _copy(art, "int8", tmp_path, f"q-{at}")
        _flip(_table(a, "rows"), at)
        rel = str(_table(a, "rows").relative_to(a))
        c.expect_error(f"int8: bit flip at byte {at}", lambda a=a: load_artifact(a), rel)
    # a loader cut short cannot run at all; neorec's loader names it
    a = _copy(art, "none", tmp_path, "cut-loader")
    _truncate(a / "serving.py")
    c.expect_error("truncated serving.py", lambda a=a: load_artifact(a), (str(a), "serving.py"))
    c.check()


def test_verification_can_be_skipped_but_sizes_are_always_checked(
    art: SimpleNamespace, tmp_path: Path
) -> None:
    a = _copy(art, "none", tmp_path, "flip")
    _flip(_table(a))
    load_artifact(a, verify=False)  # the CRC pass skipped: loads (the caller asked)
    a = _copy(art, "none", tmp_path, "cut")
    _truncate(_table(a))
    with pytest.raises(NeorecError, match=str(_table(a).relative_to(a))):
        load_artifact(a, verify=False)


def test_artifact_checksums_are_the_checkpoints(art: SimpleNamespace) -> None:
    """serving.py (no neorec) computes the same checksums as neorec.checkpoint.format."""
    a = art.out["int8"]
    serving = _serving(a)
    m = json.loads((a / "manifest.json").read_text())
    assert m["checksum"] == "sha256:" + manifest_checksum(m)
    assert serving.manifest_checksum(m) == manifest_checksum(m)
    assert set(m["files"]) >= {"dense.pt2", *(f for t in m["tables"] for f in t["files"].values())}
    for rel, entry in m["files"].items():
        data = (a / rel).read_bytes()
        assert entry == {"bytes": len(data), "crc32": checksum(data)}
        assert serving.file_crc32(str(a / rel)) == checksum(data)
    predictor = load_artifact(a)  # verified, then predicts as serving.py does
    got = predictor(art.dense.numpy(), art.sparse)
    assert np.array_equal(got, serving.load(str(a))(art.dense.numpy(), art.sparse))


def test_verification_cost(tmp_path: Path) -> None:
    """The CRC pass over a 64 MiB file (the figure in docs/running.md scales from it)."""
    from neorec.serve import standalone

    p = tmp_path / "big.npy"
    np.save(p, np.zeros((1 << 22, 4), dtype=np.float32))
    t0 = time.perf_counter()
    got = standalone.file_crc32(str(p))
    dt = time.perf_counter() - t0
    assert got == checksum(p.read_bytes())
    print(f"crc32 of {p.stat().st_size / 2**20:.0f} MiB: {dt * 1e3:.1f} ms")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_predict_refuses_non_finite_dense(art: SimpleNamespace, bad: float) -> None:
    c = campaign("serving inputs")
    dense = art.dense.numpy().copy()
    dense[2, 5] = bad
    a = art.out["none"]
    for name, fn in (
        ("serving.py", _serving(a).load(str(a))),
        ("load_artifact", load_artifact(a)),
    ):
        try:
            probs = fn(dense, art.sparse)
            c.record(f"{name}: dense {bad}", "silently accepted", str(probs))
        except (NeorecError, ValueError) as e:
            msg = str(e)
            ok = "column 5" in msg and "row 2" in msg and "\n" not in msg
            if name == "load_artifact" and not isinstance(e, NeorecError):
                ok = False
            c.record(f"{name}: dense {bad}", "clear error" if ok else "crash", msg)
    # neorec predict / eval: the batches of a data source
    good = Batch(art.dense, art.sp, torch.zeros(4))
    worse = Batch(torch.from_numpy(dense), art.sp, torch.zeros(4))
    c.expect_error(
        f"neorec predict: dense {bad}",
        lambda: predict_batches(art.model, iter([good, worse])),
        ("column 5", "row 6"),  # the second batch's row 2: sample 6 of the data
    )
    c.check()


class _FullDisk:
    """``open`` for ``neorec.serve.export`` on a disk that holds ``budget`` more bytes: a write
    past it stores what fits, then raises ``ENOSPC``."""

    def __init__(self, budget: int) -> None:
        self.left = budget

    def __call__(self, path: Any, mode: str = "r", *a: Any, **kw: Any) -> Any:
        fh = open(path, mode, *a, **kw)  # noqa: SIM115 - wrapped, closed by the caller
        return fh if "w" not in mode else _Capped(fh, self)


class _Capped:
    def __init__(self, fh: Any, disk: _FullDisk) -> None:
        self.fh, self.disk = fh, disk

    def write(self, data: Any) -> int:
        n = len(memoryview(data).cast("B"))
        if n > self.disk.left:
            self.fh.write(memoryview(data).cast("B")[: self.disk.left])
            self.disk.left = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.disk.left -= n
        return int(self.fh.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fh, name)

    def __enter__(self) -> _Capped:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.fh.close()


def test_export_onto_a_full_disk_is_one_line(art: SimpleNamespace, tmp_path: Path) -> None:
    """The disk fills at every file of the export in turn (dense program, tables, serving.py,
    manifest): one ``NeorecError`` line naming the file and the OS error, nothing exported, no
    partial folder left; with room, the same export succeeds."""
    import neorec.serve.export as export_mod

    size = {p.name: p.stat().st_size for p in art.out["int8"].rglob("*") if p.is_file()}
    full = sum(size.values())
    # written in this order: dense.pt2, the tables, serving.py, manifest.json (the last)
    last = full - size["manifest.json"]
    budgets = {0, 1, size["dense.pt2"] // 2, last - size["serving.py"] // 2, full - 1}
    budgets |= {full * k // 12 for k in range(1, 12)}
    named = set()
    c = campaign("export onto a full disk")
    for budget in sorted(budgets):
        out = tmp_path / f"art-{budget}"
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(export_mod, "open", _FullDisk(budget), raising=False)
            try:
                export_model(art.root, out, "int8")
            except NeorecError as e:
                msg = str(e)
                ok = "cannot write (No space left on device" in msg and "\n" not in msg
                ok = ok and "nothing was exported" in msg and not out.exists()
                ok = ok and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
                named.add(msg.split(": ")[1])
                c.record(f"budget {budget}", "handled" if ok else "silently accepted", msg)
            except Exception as e:  # noqa: BLE001 - a crash is the finding
                c.record(f"budget {budget}", "crash", f"{type(e).__name__}: {e}")
            else:
                c.record(f"budget {budget}", "silently accepted", "exported on a full disk")
    c.check()
    assert {"dense.pt2", "manifest.json", "serving.py"} <= named, named
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export_mod, "open", _FullDisk(full), raising=False)
        export_model(art.root, tmp_path / "roomy", "int8")
    assert (tmp_path / "roomy" / "manifest.json").exists()


def test_no_samples_names_the_data(art: SimpleNamespace) -> None:
    with pytest.raises(NeorecError, match=r"^held\.csv: holds no samples to eval; check --data"):
        predict_batches(art.model, iter([]), what="eval", source="held.csv")
