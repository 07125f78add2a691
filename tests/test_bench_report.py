"""``neorec bench report``: the README's results table is exactly the rendering of the committed
``bench-results.json`` (no figure typed by hand), and the runner's contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neorec.bench import report
from neorec.bench.report_rows import ENTRIES, Entry, render_table
from neorec.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_readme_table_is_the_rendering_of_the_committed_results() -> None:
    results = report.load_results(ROOT / "bench-results.json")
    readme = (ROOT / "README.md").read_text()
    assert report.splice(readme, render_table(results["full"])) == readme, (
        "README's results table differs from bench-results.json: run "
        "`neorec bench report --render-only` (never edit the table by hand)"
    )


def test_every_stored_result_has_an_entry_and_its_command() -> None:
    results = report.load_results(ROOT / "bench-results.json")
    by_name = {e.name: e for e in ENTRIES}
    for name, rec in results["full"].items():
        assert name in by_name, f"bench-results.json holds '{name}', which no entry has"
        assert rec["command"] == by_name[name].command(), f"'{name}' was run with another command"
        assert not rec["quick"]


def test_entries_are_unique_and_sources_exist() -> None:
    names = [e.name for e in ENTRIES]
    assert len(names) == len(set(names))
    for e in ENTRIES:
        if e.source:
            assert e.source in names and not e.argv


def test_last_json_takes_the_last_object_line() -> None:
    out = 'table\n{"a": 1}\nnote\n{"b": 2}\ntrailing words\n'
    assert report.last_json(out) == {"b": 2}
    with pytest.raises(ValueError, match="no JSON line"):
        report.last_json("only a table\n[1, 2]\n")


def test_splice_replaces_only_between_the_markers() -> None:
    text = f"head\n{report.BEGIN}\nold\n{report.END}\ntail\n"
    assert report.splice(text, "new\n") == f"head\n{report.BEGIN}\nnew\n{report.END}\ntail\n"
    with pytest.raises(ConfigError, match="markers"):
        report.splice("no markers", "x")


def test_unknown_entry_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="unknown entries \\['nope'\\]"):
        report.main(["--only", "nope", "--list"])


def test_a_row_of_another_entrys_run_runs_that_entry(capsys: pytest.CaptureFixture[str]) -> None:
    shared = next(e for e in ENTRIES if e.source)
    report.main(["--only", shared.name, "--list"])
    assert capsys.readouterr().out.split()[0] == shared.source


def test_a_failing_command_names_its_entry_and_keeps_other_results(tmp_path: Path) -> None:
    bad = Entry("broken", "w", "t", ("op", "--no-such-flag"), ("op", "--no-such-flag"), str)
    with pytest.raises(RuntimeError, match="entry 'broken' failed"):
        report.run_entry(bad, quick=False)
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"full": {"kept": {"x": 1}}, "quick": {}}))
    assert report.load_results(results)["full"] == {"kept": {"x": 1}}
    results.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        report.load_results(results)


def test_missing_results_render_as_not_measured() -> None:
    table = render_table({})
    assert table.count("not measured yet") == len(ENTRIES)
