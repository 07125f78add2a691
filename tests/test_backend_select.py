"""Backend selection: ``auto`` uses the C kernel, or warns and falls back without a compiler."""

import pytest

import neorec.ops.cpu as cpu
import neorec.ops.tbe as tbe


def test_auto_falls_back_to_reference_without_compiler(monkeypatch):
    def broken() -> None:
        raise RuntimeError("no C compiler 'cc' was found")

    monkeypatch.setattr(cpu, "load_kernel", broken)
    tbe._cpu_kernel_available.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C compiler"):
            assert tbe.get_backend("auto").name == "reference"
    finally:
        tbe._cpu_kernel_available.cache_clear()


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="unknown TBE backend 'gpu'"):
        tbe.get_backend("gpu")
