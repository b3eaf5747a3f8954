"""The shape docs/layout.md promises: short functions, scripts that nothing imports, an import
graph without cycles among the project's own modules (imports inside functions included), and
runs that load only the code of the options they use."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"bench", "eval", "generate", "load_gpt2_weights", "prune", "serve", "train"}
LONGEST_FUNCTION = 60  # lines, from the def to its last line
MODEL_LINES = 450  # model.py, read in one sitting
# docs/layout.md's tables of the modules each run loads: this file holds them to the truth
LAYOUT = ROOT / "docs" / "layout.md"


def sources() -> dict[str, Path]:
    """{dotted module name: path} for every project module outside tests/."""
    paths = [*ROOT.glob("*.py"), *ROOT.glob("engine/**/*.py"), *ROOT.glob("data/**/*.py"),
             *ROOT.glob("scripts/*.py")]
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in paths}


def imports(path: Path, modules: set[str], inside_functions: bool = True) -> set[str]:
    """The project modules `path` imports: at its top level, and (inside_functions) in its
    functions and methods too."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if inside_functions else tree.body
    found = set()
    for node in nodes:
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
        imported = imports(path, set(modules)) & SCRIPTS
        assert not imported, f"{name} imports the script(s) {sorted(imported)}"


def test_the_project_imports_form_no_cycle_even_inside_functions():
    modules = sources()
    graph = {name: imports(path, set(modules)) - {name} for name, path in modules.items()}
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


def test_model_py_stays_readable_in_one_sitting():
    assert len((ROOT / "model.py").read_text().splitlines()) <= MODEL_LINES


# runs a script as `python script.py ...` would, then prints the project's modules it loaded
PROBE = textwrap.dedent("""
    import atexit, json, os, pathlib, runpy, sys
    root = pathlib.Path.cwd().resolve()
    def report():
        loaded = {}
        for name, module in list(sys.modules.items()):
            path = getattr(module, "__file__", None)
            if path and os.path.isabs(path) and pathlib.Path(path).resolve().is_relative_to(root) \
                    and "site-packages" not in pathlib.Path(path).parts:  # a venv in the clone
                loaded[name] = len(pathlib.Path(path).read_text().splitlines())
        loaded["torch loaded"] = int("torch" in sys.modules)
        print("LOADED " + json.dumps(loaded), file=sys.stderr)
    atexit.register(report)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, str(root))
    runpy.run_path(script, run_name="__main__")
""")


def loaded_by(*argv: str) -> dict[str, int]:
    """{module: its lines} of the project's modules a script run in a fresh process loaded."""
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stderr.splitlines() if line.startswith("LOADED "))
    return json.loads(line.removeprefix("LOADED "))


def declared(section: str) -> dict[str, set[str]]:
    """docs/layout.md's table between <!-- section --> and <!-- /section -->: {its first cell,
    without backticks: the modules the second cell names}."""
    text = LAYOUT.read_text()
    body = text[text.index(f"<!-- {section} -->"):text.index(f"<!-- /{section} -->")]
    rows = [line.split("|")[1:3] for line in body.splitlines()[3:] if line.startswith("|")]
    return {key.strip().replace("`", ""): set(re.findall(r"`([\w.]+)`", cell))
            for key, cell in rows}


RUN = ["--max_iters=2", "--eval_interval=1", "--eval_iters=1", "--threads=1", "--device=cpu"]


def test_help_loads_no_torch_and_only_the_options_declarations():
    for script, modules in declared("loads").items():
        if script.endswith("--help"):
            argv = script.removeprefix("python ").split()
            loaded = loaded_by(*argv)
            assert loaded.pop("torch loaded") == 0, script
            assert set(loaded) == modules, (script, set(loaded) ^ modules)


def test_default_training_and_generation_load_what_docs_layout_md_says(char_dataset, tmp_path):
    """python train.py (the default config, a few steps), then python generate.py from its
    checkpoint: each loads exactly the modules docs/layout.md names for it."""
    runs = declared("loads")
    train = next(v for k, v in runs.items() if k.startswith("python train.py (the default"))
    generate = next(v for k, v in runs.items() if k.startswith("python generate.py (from"))
    training = loaded_by("train.py", *RUN, f"--dataset={char_dataset}",
                         f"--out_dir={tmp_path / 'run'}")
    assert set(training) - {"torch loaded"} == train, set(training) ^ train
    generation = loaded_by("generate.py", "--checkpoint", str(tmp_path / "run"),
                           "--max_new_tokens=4", "--threads=1")
    assert set(generation) - {"torch loaded"} == generate, set(generation) ^ generate


def test_each_option_loads_its_own_module(char_dataset, tmp_path):
    """The modules docs/layout.md says an option adds come in when it is on, and none of them
    is in the default run's set."""
    options = declared("option-loads")
    default = next(v for k, v in declared("loads").items() if k.startswith("python train.py ("))
    added = set().union(*options.values())
    assert not added & default
    loaded = loaded_by("train.py", "--config", "tiny", *RUN, f"--dataset={char_dataset}",
                       f"--out_dir={tmp_path / 'run'}", "--dtype=bfloat16", "--optimizer=muon",
                       *options)
    assert added <= set(loaded), added - set(loaded)


def tree_entries() -> set[str]:
    """The paths docs/layout.md's tree names: a name at the start of a line, under the folders
    named above it at less indentation."""
    text = LAYOUT.read_text()
    tree = text[text.index("<!-- layout-tree -->"):text.index("<!-- /layout-tree -->")]
    entries, folders = set(), {}
    for line in tree.splitlines():
        if m := re.match(r"^( {0,4})([\w.]+/?)\s", line + " "):
            depth = len(m.group(1)) // 2
            folders = {d: f for d, f in folders.items() if d < depth}
            path = "".join(folders[d] for d in sorted(folders)) + m.group(2)
            if path.endswith("/"):
                folders[depth] = m.group(2)
            entries.add(path)
    return entries


def test_docs_layout_md_names_every_module_and_only_modules_that_exist():
    """Each module of the root, engine/ and data/ has its line in the tree (a dataset's own
    package is data/NAME/; scripts/ is described as a folder), and each .py named exists."""
    entries = tree_entries()
    modules = {str(rel) for rel in (p.relative_to(ROOT) for p in sources().values())
               if rel.name != "__init__.py" and rel.parts[0] != "scripts"
               and not (rel.parts[0] == "data" and len(rel.parts) > 2)}
    assert modules - entries == set(), "add them to docs/layout.md's tree"
    assert {e for e in entries if e.endswith(".py") and not (ROOT / e).exists()} == set()
