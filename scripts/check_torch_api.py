"""Check the torch APIs this project uses against another torch version's Python sources, without
installing that version.

    python scripts/check_torch_api.py /tmp/torch211    # a folder holding torch/ (or torch/ itself)
    python scripts/check_torch_api.py                  # the installed torch (found, not imported)
    python scripts/check_torch_api.py /tmp/torch29 --verbose --no-tests

Get a version's sources from its wheel without installing it:
    pip download torch==2.11.0 --no-deps --only-binary=:all: --python-version 3.12 \\
        --platform manylinux_2_28_x86_64 -d /tmp/wheels
    unzip -q /tmp/wheels/torch-2.11.0-*.whl 'torch/*.py' 'torch/*.pyi' -d /tmp/torch211

What it reads from the project (the root scripts, engine/, data/, scripts/ and tests/), with `ast`:
`import torch.x.y`, `from torch.x import y`, every attribute chain rooted at a name those imports
bind (torch.cuda.is_available, F.scaled_dot_product_attention, nn.LinearCrossEntropyOptions, a
name imported from torch and called), and the keyword arguments of each call. What it checks in
the tree: the module exists (.py or .pyi, a file or a package); the name is defined there or
re-exported (imports, `from x import *` chains, `__all__`, the .pyi stubs of C functions such as
torch/_C/_VariableFunctions.pyi); each keyword is a parameter of the function found (or of the
class's __init__, or a dataclass field; **kwargs accepts any, @overload stubs are united).

A use inside `try:` whose handlers catch ImportError / AttributeError / TypeError (or any
Exception), under an `if` that tests hasattr/getattr on it or a version, after an `if not
hasattr(...): raise/return`, or whose name the same file probes with hasattr/getattr, is reported
as GUARDED, not missing. What it cannot follow (attributes of values such as
torch.backends.cuda.matmul.allow_tf32, names a module makes at run time, signatures behind
wrappers) it counts as unresolved; --verbose lists them. It sees names and signatures only: a
changed default or a changed behaviour in C++ is invisible to it.
Exit status 1 when a name or keyword is missing (unguarded), else 0.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUARD_EXCEPTIONS = {"ImportError", "ModuleNotFoundError", "AttributeError", "TypeError",
                    "Exception", "BaseException"}
PLAIN_BASES = {"object"}  # bases whose attributes a project never reaches through torch


@dataclass
class Binding:
    """What a name is bound to in a torch module: a def, a class, a module, an import to
    follow, or some other value (node: the value expression, if any)."""
    kind: str  # "def" | "class" | "module" | "import" | "value" | "external"
    module: Module | None = None
    node: ast.AST | None = None
    target: tuple[str, str | None] | None = None  # import: (module, name or None)


@dataclass
class Module:
    """One torch module as its .py and .pyi sources bind it at their top level."""
    name: str
    files: list[Path]
    is_package: bool
    bindings: dict[str, list[Binding]] = field(default_factory=dict)
    stars: list[str] = field(default_factory=list)
    all_names: set[str] = field(default_factory=set)
    dynamic: bool = False  # a module __getattr__ that can make any name


@dataclass
class Found:
    """The outcome of resolving a dotted name: status "ok" | "missing" | "unresolved"."""
    status: str
    bindings: list[Binding] = field(default_factory=list)
    reason: str = ""


class TorchTree:
    """The torch package as source: modules parsed on demand, names looked up statically."""

    def __init__(self, root: Path):
        self.root = root
        self.modules: dict[str, Module | None] = {}
        self._exported: dict[str, set[str]] = {}

    def version(self) -> str:
        path = self.root / "torch" / "version.py"
        for line in path.read_text().splitlines() if path.exists() else []:
            if line.startswith("__version__"):
                return line.split("=", 1)[1].strip().strip("'\"")
        return "unknown"

    def module(self, name: str) -> Module | None:
        if name not in self.modules:
            self.modules[name] = self._load(name)
        return self.modules[name]

    def _load(self, name: str) -> Module | None:
        base = self.root.joinpath(*name.split("."))
        package = [base / "__init__.pyi", base / "__init__.py"]
        plain = [base.with_suffix(".pyi"), base.with_suffix(".py")]
        files = [p for p in package if p.exists()] or [p for p in plain if p.exists()]
        if not files:
            return None
        module = Module(name, files, files[0].name.startswith("__init__"))
        for path in files:
            _collect_module(module, ast.parse(path.read_text(), str(path)))
        _read_module_getattr(module)
        return module

    def lookup(self, module: Module, name: str, seen: frozenset = frozenset()) -> Found:
        """`name` in `module`: its own bindings, star imports, __all__, or a submodule."""
        key = (module.name, name)
        if key in seen:
            return Found("unresolved", reason="import loop")
        seen = seen | {key}
        if name in module.bindings:
            return self.follow(module.bindings[name], seen)
        for star in module.stars:
            source = self.module(star)
            if source is not None and name in self.exported(source):
                return self.lookup(source, name, seen)
        sub = self.module(f"{module.name}.{name}")
        if sub is not None:
            return Found("ok", [Binding("module", sub)])
        if name in module.all_names:
            return Found("ok", [Binding("value", module)])
        if module.dynamic:
            return Found("unresolved", reason=f"{module.name} makes names in __getattr__")
        return Found("missing", reason=f"no '{name}' in {module.name}")

    def exported(self, module: Module, seen: frozenset = frozenset()) -> set[str]:
        """The names `from module import *` brings (permissive: __all__ and public names)."""
        if module.name in seen:
            return set()
        if module.name not in self._exported:
            names = {n for n in module.bindings if not n.startswith("_")} | module.all_names
            for star in module.stars:
                source = self.module(star)
                if source is not None:
                    names |= self.exported(source, seen | {module.name})
            self._exported[module.name] = names
        return self._exported[module.name]

    def follow(self, bindings: list[Binding], seen: frozenset) -> Found:
        """Imports and plain aliases followed to what they name."""
        out = []
        for binding in bindings:
            if binding.kind == "import":
                found = self._follow_import(binding, seen)
                if found.status != "ok":
                    return found
                out += found.bindings
            elif binding.kind == "value" and isinstance(_alias_of(binding.node),
                                                        (ast.Name, ast.Attribute)):
                found = self.resolve_expr(binding.module, _alias_of(binding.node), seen)
                out += found.bindings if found.status == "ok" else [binding]
            else:
                out.append(binding)
        return Found("ok", out)

    def _follow_import(self, binding: Binding, seen: frozenset) -> Found:
        source_name, name = binding.target
        source = self.module(source_name)
        if source is None:
            if source_name == "torch" or source_name.startswith("torch."):
                return Found("missing", reason=f"no module {source_name}")
            return Found("ok", [Binding("external")])
        sub = self.module(f"{source_name}.{name}") if name else source
        if sub is not None:  # `from torch import nn` inside torch: the submodule
            return Found("ok", [Binding("module", sub)])
        return self.lookup(source, name, seen)

    def resolve_expr(self, module: Module, node: ast.AST, seen: frozenset) -> Found:
        """A Name or attribute chain written inside a torch module, resolved in its scope."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return Found("unresolved", reason="not a name")
        found = self.lookup(module, node.id, seen)
        for part in reversed(parts):
            if found.status != "ok":
                return found
            found = self.attribute(found, part, seen)
        return found

    def resolve(self, dotted: str) -> Found:
        """A dotted name from the project (torch.nn.functional.gelu) resolved in the tree."""
        first, *rest = dotted.split(".")
        top = self.module(first)
        if top is None:
            return Found("missing", reason=f"no module {first}")
        found = Found("ok", [Binding("module", top)])
        for part in rest:
            found = self.attribute(found, part)
            if found.status != "ok":
                return found
        return found

    def attribute(self, found: Found, name: str, seen: frozenset = frozenset()) -> Found:
        """`name` looked up on what `found` holds: a module's name, a class's attribute."""
        binding = found.bindings[0]
        if binding.kind == "module":
            return self.lookup(binding.module, name, seen)
        if binding.kind == "external":
            return Found("ok", [binding])
        classes = [b for b in found.bindings if b.kind == "class"]
        if not classes:
            classes = self._class_of_instance(found.bindings, seen)
        if not classes:
            return Found("unresolved", reason=f"'{name}' is an attribute of a value")
        return self.class_attribute(classes[0], name, seen)

    def _class_of_instance(self, bindings: list[Binding], seen: frozenset) -> list[Binding]:
        """The class of a value made by calling one (`ops = _Ops()`), if the tree has it."""
        for binding in bindings:
            node = binding.node.value if isinstance(binding.node, ast.AnnAssign) else binding.node
            if binding.kind == "value" and isinstance(node, ast.Call):
                found = self.resolve_expr(binding.module, node.func, seen)
                if found.status == "ok":
                    return [b for b in found.bindings if b.kind == "class"]
        return []

    def class_attribute(self, cls: Binding, name: str, seen: frozenset) -> Found:
        """An attribute defined in a class body or in one of its bases found in the tree."""
        own = [b for n, b in _class_members(cls) if n == name]
        if own:
            return self.follow(own, seen)
        if any(n == "__getattr__" for n, _ in _class_members(cls)):
            return Found("unresolved", reason=f"{cls.node.name} makes attributes in __getattr__")
        unresolved = False
        for base in cls.node.bases:
            base = base.value if isinstance(base, ast.Subscript) else base
            if isinstance(base, ast.Name) and base.id in PLAIN_BASES:
                continue
            found = self.resolve_expr(cls.module, base, seen)
            classes = [b for b in found.bindings if b.kind == "class"]
            if found.status != "ok" or not classes:
                unresolved = True
                continue
            found = self.class_attribute(classes[0], name, seen | {(cls.module.name, name)})
            if found.status == "ok":
                return found
            unresolved = unresolved or found.status == "unresolved"
        if unresolved:
            return Found("unresolved", reason=f"'{name}' may come from {cls.node.name}'s bases")
        return Found("missing", reason=f"no '{name}' in class {cls.node.name}")

    def parameters(self, found: Found) -> tuple[set[str], bool] | None:
        """(keyword names, accepts any) of what `found` calls, or None if it cannot tell."""
        names, anything, known = set(), False, False
        for binding in found.bindings:
            signature = self._signature(binding)
            if signature is not None:
                known = True
                names |= signature[0]
                anything = anything or signature[1]
        return (names, anything) if known else None

    def _signature(self, binding: Binding) -> tuple[set[str], bool] | None:
        if binding.kind == "def":
            args = binding.node.args
            names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
            return names, args.kwarg is not None
        if binding.kind != "class":
            return None
        if _is_dataclass(binding.node):
            return self._dataclass_fields(binding), False
        signatures = []
        for method in ("__init__", "__new__"):
            found = self.class_attribute(binding, method, frozenset())
            if found.status == "ok":
                signatures.append(self.parameters(found))
        signatures = [s for s in signatures if s is not None]
        if not signatures:
            return None
        return set().union(*(s[0] for s in signatures)), any(s[1] for s in signatures)

    def _dataclass_fields(self, binding: Binding) -> set[str]:
        names = {n for n, b in _class_members(binding) if isinstance(b.node, ast.AnnAssign)}
        for base in binding.node.bases:
            found = self.resolve_expr(binding.module, base, frozenset())
            for parent in found.bindings:
                if parent.kind == "class" and _is_dataclass(parent.node):
                    names |= self._dataclass_fields(parent)
        return names


def _alias_of(node: ast.AST | None) -> ast.AST | None:
    """What a value names: itself, or fn for torch's `name = _add_docstr(fn, doc)`."""
    if (isinstance(node, ast.Call) and node.args and (_dotted(node.func) or [""])[-1]
            == "_add_docstr"):
        return node.args[0]
    return node


def _statements(body: list[ast.stmt]):
    """Every statement, into every block (defs and classes too), no expression."""
    for node in body:
        yield node
        for _, value in ast.iter_fields(node):
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                yield from _statements(value)
            elif isinstance(value, list) and value and isinstance(value[0], ast.excepthandler):
                for handler in value:
                    yield from _statements(handler.body)


def _module_statements(body: list[ast.stmt]):
    """A module's statements, into if/try/with/for blocks but not into defs or classes."""
    for node in body:
        yield node
        for block in ("body", "orelse", "finalbody"):
            if isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                yield from _module_statements(getattr(node, block, []))
        for handler in getattr(node, "handlers", []):
            yield from _module_statements(handler.body)


def _collect_module(module: Module, tree: ast.Module) -> None:
    """The names a module binds at its top level, its star imports and its __all__."""
    def bind(name: str, binding: Binding) -> None:
        binding.module = module
        module.bindings.setdefault(name, []).append(binding)

    for node in _module_statements(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            bind(node.name, Binding("def", node=node))
        elif isinstance(node, ast.ClassDef):
            bind(node.name, Binding("class", node=node))
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        bind(name.id, Binding("value", node=node.value))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                module.all_names |= _strings(node.value)
        elif isinstance(node, ast.Expr) and _is_all_extend(node.value):
            module.all_names |= _strings(node.value.args[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bind(alias.asname, Binding("import", target=(alias.name, None)))
                else:
                    top = alias.name.split(".")[0]
                    bind(top, Binding("import", target=(top, None)))
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for alias in node.names:
                if alias.name == "*":
                    module.stars.append(source)
                else:
                    bind(alias.asname or alias.name, Binding("import", target=(source, alias.name)))


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module
    package = module.name.split(".")
    if not module.is_package:
        package = package[:-1]
    package = package[:len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def _is_all_extend(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "extend" and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "__all__" and len(node.args) == 1)


def _strings(node: ast.AST | None) -> set[str]:
    """The string constants of a literal list/tuple/set/dict (a dict's keys)."""
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant)
                and isinstance(k.value, str)}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)
                and isinstance(e.value, str)}
    if isinstance(node, ast.BinOp):
        return _strings(node.left) | _strings(node.right)
    return set()


def _read_module_getattr(module: Module) -> None:
    """A module-level __getattr__ that looks names up in literal tables (torch's lazy
    submodules, its deprecated names) adds those names; any other makes the module dynamic."""
    defs = [b.node for b in module.bindings.get("__getattr__", []) if b.kind == "def"]
    for func in defs:
        tables = set()
        for node in ast.walk(func):
            if isinstance(node, ast.Name) and node.id in module.bindings:
                for binding in module.bindings[node.id]:
                    tables |= _strings(binding.node) if binding.kind == "value" else set()
        if tables and isinstance(func.body[-1], ast.Raise):
            module.all_names |= tables
        else:
            module.dynamic = True


def _class_members(cls: Binding):
    """(name, Binding) for what a class body defines, into its if blocks."""
    for node in _module_statements(cls.node.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, Binding("def", cls.module, node)
        elif isinstance(node, ast.ClassDef):
            yield node.name, Binding("class", cls.module, node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    yield target.id, Binding("value", cls.module, node if isinstance(
                        node, ast.AnnAssign) else node.value)


def _is_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        decorator = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = decorator.attr if isinstance(decorator, ast.Attribute) else getattr(
            decorator, "id", "")
        if name == "dataclass":
            return True
    return False


@dataclass
class Use:
    """One place the project names a torch API."""
    path: str
    line: int
    api: str
    keywords: list[str] = field(default_factory=list)
    guard: str = ""
    module_only: bool = False  # `import torch.x.y`: must be a module


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def _is_torch(name: str | None) -> bool:
    return name == "torch" or (name or "").startswith("torch.")


@dataclass(frozen=True)
class Guard:
    """Why uses in a block are guarded; api: only the uses of this API (and below it)."""
    reason: str
    api: str | None = None


def _reason(guards: tuple[Guard, ...], api: str) -> str:
    return next((g.reason for g in guards if g.api is None or _covers(g.api, api)), "")


class UseFinder:
    """The torch uses of one project file, each with the guard around it (if any)."""

    def __init__(self, path: str, tree: ast.Module):
        self.path, self.tree = path, tree
        self.aliases: dict[str, str] = {}
        self.uses: list[Use] = []
        self.probes: list[tuple[str, int]] = []
        self.flags = {node.targets[0].id: node.value for node in tree.body
                      if isinstance(node, ast.Assign) and len(node.targets) == 1
                      and isinstance(node.targets[0], ast.Name)}
        self._read_imports()

    def _read_imports(self) -> None:
        """The names torch imports bind anywhere in the file (one scope for the whole file)."""
        for node in _statements(self.tree.body):
            for bound, value, _ in self.imported(node):
                self.aliases[bound] = value

    def imported(self, node: ast.AST) -> list[tuple[str, str, Use]]:
        """(name bound, what it names, the use to check) for each torch name an import binds:
        `import torch.nn.functional` binds torch and needs the module torch.nn.functional."""
        if isinstance(node, ast.Import):
            return [(alias.asname or "torch", alias.name if alias.asname else "torch",
                     Use(self.path, node.lineno, alias.name, module_only=True))
                    for alias in node.names if _is_torch(alias.name)]
        if isinstance(node, ast.ImportFrom) and not node.level and _is_torch(node.module):
            return [(alias.asname or alias.name, f"{node.module}.{alias.name}",
                     Use(self.path, node.lineno, f"{node.module}.{alias.name}"))
                    for alias in node.names]
        return []

    def api(self, node: ast.AST) -> str | None:
        parts = _dotted(node)
        if parts and parts[0] in self.aliases:
            return ".".join([self.aliases[parts[0]]] + parts[1:])
        return None

    def find(self) -> list[Use]:
        self.visit_block(self.tree.body, ())
        for use in self.uses:
            probe = next((line for api, line in self.probes if _covers(api, use.api)), None)
            if not use.guard and probe is not None:
                use.guard = f"probed with hasattr/getattr at line {probe}"
        return self.uses

    def visit_block(self, body: list[ast.stmt], guards: tuple[Guard, ...]) -> None:
        """Statements in order; an `if not hasattr(...): raise` guards the ones after it."""
        for node in body:
            self.visit(node, guards)
            if isinstance(node, ast.If) and node.body and isinstance(
                    node.body[-1], (ast.Raise, ast.Return, ast.Continue, ast.Break)):
                guards = guards + self.if_guards(node.test, negated=True)

    def visit(self, node: ast.AST, guards: tuple[Guard, ...]) -> None:
        if isinstance(node, ast.Try):
            caught = [h for h in node.handlers if _catches(h)]
            inner = guards + ((Guard(f"try/except at line {node.lineno}"),) if caught else ())
            self.visit_block(node.body, inner)
            for block in [h.body for h in node.handlers] + [node.orelse, node.finalbody]:
                self.visit_block(block, guards)
        elif isinstance(node, (ast.If, ast.IfExp)):
            self.visit(node.test, guards)
            body, orelse = (node.body, node.orelse)
            self._visit_any(body, guards + self.if_guards(node.test, negated=False))
            self._visit_any(orelse, guards + self.if_guards(node.test, negated=True))
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
            for value in node.values:
                self.visit(value, guards)
                guards = guards + self.if_guards(value, negated=False)
        elif isinstance(node, (ast.Attribute, ast.Call)) and self.record(node, guards):
            return
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for _, _, use in self.imported(node):
                use.guard = _reason(guards, use.api)
                self.uses.append(use)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for decorator in node.decorator_list:
                self.visit(decorator, guards)
                if isinstance(decorator, ast.Call) and (_dotted(decorator.func) or [""])[-1] \
                        == "skipif" and decorator.args:  # pytest.mark.skipif(not HAS_X, ...)
                    guards = guards + self.if_guards(decorator.args[0], negated=True)
            for name, value in ast.iter_fields(node):  # bases, arguments, annotations, body
                if name != "decorator_list":
                    self._visit_any(value, guards)
        else:
            for _, value in ast.iter_fields(node):
                self._visit_any(value, guards)

    def _visit_any(self, value, guards: tuple[Guard, ...]) -> None:
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
            self.visit_block(value, guards)
        elif isinstance(value, list):
            for item in value:
                self._visit_any(item, guards)
        elif isinstance(value, ast.AST):
            self.visit(value, guards)

    def record(self, node: ast.AST, guards: tuple[Guard, ...]) -> bool:
        """A torch attribute chain or call recorded (True), its arguments visited."""
        if isinstance(node, ast.Call):
            probe = self.probe(node)
            if probe:
                self.probes.append((probe, node.lineno))
                self.uses.append(Use(self.path, node.lineno, probe, guard="the probe itself"))
            api = self.api(node.func)
            if api is None:
                return False
            keywords = [k.arg for k in node.keywords if k.arg]
            self.uses.append(Use(self.path, node.lineno, api, keywords, _reason(guards, api)))
            for child in node.args + [k.value for k in node.keywords]:
                self.visit(child, guards)
            return True
        api = self.api(node)
        if api is None:
            return False
        self.uses.append(Use(self.path, node.lineno, api, guard=_reason(guards, api)))
        return True

    def probe(self, node: ast.Call) -> str | None:
        """torch.x.y for hasattr(torch.x, "y") / getattr(torch.x, "y", ...)."""
        if not (isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            return None
        owner = self.api(node.args[0])
        return f"{owner}.{node.args[1].value}" if owner else None

    def if_guards(self, test: ast.AST, negated: bool) -> tuple[Guard, ...]:
        """What an `if` test guards in the branch taken when it is true (negated: false): a
        version check guards every use there, hasattr(torch.x, "y") the uses of torch.x.y."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test, negated = test.operand, not negated
        guards, nodes = [], list(ast.walk(test))
        for flag in [n.id for n in nodes if isinstance(n, ast.Name) and n.id in self.flags]:
            nodes += ast.walk(self.flags[flag])  # HAS_X = hasattr(torch.x, "X"); if HAS_X: ...
        for node in nodes:
            name = getattr(node, "attr", None) or getattr(node, "id", None) or ""
            if "version" in name.lower():
                return (Guard(f"version check at line {test.lineno}"),)
            probe = self.probe(node) if isinstance(node, ast.Call) and not negated else None
            if probe:
                guards.append(Guard(f"hasattr/getattr at line {node.lineno}", probe))
        return tuple(guards)


def _covers(probe: str, api: str) -> bool:
    return api == probe or api.startswith(probe + ".")


def _catches(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any((_dotted(t) or [""])[-1] in GUARD_EXCEPTIONS for t in types)


def project_files(project: Path, tests: bool) -> list[Path]:
    """The root scripts, engine/, data/, scripts/ (and tests/) of the project."""
    folders = ["engine", "data", "scripts"] + (["tests"] if tests else [])
    files = sorted(project.glob("*.py"))
    for folder in folders:
        files += sorted((project / folder).rglob("*.py"))
    return files


def find_uses(project: Path, files: list[Path]) -> list[Use]:
    uses = []
    for path in files:
        relative, text = path.relative_to(project).as_posix(), path.read_text()
        if "torch" in text:
            uses += UseFinder(relative, ast.parse(text, relative)).find()
    return uses


@dataclass
class Report:
    missing: dict[str, list[Use]] = field(default_factory=dict)  # "API: why" -> its uses
    guarded: dict[str, list[Use]] = field(default_factory=dict)
    unresolved: dict[str, list[Use]] = field(default_factory=dict)
    no_signature: dict[str, list[Use]] = field(default_factory=dict)


def check(tree: TorchTree, uses: list[Use]) -> Report:
    """Every use resolved in the tree; its keywords checked against what it calls."""
    report = Report()
    for use in uses:
        found = tree.resolve(use.api)
        if found.status == "ok" and use.module_only and found.bindings[0].kind != "module":
            found = Found("missing", reason=f"{use.api} is not a module")
        if found.status == "unresolved":
            report.unresolved.setdefault(f"{use.api}: {found.reason}", []).append(use)
            continue
        problems = [] if found.status == "ok" else [f"{use.api}: {found.reason}"]
        if found.status == "ok" and use.keywords:
            parameters = tree.parameters(found)
            if parameters is None:
                report.no_signature.setdefault(use.api, []).append(use)
            elif not parameters[1]:
                problems += [f"{use.api}({k}=): no parameter '{k}'" for k in use.keywords
                             if k not in parameters[0]]
        for problem in problems:
            table = report.guarded if use.guard else report.missing
            table.setdefault(problem, []).append(use)
    return report


def _places(uses: list[Use], verbose: bool, limit: int = 3, guards: bool = False) -> str:
    places = list(dict.fromkeys(f"{u.path}:{u.line}" + (f" ({u.guard})" if guards else "")
                                for u in uses))
    if verbose or len(places) <= limit:
        return ", ".join(places)
    return ", ".join(places[:limit]) + f" (+{len(places) - limit} more)"


def print_report(report: Report, verbose: bool) -> None:
    for problem, uses in sorted(report.missing.items()):
        kind = "KEYWORD" if "(" in problem.split(":")[0] else "MISSING"
        print(f"{kind}  {problem}  at {_places(uses, verbose)}")
    for problem, uses in sorted(report.guarded.items()):
        print(f"GUARDED  {problem}  at {_places(uses, verbose, guards=True)}")
    if verbose:
        for name, uses in sorted(report.unresolved.items()):
            print(f"unresolved  {name}  at {_places(uses, False)}")
        for name, uses in sorted(report.no_signature.items()):
            keywords = ", ".join(sorted({k for u in uses for k in u.keywords}))
            print(f"no signature  {name}({keywords})  at {_places(uses, False)}")


def find_torch_root(given: str | None) -> Path:
    """The folder holding torch/: the argument (or torch/ itself), else the installed torch."""
    if given is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            sys.exit("no torch installed here; pass a folder holding an unpacked torch/")
        return Path(list(spec.submodule_search_locations)[0]).parent
    path = Path(given).resolve()
    if (path / "torch" / "__init__.py").exists():
        return path
    if path.name == "torch" and (path / "__init__.py").exists():
        return path.parent
    sys.exit(f"{given} holds no torch/__init__.py; unzip a wheel's 'torch/*.py' "
             "'torch/*.pyi' into it")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("torch_tree", nargs="?", help="a folder holding torch/ (default: the "
                        "installed torch)")
    parser.add_argument("--project", default=str(ROOT), help="the project to scan")
    parser.add_argument("--no-tests", action="store_true", help="leave tests/ out")
    parser.add_argument("--verbose", action="store_true",
                        help="list every place, and what could not be resolved")
    args = parser.parse_args(argv)
    tree = TorchTree(find_torch_root(args.torch_tree))
    project = Path(args.project).resolve()
    files = project_files(project, tests=not args.no_tests)
    uses = find_uses(project, files)
    report = check(tree, uses)
    print(f"torch {tree.version()} at {tree.root / 'torch'}: {len(uses)} uses of "
          f"{len({u.api for u in uses})} APIs in {len(files)} files")
    print_report(report, args.verbose)
    keywords = sum("(" in p.split(":")[0] for p in report.missing)
    print(f"summary: {len(report.missing) - keywords} missing, {keywords} unknown keywords, "
          f"{len(report.guarded)} guarded; unresolved: {len(report.unresolved)} names, "
          f"{len(report.no_signature)} signatures" + ("" if args.verbose else
                                                      " (--verbose lists them)"))
    return 1 if report.missing else 0


if __name__ == "__main__":
    sys.exit(main())
