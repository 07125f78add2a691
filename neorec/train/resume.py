"""``neorec train --resume``: the resumed run keeps its own config.

A run folder keeps the config it ran with (``config.toml``). A resume of that folder starts from
it and applies only what is given now: the keys of a ``--config`` file given with ``--resume``
(only the keys the file names), then the ``--set`` overrides. Each key that changes is printed
(``resume: train.steps 400 -> 800 (from --set)``); the model's shape is still compared with the
checkpoint's (``preflight_resume``), so a change that would break the restore is refused there.

A finished run (its ``metrics.json`` written) whose resumed config asks for no further steps is
not trained again: ``finished_line`` is the one line that says so, and nothing is rewritten.

Under torchrun on several machines (``--nnodes``, or ranks started by hand) the ranks take the
config from their flags: no launcher reads the run folder first.
"""

from __future__ import annotations

import copy
import json
import shlex
from dataclasses import dataclass
from typing import Any

from neorec.config import Config, ConfigError, TrainConfig, load_config, read_toml
from neorec.config.checks import show
from neorec.config.load import config_from_data
from neorec.errors import NeorecError
from neorec.train.runs import RunFolder, has_checkpoint

__all__ = ["RESUME_LOCATORS", "Restored", "locating_overrides", "restore_config", "finished_line"]

RESUME_LOCATORS = (
    "train.runs_dir",
    "train.name",
    "train.run_dir",
    "checkpoint.resume",
    "checkpoint.dir",
)
"""The keys that say which run a resume continues (read before the run's own config)."""


def _key(item: Any) -> str:
    return item.split("=", 1)[0].strip() if isinstance(item, str) and "=" in item else ""


def locating_overrides(overrides: list[str]) -> list[str]:
    """The ``--set`` items that say which run to resume (the rest apply to its config)."""
    return [s for s in overrides if _key(s) in RESUME_LOCATORS]


@dataclass
class Restored:
    """The config a resume of a run folder runs with, and the lines that say where it came from."""

    cfg: Config
    lines: list[str]


def _flat(d: dict[str, Any]) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, body in d.items() for k, v in body.items()}


def _generated_tables_dropped(data: dict[str, Any], saved: Config) -> dict[str, Any]:
    """``data`` without ``embedding.tables`` when config.toml lists the tables that
    ``num_tables`` x ``rows`` x ``dim`` generate (so that ``--set embedding.rows=...`` acts on
    them, as in the run it came from); explicit tables stay."""
    emb = data.get("embedding")
    if not isinstance(emb, dict) or "tables" not in emb:
        return data
    bare = copy.deepcopy(data)
    del bare["embedding"]["tables"]
    try:
        generated = config_from_data(bare).embedding.tables
    except NeorecError:
        return data
    if generated == saved.embedding.tables:
        del emb["tables"]
    return data


def restore_config(
    run: RunFolder, which: str, config_path: str | None, overrides: list[str], ckpt_dir: str = ""
) -> Restored | None:
    """The resumed run's config: its folder's ``config.toml``, then the keys of ``config_path``
    (when given), then ``overrides``. None when ``run`` is not an earlier run's folder (a new
    folder, or ``--resume auto`` of a folder without a checkpoint) or keeps no config.toml: the
    config is then the one given now."""
    if run.created or (which == "auto" and not ckpt_dir and not has_checkpoint(run.path)):
        return None
    saved_path = run.path / "config.toml"
    if not saved_path.is_file():
        return None
    saved = load_config(saved_path)
    data = _generated_tables_dropped(read_toml(saved_path), saved)
    from_file: set[str] = set()
    if config_path is not None:
        for section, body in read_toml(config_path).items():
            if not isinstance(body, dict):
                data[section] = body  # refused by the schema, naming the file
                continue
            merged = data.setdefault(section, {})
            if isinstance(merged, dict):
                merged.update(body)
                from_file |= {f"{section}.{k}" for k in body}
    cfg = config_from_data(data, overrides, config_path or saved_path)
    given = {_key(s) for s in overrides}
    before, after = _flat(saved.to_dict()), _flat(cfg.to_dict())
    changes = []
    for key in after:
        if key == "checkpoint.resume" or before.get(key) == after[key]:
            continue
        by_set = key in given or any(k.startswith(key + ".") for k in given)
        src = f"--config {config_path}" if key in from_file and not by_set else "--set"
        changes.append(
            f"resume: {key} {show(before.get(key), 60)} -> {show(after[key], 60)} (from {src})"
        )
    n = len(changes)
    head = f"resume: run {run.name} with its own config ({saved_path})"
    head += f", {n} change{'s' if n > 1 else ''}:" if n else ", unchanged"
    return Restored(cfg, [head, *changes])


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def finished_line(run: RunFolder, cfg: Config) -> str | None:
    """One line when ``run`` has finished (``metrics.json``), has a checkpoint to go on from, and
    ``cfg`` asks for no further step; None when there is something to train."""
    path = run.path / "metrics.json"
    if not has_checkpoint(run.path):  # --resume is refused on its own: nothing to resume
        return None
    try:
        m = json.loads(path.read_text())
        done = _int(m["train"]["steps"])
        was = m.get("config", {}).get("train", {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if done is None or not isinstance(was, dict):
        return None
    t = cfg.train
    if t.steps:
        finished = t.steps <= done
    else:  # by epochs: finished when the run was by epochs too, and no more of them are asked
        epochs = _int(was.get("epochs"))
        finished = was.get("steps") == 0 and epochs is not None and t.epochs <= epochs
    if not finished:
        return None
    unapplied = _unapplied(run, cfg, done)
    again = ["neorec", "train", "--resume", "latest"]
    if run.root is not None:
        if str(run.root) != TrainConfig().runs_dir:
            again += ["--set", f"train.runs_dir={json.dumps(str(run.root))}"]
        again += ["--set", f"train.name={run.name}"]
    else:
        again += ["--set", f"train.run_dir={json.dumps(str(run.path))}"]
    again += ["--set", "train.steps=M"]
    return (
        f"neorec: run {run.name} is already finished at step {done} ({path}): nothing to train, "
        f"nothing rewritten{unapplied}; to train further: {shlex.join(again)} (M > {done})"
    )


def _unapplied(run: RunFolder, cfg: Config, done: int) -> str:
    """What of ``cfg`` differs from the finished run's own config, said (", the change of K is
    not applied"); a different model shape is refused (``ConfigError``): a resume trains on
    from the checkpoint, whose model it cannot change."""
    try:
        saved = load_config(run.path / "config.toml")
    except (OSError, NeorecError):
        return ""
    mine, theirs = cfg.describe_model(), saved.describe_model()
    if mine != theirs:
        what = ", ".join(k for k in mine if mine[k] != theirs.get(k))
        raise ConfigError(
            f"run {run.name} is already finished at step {done}, and the config given with "
            f"--resume changes its model ({what}): a resume trains on from its checkpoint and "
            "cannot change the model; for this model start a new run (without --resume)"
        )
    before, after = _flat(saved.to_dict()), _flat(cfg.to_dict())
    keys = [k for k in after if k != "checkpoint.resume" and before.get(k) != after[k]]
    if not keys:
        return ""
    return f", the change{'s' if len(keys) > 1 else ''} of {', '.join(keys)} not applied"
