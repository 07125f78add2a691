"""The house's second pass, kept: no function takes more than 10 parameters, the training step
and the trainer's loop fit on one screen, nothing hands the trainer around untyped, and no
benchmark instrument lives in production code.

Each check parses the source (``ast``); none runs it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "neorec"
MAX_PARAMS = 10


def _files() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(), str(path))
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A ``@triton.jit`` kernel: its parameters are the launch's pointers and constants (Triton
    takes no structs), so the parameter limit does not apply to it."""
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
    return n - (1 if names and names[0] in ("self", "cls") else 0)


def _where(path: Path, fn: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{getattr(fn, 'lineno', 0)}"


def test_no_function_takes_more_than_ten_parameters() -> None:
    bad = [
        f"{_where(p, f)} {f.name}: {_params(f)} parameters"
        for p in _files()
        for f in _functions(p)
        if _params(f) > MAX_PARAMS and not _is_triton_kernel(f)
    ]
    assert not bad, f"functions of more than {MAX_PARAMS} parameters:\n" + "\n".join(bad)


def _length(module: str, name: str) -> int:
    path = PKG.joinpath(*module.split(".")).with_suffix(".py")
    found = [f for f in _functions(path) if f.name == name]
    assert found, f"{module}.{name} not found"
    return max(f.end_lineno - f.lineno + 1 for f in found if f.end_lineno is not None)


def test_the_step_and_the_loop_fit_on_a_screen() -> None:
    assert _length("train.steps", "train_step") <= 40
    assert _length("train.trainer", "_fit") <= 60


def test_nothing_takes_the_trainer_untyped() -> None:
    """No parameter named ``trainer`` annotated ``Any`` (or unannotated): parts of a run receive
    the narrow objects they use."""
    bad = []
    for p in _files():
        for f in _functions(p):
            for a in f.args.posonlyargs + f.args.args + f.args.kwonlyargs:
                ann = ast.unparse(a.annotation) if a.annotation is not None else ""
                if a.arg == "trainer" and ann in ("", "Any"):
                    bad.append(f"{_where(p, f)} {f.name}({a.arg}: {ann or 'unannotated'})")
    assert not bad, "the trainer handed around untyped:\n" + "\n".join(bad)


def test_no_benchmark_instruments_in_production_code() -> None:
    """``train/`` and ``distributed/`` import nothing of ``neorec.bench`` and test no marks: a
    benchmark attaches its timer from outside (``neorec.phases.Marks``, a null object here)."""
    bad = []
    for part in ("train", "distributed"):
        for p in sorted((PKG / part).rglob("*.py")):
            tree = ast.parse(p.read_text(), str(p))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "neorec.bench"
                ):
                    bad.append(f"{_where(p, node)}: imports {node.module}")
                if isinstance(node, ast.Import) and any(
                    a.name.startswith("neorec.bench") for a in node.names
                ):
                    bad.append(f"{_where(p, node)}: imports neorec.bench")
                if isinstance(node, ast.If | ast.IfExp) and "marks" in ast.unparse(node.test):
                    bad.append(f"{_where(p, node)}: branches on {ast.unparse(node.test)}")
    assert not bad, "benchmark instruments in production code:\n" + "\n".join(bad)


def test_no_collection_constructor_restates_the_spec() -> None:
    """Every embedding collection takes ``(tables, spec, device, its own extras)``: none takes
    a field of ``CollectionSpec`` as a parameter of its own."""
    import dataclasses
    import importlib
    import inspect

    from neorec.modules.collection import CollectionSpec, EmbeddingCollection

    for p in _files():
        mod = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        if mod.split(".")[1] in ("modules", "storage", "distributed"):
            importlib.import_module(mod.removesuffix(".__init__"))
    fields = {f.name for f in dataclasses.fields(CollectionSpec)}
    seen, todo, bad = set(), [EmbeddingCollection], []
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
                params = set(inspect.signature(sub.__init__).parameters)
                if params & fields:
                    bad.append(f"{sub.__module__}.{sub.__name__}: {sorted(params & fields)}")
    assert len(seen) >= 8, sorted(c.__name__ for c in seen)
    assert not bad, "collection constructors that restate the spec:\n" + "\n".join(bad)
