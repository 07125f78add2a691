"""Run folders: ``<runs_dir>/<name>/`` per ``neorec train`` run, ``latest``, and what goes in.

A run folder holds ``config.toml`` (the config as resolved, re-runnable with ``--config``),
``metrics.json`` (written at the end, with a ``run`` block: versions, git commit, host, CPU, world
size, start and end), ``events.jsonl`` (one JSON line per logged step, flushed as written),
``train.log`` (what the terminal showed) and, by default, ``checkpoints/``.

Which folder (``resolve_run``): ``train.run_dir`` when set (an exact folder, no ``latest``);
else a resumed run (``--resume latest|auto|ckpt-NAME``, ``checkpoint.dir`` unset) continues the
folder of ``train.name`` or, without a name, the one ``<runs_dir>/latest`` points at; else a new
folder ``train.name`` or the UTC time, with ``-2``, ``-3`` ... when taken. A new folder is
reserved (created empty) when it is chosen, so two runs never share one; ``discard_if_empty``
removes it again when the run never started. ``--nproc`` ranks receive the launcher's choice
through ``NEOREC_RUN_DIR`` / ``NEOREC_RUNS_ROOT``.

The chosen folder is locked (``neorec.train.runlock``) by the process that chose it, for the run's
life: a second run of the same folder is refused with one line naming the holder's pid.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import socket
import sys
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO, cast

from neorec.errors import ConfigError
from neorec.machine import cpu_model_and_flags
from neorec.train import runlock
from neorec.train.runlock import RunFolderError
from neorec.train.tee import Tee

__all__ = [
    "RUN_DIR_ENV",
    "RUNS_ROOT_ENV",
    "LATEST",
    "RunFolder",
    "RunFolderError",
    "resolve_run",
    "has_checkpoint",
    "update_latest",
    "run_info",
    "dump_toml",
    "utc_now",
    "RunLog",
    "started",
    "Tee",
]

RUN_DIR_ENV = "NEOREC_RUN_DIR"
"""The run folder a launcher chose for its ranks (an exact path)."""
RUNS_ROOT_ENV = "NEOREC_RUNS_ROOT"
"""The runs root of that folder ('' when the folder is an explicit ``train.run_dir``)."""
LATEST = "latest"


def utc_now() -> str:
    """The time now, UTC, ISO 8601 to the second (``2026-11-25T14:30:12Z``)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- which folder ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RunFolder:
    """The folder of one run and, when it is a run folder under a root, that root."""

    path: Path
    root: Path | None = None
    """The runs root (``latest`` is kept there); None for an explicit ``train.run_dir``."""
    created: bool = False
    """This process reserved the folder (an empty one is removed when the run never starts)."""

    @property
    def name(self) -> str:
        """The run's name (its folder's)."""
        return self.path.name

    def env(self) -> dict[str, str]:
        """Environment that hands this folder to the ranks of a launched job."""
        return {
            RUN_DIR_ENV: str(self.path),
            RUNS_ROOT_ENV: "" if self.root is None else str(self.root),
        }

    @classmethod
    def from_env(cls) -> RunFolder | None:
        """The folder a launcher chose (``NEOREC_RUN_DIR``), if any."""
        path = os.environ.get(RUN_DIR_ENV, "")
        if not path:
            return None
        root = os.environ.get(RUNS_ROOT_ENV, "")
        return cls(Path(path), Path(root) if root else None)

    def apply(self, cfg: Any) -> Any:
        """``cfg`` with ``train.run_dir`` set to this folder (checkpoints, lowp.json go in it)."""
        train = dataclasses.replace(cfg.train, run_dir=str(self.path))
        return dataclasses.replace(cfg, train=train)

    def lock(self) -> RunFolder:
        """Lock the folder for this process's run (``runlock.acquire``); returns ``self``."""
        try:
            runlock.acquire(self.path)
        except BaseException:
            self.discard_if_empty()
            raise
        return self

    def release(self) -> None:
        """Drop this process's lock of the folder (the run is over)."""
        runlock.release(self.path)

    def discard_if_empty(self) -> None:
        """Release the folder's lock; remove the folder if this process reserved it and nothing
        was written into it (its lock file aside)."""
        if self.created and runlock.held(self.path):
            try:
                if [p.name for p in self.path.iterdir()] == [runlock.LOCK_FILE]:
                    (self.path / runlock.LOCK_FILE).unlink()
            except OSError:
                pass
        self.release()
        if self.created:
            try:
                self.path.rmdir()  # only an empty directory goes
            except OSError:
                pass


def _timestamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")


def _checked_root(runs_dir: str) -> Path:
    root = Path(runs_dir)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"train.runs_dir '{runs_dir}' is a file, not a folder; name a folder")
    return root


def reserve(root: Path, base: str) -> RunFolder:
    """Create the folder ``root/base`` (or ``base-2``, ``base-3``, ... if taken) and return it."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunFolderError(
            f"train.runs_dir '{root}': cannot create it: {e.strerror or e}"
        ) from None
    for i in range(1, 100_000):
        path = root / (base if i == 1 else f"{base}-{i}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        except OSError as e:
            raise RunFolderError(
                f"run folder {path}: cannot create it: {e.strerror or e}"
            ) from None
        return RunFolder(path, root, created=True)
    raise RunFolderError(f"run folder {root / base}: every suffix up to -99999 is taken")


def has_checkpoint(folder: Path) -> bool:
    """Whether ``folder/checkpoints`` holds a checkpoint with a manifest (readable or not)."""
    from neorec.checkpoint.format import MANIFEST

    ckpts = folder / "checkpoints"
    try:
        return any(p.name.startswith("ckpt-") and (p / MANIFEST).exists() for p in ckpts.iterdir())
    except OSError:
        return False


def _latest_folder(root: Path, which: str) -> Path | None:
    """The folder ``root/latest`` names (a link, or a directory of an older neorec)."""
    link = root / LATEST
    if not os.path.lexists(link):
        if which == "auto":
            return None
        raise RunFolderError(
            f"--resume {which}: no run under {root} to resume ({link} does not exist); drop "
            f"--resume to start a new run, or use --resume auto"
        )
    if link.is_symlink():
        target = root / os.readlink(link)
        if not target.is_dir():
            if which == "auto":
                return None
            raise RunFolderError(
                f"--resume {which}: {link} points at {target}, which is gone; name the run with "
                f"--set train.name=NAME (neorec runs --root {root} lists them)"
            )
        return target
    return link  # a run folder named latest (older neorec): resumed in place


def _resumed(cfg: Any, root: Path) -> RunFolder | None:
    """The existing run folder a resumed run continues; None = a new folder."""
    which, name = cfg.checkpoint.resume.strip(), cfg.train.name
    bare = which.startswith("ckpt-") and "/" not in which
    if which in ("latest", "auto") or bare:
        mode = "latest" if bare else which
        if name:
            folder: Path | None = root / name
            assert folder is not None
            if not folder.is_dir():
                if mode == "auto":
                    return None
                raise RunFolderError(
                    f"--resume {which}: no run '{name}' under {root} (train.name); drop --resume "
                    f"to start it, or use --resume auto (neorec runs --root {root} lists the runs)"
                )
        else:
            folder = _latest_folder(root, mode)
        if folder is None or (mode == "auto" and not has_checkpoint(folder)):
            return None
        return RunFolder(folder, root)
    if "://" in which:
        return None
    # A checkpoint path: continue its run when it sits in <root>/<run>/checkpoints/.
    p = Path(which).resolve()
    ckpts = p if p.name == "checkpoints" else p.parent
    if ckpts.name == "checkpoints" and ckpts.parent.parent == root.resolve():
        return RunFolder(root / ckpts.parent.name, root)
    return None


def resolve_run(cfg: Any) -> RunFolder:
    """The folder of a ``neorec train`` run of ``cfg`` (a new one is reserved; see the module)."""
    given = RunFolder.from_env()
    if given is not None:
        return given
    t = cfg.train
    root = _checked_root(t.runs_dir)
    if t.run_dir:
        path = Path(t.run_dir)
        if path.is_symlink() and path.name == LATEST:
            raise ConfigError(
                f"train.run_dir '{t.run_dir}' is the link to the newest run folder "
                f"({os.readlink(path)}); each run now gets its own folder under train.runs_dir: "
                f"drop train.run_dir (and use --resume latest to continue that run)"
            )
        if path.exists() and not path.is_dir():
            raise ConfigError(f"train.run_dir '{t.run_dir}' is a file, not a folder")
        created = not path.exists()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunFolderError(
                f"train.run_dir '{t.run_dir}': cannot create it: {e.strerror or e}"
            ) from None
        return RunFolder(path, created=created).lock()
    if cfg.checkpoint.resume.strip() and not cfg.checkpoint.dir:
        found = _resumed(cfg, root)
        if found is not None:
            return found.lock()
    return reserve(root, t.name or _timestamp()).lock()


def update_latest(root: Path, name: str) -> str:
    """Point ``root/latest`` at ``name`` (atomic replace); '' or a note on why it was not."""
    link = root / LATEST
    if link.exists() and not link.is_symlink():
        return (
            f"note: {link} is a folder (an older neorec's run), not a link: left as it is; "
            f"rename it so that {link} can point at the newest run"
        )
    tmp = root / f".{LATEST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.symlink(name, tmp)
        os.replace(tmp, link)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return f"note: cannot point {link} at {name}: {e.strerror or e}"
    return ""


# ---- what the run records ----------------------------------------------------------------------
def _git_commit() -> str | None:
    """The commit of the source tree neorec runs from, when it is a git checkout (files only)."""
    try:
        top = Path(__file__).resolve().parents[2]
        git = top / ".git"
        if git.is_file():  # a worktree: "gitdir: PATH"
            git = Path(git.read_text().split(":", 1)[1].strip())
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head or None
        ref = head.split(":", 1)[1].strip()
        for base in (git, Path(str(git).split("/worktrees/")[0])):
            f = base / ref
            if f.is_file():
                return f.read_text().strip() or None
            packed = base / "packed-refs"
            if packed.is_file():
                for line in packed.read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split()[0]
    except (OSError, IndexError, ValueError):
        return None
    return None


def _cpu() -> dict[str, Any]:
    """CPU model, logical CPUs, the vector / matrix flags that matter here, torch's capability."""
    model, flags = cpu_model_and_flags()
    out: dict[str, Any] = {
        "model": model or None,
        "logical_cpus": os.cpu_count(),
        "flags": flags,
    }
    try:
        import torch

        out["torch_capability"] = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError, RuntimeError):
        pass
    return out


def run_info(folder: RunFolder, world: int, start: str) -> dict[str, Any]:
    """The ``run`` block of metrics.json (``end_utc`` is added when the run ends)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        neorec_version = version("neorec")
    except PackageNotFoundError:
        neorec_version = "unknown"
    return {
        "name": folder.name,
        "folder": str(folder.path),
        "neorec_version": neorec_version,
        "torch_version": torch.__version__,
        "python": sys.version.split()[0],
        "git_commit": _git_commit(),
        "host": socket.gethostname(),
        "cpu": _cpu(),
        "world_size": world,
        "start_utc": start,
    }


# ---- config.toml ---------------------------------------------------------------------------------
_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE.match(k) else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON string escapes are TOML basic-string escapes
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(str(k))} = {_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        items = [_value(x) for x in v]
        if any(isinstance(x, dict) for x in v):
            return "[\n" + "".join(f"  {i},\n" for i in items) + "]"
        return "[" + ", ".join(items) + "]"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as TOML")


def dump_toml(sections: dict[str, dict[str, Any]], header: str = "") -> str:
    """TOML text of a config dict (``Config.to_dict()``): one table per section."""
    out = [f"# {line}" for line in header.splitlines()]
    for name, body in sections.items():
        out += ["", f"[{_key(name)}]"]
        out += [f"{_key(k)} = {_value(v)}" for k, v in body.items() if v is not None]
    return "\n".join(out).lstrip("\n") + "\n"


# ---- the files of the run ------------------------------------------------------------------------
def _keep_events(path: Path, step: int) -> int:
    """Drop the lines of ``events.jsonl`` after ``step`` (an interrupted session's, replayed by
    the resumed run); returns how many were dropped. The file is replaced atomically."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            later = int(json.loads(line)["step"]) > step
        except (ValueError, KeyError, TypeError):
            later = True  # a line cut by the interruption
        if later:
            dropped += 1
        else:
            kept.append(line + "\n")
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return dropped


_STARTED = re.compile(r"^# neorec train, run .*, started (\S+?)(?:, resumed (\S+))?$")


def started(folder: Path) -> tuple[str, str | None] | None:
    """When the run of ``folder`` first started and when it was last resumed (None: not
    resumed), from its config.toml's first line; None when that line does not say."""
    try:
        with open(folder / "config.toml") as fh:
            m = _STARTED.match(fh.readline().rstrip("\n"))
    except (OSError, UnicodeDecodeError):
        return None
    return None if m is None else (m.group(1), m.group(2))


def _first_start(folder: Path) -> str | None:
    """The first start of the run in ``folder`` (config.toml, else metrics.json), if known."""
    known = started(folder)
    if known is not None:
        return known[0]
    try:
        run = json.loads((folder / "metrics.json").read_text())["run"]
        return str(run["start_utc"]) or None
    except (OSError, ValueError, KeyError, TypeError):
        return None


class RunLog:
    """Rank 0's files of a run: config.toml, events.jsonl, train.log and the ``latest`` link.

    ``start`` is when the run first started (a resumed run keeps its first session's, as
    config.toml's first line and metrics.json record it); ``resumed`` when this session began,
    for a resumed run."""

    def __init__(self, folder: RunFolder, tee: Tee) -> None:
        self.folder = folder
        self.tee = tee
        self.events: TextIO | None = None
        self.start = utc_now()
        self.resumed: str | None = None

    def open(self, config: dict[str, Any], resumed_step: int | None) -> None:
        """Create the folder's files: a new run starts them afresh, a resumed one appends (its
        events after the checkpoint's step are dropped: the resumed run trains those again)."""
        path = self.folder.path
        head = f"neorec train, run {self.folder.name}, started {self.start}"
        if resumed_step is not None:
            self.resumed, self.start = self.start, _first_start(path) or self.start
            head = f"neorec train, run {self.folder.name}, started {self.start}, resumed "
            head += str(self.resumed)
        try:
            path.mkdir(parents=True, exist_ok=True)
            tmp = path / f".config.toml.{os.getpid()}.tmp"
            tmp.write_text(dump_toml(config, head))
            os.replace(tmp, path / "config.toml")
            mode = "a" if resumed_step is not None else "w"
            dropped = (
                0 if resumed_step is None else _keep_events(path / "events.jsonl", resumed_step)
            )
            self.events = cast(TextIO, open(path / "events.jsonl", mode))
            log = cast(TextIO, open(path / "train.log", mode))
        except OSError as e:
            raise RunFolderError(f"run folder {path}: cannot write: {e.strerror or e}") from None
        if resumed_step is not None:
            log.write(f"---- resumed at step {resumed_step}, {self.resumed} ----\n")
        self.tee.attach(log)
        if dropped:
            print(
                f"events.jsonl: dropped {dropped} lines after step {resumed_step} (the interrupted "
                f"session's; trained again now)",
                file=self.tee,
                flush=True,
            )
        if self.folder.root is not None:
            note = update_latest(self.folder.root, self.folder.name)
            if note:
                print(note, file=self.tee, flush=True)

    def event(self, record: dict[str, Any]) -> None:
        """One line of events.jsonl, flushed."""
        if self.events is not None:
            self.events.write(json.dumps(record, default=float) + "\n")
            self.events.flush()

    def close(self) -> None:
        """Close the files (the terminal stays) and release the folder's lock: the run is over."""
        if self.events is not None:
            self.events.close()
            self.events = None
        log = self.tee.log
        if log is not None:
            self.tee.log = None
            log.close()
        self.folder.release()
