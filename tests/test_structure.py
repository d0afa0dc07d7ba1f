"""The package's shape, as docs/architecture.md states it: layers as folders,
a small root, short modules, no import circles, no reaching into another
package's private modules. Read from the source files (ast), so a rule
broken anywhere fails here with the module and the import named."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tensorferry

PACKAGE = Path(tensorferry.__file__).resolve().parent
# What a user imports by name or runs; everything else lives in a layer's folder.
ROOT_MODULES_MAX = 8
MODULE_LINES_MAX = 500
LAYERS = ("wire", "memory", "tensors", "copy", "plans", "execution", "transports", "ray", "vllm", "monitor", "cli")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package), for every .py module and every C/C++ extension source."""
    out: dict[str, tuple[Path, bool]] = {}
    for path in PACKAGE.rglob("*"):
        if path.suffix not in (".py", ".c", ".cpp") or "__pycache__" in path.parts:
            continue
        parts = ["tensorferry", *path.relative_to(PACKAGE).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


MODULES = _modules()


def _imports(name: str, path: Path, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) for every tensorferry import in ``path``, inside functions
    too, leaving out what runs only under ``TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for body in node.body for n in ast.walk(body))
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "tensorferry"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != "tensorferry":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if sub in MODULES else base))
    return [(line, target) for line, target in found if target in MODULES]


def _graph() -> dict[str, set[str]]:
    """Module -> the modules importing it runs: the target and every package
    above it that the importer is not inside of."""
    edges: dict[str, set[str]] = {}
    for name, (path, is_package) in MODULES.items():
        if path.suffix != ".py":
            continue
        targets = edges.setdefault(name, set())
        for _, target in _imports(name, path, is_package):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                above = ".".join(parts[:i])
                if above in MODULES and above != name and not name.startswith(above + "."):
                    targets.add(above)
    return edges


def test_the_root_holds_only_what_users_import_or_run():
    root = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(root) <= ROOT_MODULES_MAX, root
    assert not list(PACKAGE.glob("*.c")) and not list(PACKAGE.glob("*.cpp")), "C sources sit with the layer that loads them"
    for layer in LAYERS:
        init = PACKAGE / layer / "__init__.py"
        assert init.is_file(), f"{layer}/ is a package"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "import" in doc, f"{layer}/__init__.py opens with what the layer owns and what it may import"


def test_no_library_module_is_over_500_lines():
    long = {name: n for name, (path, _) in MODULES.items() if path.suffix == ".py"
            and (n := len(path.read_text().splitlines())) > MODULE_LINES_MAX}
    assert not long, long


def test_no_module_imports_another_packages_private_module():
    bad = []
    for name, (path, is_package) in MODULES.items():
        if path.suffix != ".py":
            continue
        for line, target in _imports(name, path, is_package):
            owner, _, last = target.rpartition(".")
            private = last.startswith("_") and not last.startswith("__")
            if private and owner != "tensorferry" and name != owner and not name.startswith(owner + "."):
                bad.append(f"{path.relative_to(PACKAGE)}:{line} imports {target}")
    assert not bad, "export what is shared from the package's __init__:\n" + "\n".join(bad)


def test_no_import_circle():
    edges = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in edges:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_checks_see_a_circle_and_a_private_import():
    """The rules above can fail: a module pair importing each other is found."""
    edges = _graph()
    assert "tensorferry.wire" in edges["tensorferry.memory._pool"]
    assert "tensorferry.errors" in edges["tensorferry.wire._layout"]
    # execution imports plans; were plans to import execution, that is a circle.
    assert "tensorferry.plans" in edges["tensorferry.execution._put"]


def test_importing_the_package_or_the_monitor_does_not_import_torch():
    code = ("import sys, tensorferry, tensorferry.monitor, tensorferry.errors; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('tensorferry'))")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_public_name_is_importable_from_its_package():
    import importlib

    for package in ("tensorferry", "tensorferry.ray", "tensorferry.monitor", "tensorferry.transports", "tensorferry.plans"):
        module = importlib.import_module(package)
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{package}.{name}"


def test_no_benchmark_file_is_over_600_lines():
    """The benchmarks are a suite: what they repeat lives in their harness
    (benchmarks/_harness.py, _common.py), and no file grows past 600 lines."""
    benchmarks = PACKAGE.parents[1] / "benchmarks"
    if not benchmarks.is_dir():  # an installed package, not a checkout
        import pytest

        pytest.skip(f"no benchmarks/ beside {PACKAGE.parent}: not a checkout")
    long = {p.name: n for p in benchmarks.glob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
