"""scripts/check_torch_api.py: the torch APIs the project calls, checked against a torch tree's
sources. The installed torch must have every one of them; on a small fake torch tree the checker
must report a missing name and an unknown keyword by file:line, and a guarded use as guarded."""
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKER = ROOT / "scripts" / "check_torch_api.py"

FAKE_TORCH = {
    "version.py": "__version__ = '0.1.fake'\n",
    "__init__.py": """
        from torch import nn
        from torch._C import *

        def compile(model=None, *, mode=None): ...

        class _Ops:
            def __getattr__(self, name): ...

        ops = _Ops()
    """,
    "_C/__init__.pyi": "def randn(*size, dtype=None): ...\n",
    "nn/__init__.py": "from .modules import Linear\n",
    "nn/modules/__init__.py": "from .linear import *\n",
    "nn/modules/linear.py": """
        __all__ = ["Linear"]

        class Linear:
            def __init__(self, in_features, out_features, bias=True): ...
    """,
    "nn/functional.py": "def gelu(input, approximate='none'): ...\n",
}

PROJECT = """
    import torch
    import torch.nn.functional as F

    x = torch.randn(2, dtype=None)
    y = torch.compile(None, mode="max", fullgraph=True)
    z = torch.nn.Linear(2, 3, bias=False, device="cpu")
    F.gelu(x, approximate="tanh")
    F.rms_norm(x)
    if hasattr(F, "scaled_dot_product_attention"):
        F.scaled_dot_product_attention(x)
    try:
        from torch.nn.attention import sdpa_kernel
    except ImportError:
        sdpa_kernel = None
    torch.ops.mylib.op(x)


    def frobnicated():
        if not hasattr(torch, "frobnicate"):
            raise SystemExit("needs torch >= 9.0")
        return torch.frobnicate()
"""


def run_checker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKER), *args], capture_output=True, text=True,
                          timeout=120)


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())


def test_the_installed_torch_has_every_api_the_project_uses():
    result = run_checker()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "summary: 0 missing, 0 unknown keywords" in result.stdout, result.stdout


def test_missing_names_and_keywords_are_reported_by_line_and_guarded_uses_as_guarded(tmp_path):
    write_tree(tmp_path / "fake" / "torch", FAKE_TORCH)
    write_tree(tmp_path / "project", {"model.py": PROJECT})
    result = run_checker(str(tmp_path / "fake"), "--project", str(tmp_path / "project"),
                         "--verbose")
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    lines = {line.split("  ")[0] + " " + line.split("  ")[1].split(":")[0]: line
             for line in out.splitlines() if "  " in line}
    assert "model.py:8" in lines["MISSING torch.nn.functional.rms_norm"]
    assert "model.py:5" in lines["KEYWORD torch.compile(fullgraph=)"]
    assert "model.py:6" in lines["KEYWORD torch.nn.Linear(device=)"]
    assert "model.py:10 (hasattr/getattr at line 9)" in lines[
        "GUARDED torch.nn.functional.scaled_dot_product_attention"]
    assert "model.py:12 (try/except at line 11)" in lines["GUARDED torch.nn.attention.sdpa_kernel"]
    assert "model.py:21" in lines["GUARDED torch.frobnicate"]  # after `if not hasattr: raise`
    assert "torch.ops.mylib.op" in lines["unresolved torch.ops.mylib.op"]
    for fine in ("torch.randn", "torch.nn.functional.gelu", "mode="):
        assert fine not in out.replace("torch 0.1.fake", "")
    assert out.splitlines()[-1] == ("summary: 1 missing, 2 unknown keywords, 3 guarded; "
                                    "unresolved: 1 names, 0 signatures")
