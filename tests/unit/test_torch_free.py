"""tests/unit runs in a venv without torch: no test module here imports torch, numpy or safetensors when it is
imported, directly or through the first-party modules it imports (tests.*, supervisor.*, trainer.*, bench.*).

Static, so it holds in any venv and in `make test`, where the integration tests have imported torch already;
tests/unit/conftest.py fails a test that imports torch as it runs (lazily, in the code it calls)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "tests" / "unit"
FORBIDDEN = {"torch", "numpy", "safetensors"}
FIRST_PARTY = {"tests", "supervisor", "trainer", "bench"}


def module_path(name: str) -> Path | None:
    """The file of a first-party module or package (None for a namespace package or a name that is no module)."""
    base = REPO.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def run_on_import(body: list[ast.stmt]) -> list[ast.AST]:
    """The simple statements (and decorators) that run when a module is imported: not the bodies of functions,
    not `if TYPE_CHECKING:`; the bodies of classes, ifs, trys and withs do run."""
    out: list[ast.AST] = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out += node.decorator_list
        elif isinstance(node, ast.ClassDef):
            out += node.decorator_list + node.bases
            out += run_on_import(node.body)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out += run_on_import(node.orelse)
        elif isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
            for field in ("body", "orelse", "finalbody"):
                out += run_on_import(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                out += run_on_import(handler.body)
        else:
            out.append(node)
    return out


def imported_on_import(source: str, package: str = "") -> set[str]:
    """Every module a source imports when it is imported, with its parent packages; importorskip counts."""
    names: set[str] = set()
    for stmt in run_on_import(ast.parse(source).body):
        for node in ast.walk(stmt):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                names.add(module)
                names.update(f"{module}.{a.name}" for a in node.names)  # `from package import module`
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "importorskip"
                  and node.args and isinstance(node.args[0], ast.Constant)):
                names.add(str(node.args[0].value))
    parts = [name.split(".") for name in names if name]
    return {".".join(p[: i + 1]) for p in parts for i in range(len(p))}


def forbidden_chains(roots: list[Path]) -> list[str]:
    """'a -> b -> torch' for every forbidden module the roots import on import, through first-party modules."""
    seen: set[str] = set()
    todo = [(p, [module_name(p)]) for p in roots]
    found = []
    while todo:
        path, chain = todo.pop()
        if chain[-1] in seen:
            continue
        seen.add(chain[-1])
        package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
        for imported in sorted(imported_on_import(path.read_text(), package)):
            top = imported.split(".")[0]
            if top in FORBIDDEN:
                found.append(" -> ".join([*chain, imported]))
            elif top in FIRST_PARTY and imported not in seen and (target := module_path(imported)) is not None:
                todo.append((target, [*chain, imported]))
    return sorted(found)


def test_no_unit_test_module_imports_torch() -> None:
    """Every module under tests/unit, and all of ours it imports, imports none of torch, numpy, safetensors."""
    roots = sorted(UNIT.glob("*.py"))
    assert len(roots) > 30
    assert forbidden_chains(roots) == []


def test_the_scanner_finds_what_it_looks_for() -> None:
    """A torch import is found at the top, in a class, under try or through a first-party module; one in a function
    body or under TYPE_CHECKING (neither runs on import) is not."""
    for source in ("import torch.nn", "from torch import nn", "class A:\n    import numpy",
                   "try:\n    import torch\nexcept ImportError:\n    pass",
                   "import pytest\npytest.importorskip('safetensors')"):
        assert imported_on_import(source) & FORBIDDEN, source
    for source in ("def f():\n    import torch", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch"):
        assert not imported_on_import(source) & FORBIDDEN, source
    assert imported_on_import("from . import model", "trainer") >= {"trainer", "trainer.model"}
    assert "trainer.model -> torch" in forbidden_chains([REPO / "trainer" / "model.py"])
    trainer_tests = sorted((REPO / "tests" / "integration").glob("test_trainer_*.py"))
    assert any(c.endswith("-> torch") for c in forbidden_chains(trainer_tests))
