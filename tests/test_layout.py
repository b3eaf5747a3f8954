"""The shape docs/layout.md promises: short functions, scripts that nothing imports, and an
import graph without cycles among the project's own modules."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"bench", "generate", "load_gpt2_weights", "prune", "serve", "train"}
LONGEST_FUNCTION = 60  # lines, from the def to its last line


def sources() -> dict[str, Path]:
    """{dotted module name: path} for every project module outside tests/."""
    paths = [*ROOT.glob("*.py"), *ROOT.glob("engine/**/*.py"), *ROOT.glob("data/**/*.py"),
             *ROOT.glob("scripts/*.py")]
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in paths}


def top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports when it is imported (not inside functions)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def test_no_function_is_longer_than_60_lines():
    long = []
    for name, path in sources().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, long


def test_scripts_import_the_package_never_each_other():
    modules = sources()
    for name, path in modules.items():
        imported = top_level_imports(path, set(modules)) & SCRIPTS
        assert not imported, f"{name} imports the script(s) {sorted(imported)}"


def test_the_project_imports_form_no_cycle():
    modules = sources()
    graph = {name: top_level_imports(path, set(modules)) - {name}
             for name, path in modules.items()}
    done, active = set(), []

    def visit(name: str) -> None:
        if name in active:
            raise AssertionError("import cycle: " + " -> ".join(active[active.index(name):]
                                                                + [name]))
        if name in done:
            return
        active.append(name)
        for imported in sorted(graph[name]):
            visit(imported)
        active.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
