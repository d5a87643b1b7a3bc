"""The code's rooms (docs/layout.md): every import of every .py file, read with `ast`, goes to its
own room or a lower one; nothing imports train.py but the tests; and no installed module or
script inserts itself into sys.path (the packages are installed). tests/ may do both."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import ROOT

# Lowest first. A module is in the room of the longest prefix that names it.
ROOMS: dict[str, int] = {
    "base": 0,  # the ground: errors, atomic files, the knobs' rules, processes and devices
    "model": 1,
    "data": 1,
    "kernels": 1,
    "checkpointing": 2,  # saving, reading and restoring a run's checkpoints
    "recipe": 3,  # the trainer's plumbing
    "tasks": 4,  # the zero-shot evaluation tasks, beside the stages: both use the plumbing
    "opt": 4,  # the stages, which configure the plumbing
    "launch": 5,  # launching: torchrun's commands and stop, the sweep's callbacks, provenance
    "train": 6,  # the programs
    "sample": 6,
    "tools": 6,
    "measure": 7,  # benchmarks, ladders and reports, which run the programs
    "scripts": 8,  # the measuring commands' entry points
    "tests": 9,
    "helpers": 9,  # tests/helpers.py, as the tests import it
}


def module_name(path: Path) -> str:
    """`base/errors.py` -> base.errors; a package's __init__.py is the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> int | None:
    """The room of a module of the project; None for the standard library and other packages."""
    while module:
        if module in ROOMS:
            return ROOMS[module]
        module = module.rpartition(".")[0]
    return None


def imported(tree: ast.Module, name: str) -> list[tuple[int, str]]:
    """(line, module) of every import in the file of module `name`, lazy ones too; `from a import
    b` counts as a.b where b is a module, else as a."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(node.lineno, alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's own package, or above it
                base = ".".join([*name.split(".")[: -node.level], *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                file = ROOT / sub.replace(".", "/")
                is_module = file.with_suffix(".py").exists() or file.is_dir()
                found.add((node.lineno, sub if is_module else base))
    return sorted(found)


def path_edits(tree: ast.Module) -> list[int]:
    """Lines that change sys.path: sys.path.insert/append/extend(...), or assign to it."""

    def is_sys_path(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys"
        )  # fmt: skip

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("insert", "append", "extend") and is_sys_path(node.func.value):
                lines.append(node.lineno)
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_sys_path(t) for t in targets):
                lines.append(node.lineno)
    return lines


def violations(path: Path, source: str) -> list[str]:
    """What the file does against the rules at the top, one line each."""
    name = module_name(path)
    own = room(name)
    where = path.relative_to(ROOT)
    if own is None or own == ROOMS["tests"]:
        return []
    tree = ast.parse(source, filename=str(path))
    found = []
    for line, module in imported(tree, name):
        target = room(module)
        if target is not None and target > own:
            found.append(f"{where}:{line}: imports {module} (room {target}) from room {own}")
        elif module.split(".")[0] == "train" and name != "train":
            found.append(f"{where}:{line}: imports train.py: move what it shares to a lower room")
    found += [f"{where}:{line}: changes sys.path" for line in path_edits(tree)]
    return found


def python_files() -> list[Path]:
    """Every .py file of the project, hidden folders (.git, .venv-ci, .ci) aside."""
    return [
        p for p in sorted(ROOT.rglob("*.py"))
        if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
    ]  # fmt: skip


def test_every_import_goes_to_its_own_room_or_a_lower_one() -> None:
    files = python_files()
    expected = {"train", "sample", "tools.evaluate", "base.errors", "launch.torchrun"}
    assert expected <= {module_name(p) for p in files}
    unplaced = [str(p.relative_to(ROOT)) for p in files if room(module_name(p)) is None]
    assert not unplaced, f"files in no room: add their folder to ROOMS: {unplaced}"
    found = [v for p in files for v in violations(p, p.read_text(encoding="utf-8"))]
    assert not found, "\n".join(found)


def test_every_room_s_package_is_installed_and_type_checked() -> None:
    """A room's package missing from pyproject would import from the checkout and fail once
    installed (`python -m launch.torchrun` from elsewhere), unchecked by mypy, sorted as
    third-party."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    packages = {n for n in ROOMS if "." not in n and (ROOT / n / "__init__.py").exists()}
    assert "launch" in packages
    for listed in (
        project["tool"]["setuptools"]["packages"],
        project["tool"]["mypy"]["files"],
        project["tool"]["ruff"]["lint"]["isort"]["known-first-party"],
    ):
        assert packages <= set(listed), sorted(packages - set(listed))


@pytest.mark.parametrize(
    "path,source,expected",
    [
        ("data/x.py", "from recipe import config\n", "imports recipe.config (room 3)"),
        ("data/x.py", "from base.errors import ConfigError\n", None),
        ("recipe/x.py", "def f():\n    import opt.amp\n", "imports opt.amp (room 4)"),
        ("recipe/x.py", "from . import generate\n", None),
        ("checkpointing/x.py", "from recipe import runstate\n", "imports recipe.runstate (room 3)"),
        ("recipe/x.py", "from checkpointing import read\n", None),
        ("base/errors.py", "from data import integrity\n", "imports data.integrity (room 1)"),
        ("tools/x.py", "from train import evaluate\n", "imports train.py"),
        ("opt/x.py", "from measure import ablate\n", "imports measure.ablate (room 7)"),
        ("measure/x.py", "from tools import loading\n", None),
        ("measure/x.py", "import scripts.ablate\n", "imports scripts.ablate (room 8)"),
        ("opt/x.py", "from launch.torchrun import torchrun\n", "imports launch.torchrun (room 5)"),
        ("launch/x.py", "from tools import generate\n", "imports tools.generate (room 6)"),
        ("train.py", "from launch import torchrun\n", None),
        ("measure/x.py", "import sys\nsys.path.insert(0, '.')\n", "changes sys.path"),
        ("scripts/x.py", "import sys\nsys.path += ['.']\n", "changes sys.path"),
        ("tests/x.py", "import sys\nfrom train import train\nsys.path.append('.')\n", None),
    ],
)  # fmt: skip
def test_the_check_sees_an_upward_import_and_a_sys_path_edit(path, source, expected) -> None:
    """The check itself, on files written here: it would fail on the old recipe/tools.py
    (opt.amp), scripts/evaluate.py (train) and the scripts' sys.path.insert."""
    found = violations(ROOT / path, source)
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and expected in found[0], found


def imported_test_modules(path: Path, source: str) -> list[str]:
    """The test modules that the file imports, and conftest (whose fixtures pytest hands out),
    lazy imports too, one line each."""
    where = path.relative_to(ROOT)
    tree = ast.parse(source, filename=str(path))
    return [
        f"{where}:{line}: imports {module}: move what it shares to tests/helpers.py"
        for line, module in imported(tree, module_name(path))
        if any(part.startswith("test_") or part == "conftest" for part in module.split("."))
    ]


def test_no_test_module_imports_another() -> None:
    """The tests share helpers through one module, tests/helpers.py: no test module imports
    another, nor conftest (which would also run the imported module's import-time code, and tie
    the two)."""
    files = sorted((ROOT / "tests").rglob("test_*.py"))  # each kind's folder
    assert ROOT / "tests/docs/test_structure.py" in files
    found = [v for p in files for v in imported_test_modules(p, p.read_text(encoding="utf-8"))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "source,expected",
    [
        ("from test_tp import torchrun_output\n", "imports test_tp:"),
        ("def f():\n    from test_distributed import RUN\n", "imports test_distributed:"),
        ("import tests.test_tp\n", "imports tests.test_tp:"),
        ("from . import test_tp\n", "imports tests.distributed.test_tp:"),
        ("from conftest import ROOT\n", "imports conftest:"),
        ("import pytest\nfrom helpers import ROOT, torchrun_output\n", None),
    ],
)
def test_the_check_sees_a_test_module_imported(source, expected) -> None:
    found = imported_test_modules(ROOT / "tests/distributed/test_x.py", source)  # beside test_tp
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and expected in found[0], found
