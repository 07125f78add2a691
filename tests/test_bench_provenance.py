"""A stored benchmark result carries the provenance its own process recorded (argv, commit, CPU,
cores, load, a digest over all of it and the result); a hand edit of any of them is caught, and
``bench report --ingest`` refuses a log that is not the output of the entry's command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from neorec.bench import provenance, report
from neorec.bench.report_rows import ENTRIES, Entry
from neorec.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent

ARGV = ("locality", "--tables", "2", "--scale", "256")

# Rows stored before the benchmark processes recorded their provenance: re-run each (``neorec
# bench report --only NAME``) and take it off this list. A row not on it must verify.
WITHOUT_PROVENANCE = {"distill", "step_torchrec_dcn", "step_torchrec_lowp"}


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output of a real, small benchmark run through ``neorec bench``."""
    out = subprocess.run(
        [sys.executable, "-m", "neorec", "bench", *ARGV],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    path = tmp_path_factory.mktemp("prov") / "locality.log"
    path.write_text(out)
    return path


def _entry(argv: tuple[str, ...] = ARGV) -> Entry:
    return Entry("loc", "w", "t", argv, argv, str)


def test_the_benchmark_process_records_its_own_argv(log: Path) -> None:
    result, prov = provenance.split_output(log.read_text())
    assert result["bench"] == "locality"
    assert prov is not None
    assert prov["argv"] == ["bench", *ARGV]
    assert provenance.verify(result, prov, ["bench", *ARGV]) == []
    assert prov["cores"] >= 1 and prov["cpu"] == provenance.cpu_label()
    assert len(prov["commit"].removesuffix("+dirty")) == 40


@pytest.mark.parametrize(
    "field, value",
    [
        ("argv", ["bench", "locality"]),
        ("commit", "0" * 40),
        ("cpu", "Some Other CPU"),
        ("cores", 64),
        ("load_before", 0.0),
        ("load_after", 9.9),
        ("date", "2020-01-01T00:00:00Z"),
    ],
)
def test_a_hand_edit_of_any_field_is_caught(log: Path, field: str, value: object) -> None:
    result, prov = provenance.split_output(log.read_text())
    assert prov is not None and prov[field] != value
    edited = {**prov, field: value}
    problems = provenance.verify(result, edited, list(edited["argv"]))
    assert any("digest" in p for p in problems), problems


def test_a_hand_edit_of_the_result_is_caught(log: Path) -> None:
    result, prov = provenance.split_output(log.read_text())
    result = {**result, "tables": result["tables"] + 1}
    assert any("digest" in p for p in provenance.verify(result, prov, ["bench", *ARGV]))


def test_ingest_takes_the_entrys_own_output(log: Path) -> None:
    rec = report.ingest(_entry(), log)
    assert rec["provenance"]["argv"] == ["bench", *ARGV]
    assert rec["load"] == rec["provenance"]["load_before"] and rec["cores"] >= 1


def test_ingest_refuses_another_command_a_bare_log_and_an_edit(log: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not the output of `neorec bench locality --tables 4"):
        report.ingest(_entry(("locality", "--tables", "4", "--scale", "256")), log)
    bare = tmp_path / "bare.log"
    bare.write_text("\n".join(ln for ln in log.read_text().splitlines() if "provenance" not in ln))
    with pytest.raises(ConfigError, match="no provenance"):
        report.ingest(_entry(), bare)
    lines = log.read_text().splitlines()
    result = json.loads(next(ln for ln in reversed(lines) if ln.startswith('{"bench"')))
    result["lookups"] += 1
    forged = tmp_path / "forged.log"
    forged.write_text(json.dumps(result) + "\n" + lines[-1] + "\n")
    with pytest.raises(ConfigError, match="digest does not match"):
        report.ingest(_entry(), forged)


def test_every_stored_row_verifies_or_is_listed_without_provenance() -> None:
    results = report.load_results(ROOT / "bench-results.json")["full"]
    by_name = {e.name: e for e in ENTRIES}
    bad = []
    for name, rec in results.items():
        if name in WITHOUT_PROVENANCE:
            assert "provenance" not in rec, f"'{name}' has provenance now: take it off the list"
            continue
        e = by_name[name]
        problems = provenance.verify(rec["result"], rec.get("provenance"), [e.kind, *e.argv])
        bad += [f"{name}: {p}" for p in problems]
    assert not bad, "stored results whose provenance does not hold:\n" + "\n".join(bad)
    assert WITHOUT_PROVENANCE <= set(results), "a listed row is gone: take it off the list"
