"""The house's structure, checked: the layer order docs/DESIGN.md states, no import cycle between
packages nor between the files of one package, a planner without torch, a command line that
starts without torch, files of at most 600 lines.

Every ``import`` counts, at module level or inside a function (a lazy import is still a
dependence: it only moves the cycle to run time); imports under ``if TYPE_CHECKING:`` (for
annotations only, never run) do not count between the files of a package.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "neorec"
DESIGN = ROOT / "docs" / "DESIGN.md"
MAX_LINES = 600


def declared_layers() -> dict[str, int]:
    """Each top-level part of ``neorec`` -> its layer, from DESIGN.md's "Layers" list (numbered
    from the bottom; several parts on one line share a layer and may not import each other)."""
    text = DESIGN.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers: dict[str, int] = {}
    for line in section.splitlines():
        m = re.match(r"\s*(\d+)\.\s+`([^`]+)`", line)
        if m:
            for name in m.group(2).split(","):
                layers[name.strip().strip("/").removesuffix(".py")] = int(m.group(1))
    return layers


def part_of(module: str) -> str:
    """``neorec.train.trainer`` -> ``train``; ``neorec.errors`` -> ``errors``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _from_target(node: ast.ImportFrom, mod: str, is_pkg: bool) -> str:
    """The module a ``from ... import`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = mod.split(".")[: None if is_pkg else -1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path) -> list[tuple[str, int]]:
    """Every ``neorec`` module ``path`` imports (resolved, relative imports too), with its line."""
    mod, is_pkg = module_name(path), path.name == "__init__.py"
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((_from_target(node, mod, is_pkg), node.lineno))
    return [(t, ln) for t, ln in out if t == "neorec" or t.startswith("neorec.")]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Ids of the nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``), never run."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            out.update(id(n) for sub in node.body for n in ast.walk(sub))
    return out


def file_imports(path: Path, modules: set[str]) -> list[tuple[str, int]]:
    """The files of ``neorec`` (modules in ``modules``) that ``path`` runs when it imports, with
    the line: ``import a.b`` and ``from a.b import x`` import ``a.b``, ``from a import b`` the
    submodule ``a.b`` when there is one (as ``import a.b`` does: a package's parent is not
    counted), and a package's ``__init__`` only for names it defines (or re-exports). An
    import under ``if TYPE_CHECKING:`` is not run, so not counted."""
    mod = module_name(path)
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, mod, is_pkg)
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub if sub in modules else target, node.lineno))
    resolved = []
    for target, line in out:
        while target and target not in modules:  # ``import a.b.func``-like: the module a.b
            target = target.rpartition(".")[0]
        if target and target != mod:
            resolved.append((target, line))
    return resolved


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def source_files() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_part_has_a_layer() -> None:
    layers = declared_layers()
    assert layers, "docs/DESIGN.md has no '## Layers' list"
    parts = {p.stem if p.is_file() else p.name for p in PKG.iterdir() if not p.name.startswith("_")}
    parts = {p for p in parts if (PKG / p).is_dir() or (PKG / f"{p}.py").is_file()}
    missing = sorted(parts - set(layers) - {"__main__"})
    assert not missing, f"parts of neorec with no layer in docs/DESIGN.md: {missing}"
    stale = sorted(set(layers) - parts)
    assert not stale, f"docs/DESIGN.md lists layers that do not exist: {stale}"


def test_imports_point_down() -> None:
    """An import from one part to another goes to a lower layer: no upward edge, so no cycle."""
    layers = declared_layers()
    bad = []
    for path in source_files():
        src = part_of(module_name(path))
        if src == "__main__":
            continue
        for target, line in imports_of(path):
            dst = part_of(target)
            if dst == src or target == "neorec":
                continue
            if layers[src] <= layers[dst]:
                bad.append(
                    f"{path.relative_to(ROOT)}:{line}: {src} (layer {layers[src]}) imports "
                    f"{target} ({dst}, layer {layers[dst]})"
                )
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_no_import_cycle_inside_a_package() -> None:
    """No two files of one part import each other, directly or through others: a package's files
    form layers of their own. A submodule imports its siblings directly, not through its
    package's ``__init__`` (which may import it)."""
    paths = {module_name(p): p for p in source_files()}
    graph: dict[str, set[str]] = {}
    for mod, path in paths.items():
        part = part_of(mod)
        graph[mod] = {t for t, _ in file_imports(path, set(paths)) if part_of(t) == part}
    cycles = _cycles(graph)

    def rel(m: str) -> str:
        return str(paths[m].relative_to(ROOT))

    assert not cycles, "files of one package that import each other (in a cycle):\n" + "\n".join(
        " <-> ".join(rel(m) for m in c) for c in cycles
    )


def _modules_under(part: str) -> list[str]:
    return [module_name(p) for p in source_files() if part_of(module_name(p)) == part]


def _imported_modules(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print('\\n'.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    return set(out.split())


def test_planner_never_imports_torch() -> None:
    """Every module of ``neorec.sharding`` loads without torch (or NumPy's heavy friends)."""
    mods = _modules_under("sharding")
    loaded = _imported_modules("\n".join(f"import {m}" for m in mods))
    assert "torch" not in loaded, "neorec.sharding imports torch"


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["plan", "--help"]])
def test_cli_help_needs_no_torch(argv: list[str]) -> None:
    """``neorec --help`` and a command's ``--help`` import no torch (the slow import)."""
    code = (
        "import contextlib, io, sys\n"
        "from neorec.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    try:\n        main({argv!r})\n    except SystemExit:\n        pass\n"
    )
    assert "torch" not in _imported_modules(code)


def test_every_command_has_help() -> None:
    """Every registered command prints its own ``--help`` (exit 0), without torch for the
    commands that are not benchmarks."""
    from neorec.cli import COMMANDS

    for name in COMMANDS:
        r = subprocess.run(
            [sys.executable, "-m", "neorec", name, "--help"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert r.returncode == 0, f"neorec {name} --help: {r.stderr[-500:]}"
        assert "usage:" in r.stdout, f"neorec {name} --help printed no usage"


def test_files_are_short() -> None:
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in source_files()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"files over {MAX_LINES} lines (split them along their seams):\n" + "\n".join(
        long
    )


def test_below_the_builder_no_whole_config() -> None:
    """Only the builder and the parts above it take the whole ``Config``; below it, code receives
    its own sections or plain values."""
    layers = declared_layers()
    top = layers["builder"]
    bad = []
    for path in source_files():
        part = part_of(module_name(path))
        if part == "config" or layers.get(part, top) >= top:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("neorec.config")
            ):
                names = {a.name for a in node.names}
                if names & {"Config", "load_config", "apply_overrides"}:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {sorted(names)}")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for a in node.args.args + node.args.kwonlyargs:
                    ann = ast.unparse(a.annotation) if a.annotation is not None else ""
                    # a parameter named cfg is a section (``DataConfig``, ...), not the whole
                    if a.arg == "cfg" and (not ann.endswith("Config") or ann == "Config"):
                        where = f"{path.relative_to(ROOT)}:{node.lineno}"
                        bad.append(f"{where}: {node.name}(cfg: {ann or 'unannotated'})")
    assert not bad, "below the builder, the whole Config is imported:\n" + "\n".join(bad)
