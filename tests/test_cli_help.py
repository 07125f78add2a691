"""``neorec --help`` loads the command modules only (no NumPy, no planner), and the launcher's
worker side reads its restart attempt from the environment."""

from __future__ import annotations

from test_layers import _imported_modules


def test_top_level_help_loads_no_numpy_nor_planner() -> None:
    code = (
        "import contextlib, io\n"
        "from neorec.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
    )
    loaded = _imported_modules(code)
    assert "numpy" not in loaded and "torch" not in loaded
    assert not any(m.startswith(("neorec.sharding", "neorec.launch")) for m in loaded)


def test_parser_adds_the_named_commands_flags_only() -> None:
    from neorec.cli import COMMANDS, build_parser

    args = build_parser(["plan"]).parse_args(["plan", "--world-size", "2"])
    assert args.world_size == 2
    full = build_parser().parse_args(["train", "--nproc", "2"])
    assert full.nproc == 2 and len(COMMANDS) > 2


def test_attempt_overrides(monkeypatch) -> None:
    from neorec.launch.worker import LAUNCHER_PID_ENV, attempt_overrides

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert attempt_overrides(False) == []
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
    assert attempt_overrides(False) == ["system.fail_at=''", 'checkpoint.resume="auto"']
    assert attempt_overrides(True) == ["system.fail_at=''"]
    monkeypatch.setenv(LAUNCHER_PID_ENV, "1")
    assert attempt_overrides(False) == ["system.fail_at=''"]
