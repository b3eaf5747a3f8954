"""The package: pyproject.toml lists every module and package of the tree, every library the
code imports is in its dependencies or in the optional group of the feature that needs it, and
requirements.txt (what CI and the README install) is exactly all of it, with the same floors.
A feature whose group is not installed says so in one line."""
from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
NAME = PROJECT["name"]
REQUIREMENT = re.compile(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*(>=\s*[0-9][0-9.]*)?\s*$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def floors(requirements: list[str]) -> dict[str, str]:
    """{'torch': '2.9', ...}: each requirement's lower bound ('' for none); the highest wins."""
    out: dict[str, str] = {}
    for line in requirements:
        match = REQUIREMENT.match(line.split("#")[0].strip())
        assert match, f"not a plain 'name>=version' requirement: {line!r}"
        name, bound = canonical(match[1]), (match[2] or "").removeprefix(">=").strip()
        version = tuple(int(p) for p in bound.split(".")) if bound else ()
        if name not in out or version > tuple(int(p) for p in out[name].split(".") if p):
            out[name] = bound
    return out


def groups() -> dict[str, dict[str, str]]:
    """'base' and every optional group -> its floors, self-references (NAME[...]) left out."""
    found = {"base": floors(PROJECT["dependencies"])}
    for group, items in PROJECT["optional-dependencies"].items():
        found[group] = floors([r for r in items if not r.startswith(NAME)])
    return found


def test_requirements_txt_is_every_group_with_the_same_floors():
    lines = [line for line in (ROOT / "requirements.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    everything = floors([r for g in groups().values() for r in (f"{n}>={v}" if v else n
                                                                for n, v in g.items())])
    assert floors(lines) == everything
    assert PROJECT["requires-python"] == ">=3.11"  # tomllib
    test_group = PROJECT["optional-dependencies"]["test"]
    assert f"{NAME}[serve,hf,data,tokenizer,wandb,quant]" in test_group  # every feature, tested


def test_every_module_and_package_of_the_tree_is_in_the_package():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(setuptools["py-modules"]) == sorted(p.stem for p in ROOT.glob("*.py"))
    packages = sorted(str(p.parent.relative_to(ROOT)).replace("/", ".")
                      for p in ROOT.glob("*/**/__init__.py") if not outside_the_project(p))
    # packages are found, not listed: a new dataset (data/NAME/) or engine package is included
    include = setuptools["packages"]["find"]["include"]
    assert [p for p in packages if not any(fnmatch.fnmatchcase(p, i) for i in include)] == []
    assert {"data.shakespeare_char", "engine.training", "engine.inference"} <= set(packages)
    for package, files in setuptools["package-data"].items():
        assert all((ROOT / package.replace(".", "/") / f).is_file() for f in files), package


def outside_the_project(path: Path) -> bool:
    """tests/, or a virtual environment or other hidden folder made inside the clone (.venv/)."""
    parts = path.relative_to(ROOT).parts
    return "tests" in parts or "site-packages" in parts or any(p.startswith(".") for p in parts)


def imported_modules(paths: list[Path]) -> set[str]:
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


# outside engines bench.py measures against, each imported only by its worker script, which the
# engine's own virtual environment runs: yardsticks, never dependencies
OUTSIDE_ENGINES = {"llama_cpp": "scripts/llama_decode.py"}


def distributions_of(paths: list[Path]) -> dict[str, str]:
    """{distribution: the module imported} for every third-party import in these files."""
    local = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if p.is_dir()}
    local |= {p.stem for p in [*(ROOT / "tests").glob("*.py"), *(ROOT / "scripts").glob("*.py")]}
    by_module = importlib.metadata.packages_distributions()
    found = {}
    for module, worker in OUTSIDE_ENGINES.items():
        users = [p for p in paths if module in imported_modules([p])]
        assert users in ([], [ROOT / worker]), f"{module} is imported outside {worker}: {users}"
    outside = set(OUTSIDE_ENGINES)
    for module in imported_modules(paths) - set(sys.stdlib_module_names) - local - outside:
        assert module in by_module, f"{module} is imported but no installed distribution has it"
        found.update({canonical(d): module for d in by_module[module]})
    return found


def test_every_imported_library_is_declared():
    source = [*ROOT.glob("*.py"), *ROOT.glob("engine/**/*.py"), *ROOT.glob("data/**/*.py"),
              *ROOT.glob("scripts/*.py")]
    declared = set().union(*groups().values())
    used = distributions_of(source)
    assert {d: m for d, m in used.items() if d not in declared} == {}
    tests = distributions_of(list((ROOT / "tests").glob("*.py")))
    test_group = set(groups()["test"]) | declared
    assert {d: m for d, m in tests.items() if d not in test_group} == {}



def test_a_missing_optional_group_is_one_line_naming_it(monkeypatch, capsys):
    import serve
    from data import stream
    from data.dataset import DataError
    from engine import hf
    for name in ("huggingface_hub", "transformers", "datasets", "fastapi"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    with pytest.raises(hf.GPT2WeightsError, match=r"needs huggingface_hub: pip install "
                       r"huggingface_hub \(pyproject.toml's hf group\)"):
        hf.fetch("gpt2")
    with pytest.raises(hf.GPT2WeightsError, match="needs transformers: .* hf group"):
        hf.verify(None, Path("."))
    with pytest.raises(DataError, match="needs Hugging Face datasets: .* data group"):
        stream.open_stream(stream.Source(dataset="somewhere"))
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "fastapi" else object())
    assert serve.main(["--checkpoint", "nowhere"]) == 2
    assert capsys.readouterr().err == ('error: serve.py needs fastapi: pip install fastapi '
                                       '(or pip install -e ".[serve]")\n')
