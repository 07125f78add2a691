"""``neorec bench op|step --device cuda`` (next to FBGEMM GPU): ready to run on a GPU host, refused
in one line here (no CUDA device; fbgemm_gpu absent), and the ``device`` campaign: every way a
GPU request can meet a machine without one."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from faults import campaign

from neorec.bench import op, step
from neorec.config import ConfigError
from neorec.config.load import load_config
from neorec.config.run import TrainConfig

C = campaign("device")
NO_CUDA = not torch.cuda.is_available()
HAS_FBGEMM = importlib.util.find_spec("fbgemm_gpu") is not None
TINY_OP = ["--tables", "2", "--rows", "50", "--dim", "4", "--batch", "8", "--pooling", "2"]
TINY_STEP = ["--tables", "2", "--rows", "50", "--dim", "4", "--batch", "8", "--iters", "1"]


def test_cuda_flags_default_to_the_gpu_comparison():
    a = op.parse_args(["--device", "cuda", *TINY_OP])
    assert (a.device, a.backend, a.compare) == ("cuda", "auto", "fbgemm")
    a = op.parse_args(["--device", "cuda", "--compare", "none", *TINY_OP])
    assert a.compare == "none"
    a = op.parse_args(TINY_OP)  # the CPU bench is unchanged
    assert (a.device, a.backend) == ("cpu", "cpu")


def test_fbgemm_missing_is_named(monkeypatch):
    # As on a GPU host without fbgemm_gpu: the CUDA check passes, the peer's absence is named.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    for bench in ("op", "step"):
        with pytest.raises(
            ConfigError, match="fbgemm_gpu is not installed; pip install fbgemm-gpu"
        ):
            op.check_gpu_bench(bench, "cuda", "fbgemm")
        op.check_gpu_bench(bench, "cuda", "none")  # --compare none: ours alone
    op.check_gpu_bench("op", "cpu", "fbgemm")  # nothing to check on the CPU


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is present")
def test_device_campaign(tmp_path):
    no_gpu = "sees no CUDA device"
    C.expect_error(
        "bench op --device cuda", lambda: op.main(["--device", "cuda", *TINY_OP]), no_gpu
    )
    C.expect_error(
        "bench op --device cuda --compare none",
        lambda: op.main(["--device", "cuda", "--compare", "none", *TINY_OP]),
        no_gpu,
    )
    C.expect_error(
        "bench step --device cuda", lambda: step.main(["--device", "cuda", *TINY_STEP]), no_gpu
    )
    C.expect_error(
        "train.device cuda (config check)",
        lambda: TrainConfig(device="cuda").check_device(),
        no_gpu,
    )
    for bad in ("'gpu'", "'cuda:0'", "'CUDA'", "''", "1"):
        C.expect_error(
            f"train.device={bad}",
            lambda b=bad: load_config(None, [f"train.device={b}"]),
            "train.device",
        )
    # The command line: one line, exit 2, before a run folder or a process group exists.
    C.expect_cli_error("cli bench op --device cuda", ["bench", "op", "--device", "cuda"], no_gpu)
    C.expect_cli_error(
        "cli train --set train.device='cuda'",
        ["train", "--set", "train.device='cuda'", "--set", f"train.runs_dir='{tmp_path}'"],
        "train.device = 'cuda'",
        cwd=str(tmp_path),
    )
    assert not any(tmp_path.iterdir()), "a run folder was made for a refused run"
    C.check()


# ---- GPU topology presets of the cost model -------------------------------------------------
def _plan_ms(capsys, *argv: str) -> tuple[float, str]:
    from neorec.cli.plan import main as plan_main

    assert plan_main(["--config", "configs/default.toml", "--world-size", "16", *argv]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("predicted embedding time"))
    return float(line.split(":")[1].split("ms")[0]), out


def test_gpu_presets_are_sourced_and_simulated():
    from neorec.sharding.gpu_topology import GATHER_EFFICIENCY, PRESETS, preset_topology

    for name, host in PRESETS.items():
        topo = preset_topology(name, 16)
        assert (topo.world_size, topo.ranks_per_host, topo.num_hosts) == (16, 8, 2)
        assert "simulation" in topo.name and host.sources
        assert topo.device_bw_gbs == host.hbm_bw_gbs * GATHER_EFFICIENCY
        assert topo.intra_host_bw_gbs > topo.inter_host_bw_gbs  # links inside a host are faster
    a, h = preset_topology("a100_nvlink", 16), preset_topology("h100_nvlink", 16)
    assert h.device_bw_gbs > a.device_bw_gbs and h.inter_host_bw_gbs > a.inter_host_bw_gbs
    assert preset_topology("a100_nvlink", 4).ranks_per_host == 4  # fewer GPUs than a host
    with pytest.raises(ConfigError, match="not a GPU topology preset; known"):
        preset_topology("tpu_v5", 8)


def test_plan_with_a_preset(capsys):
    # The presets' constants reach the cost model: the faster machine predicts a faster step.
    ms = {}
    for name in ("pcie", "a100_nvlink", "h100_nvlink"):
        ms[name], out = _plan_ms(capsys, "--topology-preset", name)
        assert out.startswith("SIMULATION") and "preset: 2 host(s) x 8 GPUs" in out
    assert ms["h100_nvlink"] < ms["a100_nvlink"] < ms["pcie"]
    from neorec.cli.plan import main as plan_main

    argv = ["--config", "configs/default.toml", "--world-size", "16"]
    assert plan_main([*argv, "--topology-preset", "nope"]) == 2
    assert plan_main([*argv, "--topology-preset", "pcie", "--topology", "t.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("neorec: error: --topology-preset 'nope' is not a GPU")
    assert err[1] == "neorec: error: --topology-preset and --topology name two topologies: pass one"
