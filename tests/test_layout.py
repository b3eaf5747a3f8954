"""The shape docs/layout.md promises: short functions, scripts that nothing imports, an import
graph without cycles among the project's own modules (imports inside functions included), and
runs that load only the code of the options they use."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"bench", "eval", "generate", "load_gpt2_weights", "prune", "serve", "train"}
LONGEST_FUNCTION = 60  # lines, from the def to its last line
# what the default runs may load, in lines of the project's own files (docs/layout.md)
TRAIN_LINES, GENERATE_LINES, MODEL_LINES = 3600, 2530, 450
# modules a default run must not load: each belongs to an option the default leaves off
NOT_FOR_TRAINING = ("engine.inference", "engine.serving", "engine.benchmarks", "engine.hf",
                    "engine.hellaswag", "engine.pruning", "engine.compiling", "engine.loading",
                    "engine.training.parallel", "engine.training.auto_batch",
                    "engine.training.recompute", "engine.training.chunked_loss",
                    "engine.training.master_weights", "engine.training.polar_express",
                    "engine.training.wandb_log", "engine.training.restore",
                    "engine.training.init_from", "data.loader_workers", "data.shard_batches",
                    "engine.training.finetune", "engine.vocab", "data.instruct",
                    "data.chat_template", "data.instruct_tasks", "engine.lora",
                    "engine.merge_lora", "data.mixture", "data.doc_batches")
NOT_FOR_GENERATION = ("engine.training", "engine.serving", "engine.benchmarks", "engine.hf",
                      "engine.hellaswag", "engine.pruning", "engine.compiling",
                      "engine.inference.packed", "engine.inference.cpu_kernels",
                      "engine.inference.quantize", "engine.inference.sparse", "data.loader",
                      "data.instruct", "data.chat_template", "engine.vocab", "engine.lora",
                      "engine.inference.chat")


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


def outside(loaded: dict[str, int], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden))


def test_default_training_and_generation_load_only_what_they_use(char_dataset, tmp_path):
    """python train.py (the default config, a few steps), then python generate.py from its
    checkpoint: neither loads the code of an option it leaves off, and each stays within the
    lines docs/layout.md states."""
    run = ["--max_iters=2", "--eval_interval=1", "--eval_iters=1", f"--dataset={char_dataset}",
           f"--out_dir={tmp_path / 'run'}", "--threads=1", "--device=cpu"]
    training = loaded_by("train.py", *run)
    assert outside(training, NOT_FOR_TRAINING) == []
    assert {"model", "engine.training.step", "engine.training.muon"} <= set(training)
    assert sum(training.values()) <= TRAIN_LINES, training
    generation = loaded_by("generate.py", "--checkpoint", str(tmp_path / "run"),
                           "--max_new_tokens=4", "--threads=1")
    assert outside(generation, NOT_FOR_GENERATION) == []
    assert {"engine.inference.sampling", "engine.inference.kv_cache"} <= set(generation)
    assert sum(generation.values()) <= GENERATE_LINES, generation


def test_each_option_loads_its_own_module(char_dataset, tmp_path):
    """The modules a default run leaves out come in when their option is on."""
    loaded = loaded_by("train.py", "--config", "tiny", "--max_iters=2", "--eval_interval=2",
                       "--eval_iters=1", f"--dataset={char_dataset}",
                       f"--out_dir={tmp_path / 'run'}", "--threads=1", "--device=cpu",
                       "--activation_checkpointing=all", "--loss=chunked", "--dtype=bfloat16",
                       "--weights_dtype=bfloat16", "--optimizer=muon",
                       "--muon_ns_coefficients=polar_express", "--loader_workers=1")
    assert {"engine.training.recompute", "engine.training.chunked_loss",
            "engine.training.master_weights", "engine.training.polar_express",
            "data.loader_workers"} <= set(loaded)
