"""The package's layout is its architecture: capabilities over a shared layer, imports pointing down.

Layers, top to bottom: the command line (``cli``) and the facade (``raytrain_mp/__init__``); the
capabilities (``ddp``, ``pipeline``, ``tune``, ``bench``); the shared layer (top-level modules and
the ``data`` package). A capability uses another only where it builds on it, and its package
docstring says so. Every import is checked, function-local ones included, and none closes a cycle.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "raytrain_mp"

SHARED_MODULES = {
    "allocator",
    "bn_momentum",
    "checkpointing",
    "cluster",
    "compilation",
    "compile_options",
    "config",
    "ema",
    "epochs",
    "errors",
    "fault_injection",
    "faults",
    "finetune",
    "interruption",
    "lr_schedule",
    "model_names",
    "memory_format",
    "models",
    "niceness",
    "optim",
    "precision",
    "plots",
    "preprocessing",
    "pretrained",
    "progress",
    "ray_logs",
    "readable",
    "run_log",
    "storage",
    "tracking",
    "tracking_options",
    "train_logs",
    "views",
    "watchdog",
}
CAPABILITIES = {"ddp", "pipeline", "tune", "bench", "inference"}
# What each unit may import besides itself. "shared" is the top-level shared modules.
ALLOWED = {
    "shared": {"shared"},
    "data": {"shared"},
    "ddp": {"shared", "data"},
    "pipeline": {"shared", "data"},
    "tune": {"shared", "data", "ddp"},
    "bench": {"shared", "data", "ddp", "pipeline"},
    "inference": {"shared", "data", "ddp", "tune"},
    "cli": {"shared", "data", *CAPABILITIES},
}


def unit_of(module: str) -> str:
    """The layout unit of a dotted module name inside raytrain_mp."""
    parts = module.split(".")
    assert parts[0] == "raytrain_mp", module
    if len(parts) == 1:
        return "facade"
    head = parts[1]
    if head in CAPABILITIES or head == "data":
        return head
    if head in ("cli", "api"):  # the two entry points: the command line and Python's
        return "cli"
    return "shared"


def imported_modules(source: str) -> set[str]:
    """Every raytrain_mp module a source file imports (``from raytrain_mp.x import y`` counts as x,
    and as x.y when that is a module: the import would load it)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "raytrain_mp"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "raytrain_mp":
                continue
            found.add(node.module)
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                if module_path(candidate) is not None:
                    found.add(candidate)
    return found


def module_path(module: str) -> Path | None:
    rel = Path(*module.split(".")[1:])
    for path in (PACKAGE / rel.with_suffix(".py"), PACKAGE / rel / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def violations(module: str, source: str) -> list[str]:
    unit = unit_of(module)
    if unit == "facade":
        return []
    found = []
    for target in sorted(imported_modules(source)):
        target_unit = unit_of(target)
        if target_unit != unit and target_unit not in ALLOWED[unit]:
            found.append(f"{module} ({unit}) imports {target} ({target_unit})")
    return found


def import_graph() -> dict[str, set[str]]:
    """Each raytrain_mp module -> the raytrain_mp modules it imports (``imported_modules``)."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        graph[module] = imported_modules(path.read_text()) - {module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph``, each as its path from the module it starts at back to that module:
    one for each back edge of a depth-first search, so none exactly when the graph has no cycle."""
    cycles: list[list[str]] = []
    path: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> None:
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if target in path:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in done:
                visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return cycles


def test_the_folder_shows_the_capabilities():
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert packages == CAPABILITIES | {"data"}
    assert modules == SHARED_MODULES | {"cli", "api"}


def test_no_module_imports_from_a_higher_layer():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        problems += violations(module_name(path), path.read_text())
    assert problems == []


@pytest.mark.parametrize(
    "module, source, expected",
    [
        ("raytrain_mp.models", "from raytrain_mp.ddp.sync_batchnorm import convert_sync_batchnorm", 1),
        (
            "raytrain_mp.data.dataset",
            "def f():\n    from raytrain_mp.cluster import x\n    import raytrain_mp.pipeline.run",
            1,
        ),
        ("raytrain_mp.ddp.loop", "from raytrain_mp.pipeline import schedule", 2),
        ("raytrain_mp.pipeline.run", "from raytrain_mp import tune", 2),  # the facade and tune
        (
            "raytrain_mp.tune.sweep",
            "from raytrain_mp.ddp.trainer import build_trainer\nfrom raytrain_mp.data import read_meta",
            0,
        ),
        ("raytrain_mp.config", "from raytrain_mp.cli import main", 1),
    ],
)
def test_the_import_check_catches_upward_and_sideways_imports(module, source, expected):
    assert len(violations(module, source)) == expected, violations(module, source)


def test_no_import_cycles_also_through_function_local_imports():
    cycles = import_cycles(import_graph())
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize(
    "sources, expected",
    [
        ({"a": "from raytrain_mp.b import f", "b": "def g():\n    from raytrain_mp.a import h"}, [["a", "b", "a"]]),
        (
            {"a": "import raytrain_mp.b", "b": "import raytrain_mp.c", "c": "from raytrain_mp.a import x"},
            [["a", "b", "c", "a"]],
        ),
        ({"a": "import raytrain_mp.b\nimport raytrain_mp.c", "b": "import raytrain_mp.c", "c": ""}, []),
    ],
)
def test_the_cycle_check_names_each_cycle(sources, expected):
    graph = {f"raytrain_mp.{name}": imported_modules(source) for name, source in sources.items()}
    assert import_cycles(graph) == [[f"raytrain_mp.{name}" for name in cycle] for cycle in expected]


@pytest.mark.parametrize("package", sorted(CAPABILITIES | {"data"}))
def test_each_package_says_its_job_and_what_it_may_import(package):
    doc = importlib.import_module(f"raytrain_mp.{package}").__doc__
    assert doc and "May import:" in doc
    for other in sorted(ALLOWED[package] & CAPABILITIES):
        assert f"raytrain_mp.{other}" in doc.split("May import:")[1], (package, other)


MAX_MODULE_LINES = 450  # DESIGN.md's Layout: no module over ~450 lines


def test_no_module_is_over_450_lines():
    long = {
        str(p.relative_to(PACKAGE)): lines
        for p in sorted(PACKAGE.rglob("*.py"))
        if (lines := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_every_module_starts_with_a_docstring():
    missing = [
        str(p.relative_to(PACKAGE))
        for p in sorted(PACKAGE.rglob("*.py"))
        if not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert missing == []


def test_public_names_import_from_the_top_without_loading_torch_or_ray():
    code = (
        "import sys, raytrain_mp\n"
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules\n"
        "from raytrain_mp import PipelineTrainer, convert_sync_batchnorm, scaled_lr\n"
        "print(PipelineTrainer.__name__, convert_sync_batchnorm.__name__, scaled_lr(0.1, 512))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["PipelineTrainer", "convert_sync_batchnorm", "0.2"]
