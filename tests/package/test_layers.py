"""The package's shape: no import circle, no reach into another module's privates, the core importing no layer
above it, every public name documented (``__all__`` is kept sorted by ruff's RUF022)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import subprocess
import sys

import pytest

import mambacache as mc

ROOT = pathlib.Path(mc.__file__).parent
MODULES = {
    ".".join(("mambacache", *p.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__"): p
    for p in sorted(ROOT.rglob("*.py"))
}
# Private names of other libraries that the package uses on purpose, each with its reason.
FOREIGN_PRIVATES = {
    "torch._foreach_zero_",  # the one-launch multi-tensor zero: no public form
    "torch._foreach_copy_",  # the one-launch multi-tensor copy: no public form
    "_aten._local_scalar_dense",  # audit: the op a host sync goes through, to flag it
    "_aten._unique2",  # audit: an op with a data-dependent size, to flag it
    "_aten._to_copy",  # audit: the op behind .to(), to flag a device-to-host copy
    "argparse._SubParsersAction",  # the type of add_subparsers(), for annotations
    "GPUModelRunner._update_states",  # vLLM plugin: the one hook where a step's requests are known
    "dist.distributed_c10d._get_default_store",  # StateTransfer's control plane: the group's store, no public form
    # The crew: whether a Python dispatch mode (thread-local) watches this thread's ops; no public form.
    "torch._C",
    "torch._C._len_torch_dispatch_stack",
    "torch._C._len_torch_function_stack",
    # The runner: inference mode's guard, entered and left in C (torch.inference_mode's __enter__ is Python lines).
    "torch._C._InferenceMode",
    # The crew: a default-device context (the one function mode it runs under) is told apart by its type.
    "torch._C._get_function_stack_at",
    "torch.utils._device",
    # The crew: whether a profiler records this thread's ops (it records only its own threads'); no public form.
    "torch.autograd._profiler_enabled",
}


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _imports(name: str, path: pathlib.Path, exact: bool = False) -> set[str]:
    """The package modules ``name`` imports: at module level, inside functions, and under ``if TYPE_CHECKING:``
    too (a circle of types is a circle of the design, even though Python never runs it).

    ``exact``: ``from pkg import x`` counts as an import of ``pkg.x`` when that is a module, else of ``pkg``
    (its ``__init__``), not of both."""
    tree = _tree(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            subs = [f"{base}.{a.name}" for a in node.names]
            targets = [s if s in MODULES else base for s in subs] if exact else [base, *subs]
        found.update(t for t in targets if t in MODULES and t != name)
    return found


def test_no_import_circle() -> None:
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    # A package imports its own submodules on import; a submodule importing its parent package
    # only reaches the finished parent, so edges into a package's __init__ from inside it are not cycles.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


# The layers (docs/architecture.md's picture), a folder each: the core (the step core and its executors), the
# layers on it (the tiers, the hand-off, the manager that holds parts of both), the tools. A module outside
# every folder here must be placed.
CORE = ("mambacache._core", "mambacache._executors")
LAYERS = ("mambacache._tiers", "mambacache._handoff", "mambacache._manager")
TOOLS = (
    "mambacache.tracing", "mambacache.sim", "mambacache.bench", "mambacache.integrations", "mambacache.audit",
    "mambacache.hf", "mambacache.testing", "mambacache._cli", "mambacache._console", "mambacache.__main__",
)  # fmt: skip


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_core_imports_no_layer_above_it() -> None:
    """Nothing imports upward: a core module imports only core modules (under TYPE_CHECKING too), so neither
    a tier, nor the hand-off, nor the manager, nor a tool; and every module of the package is in one layer."""
    unplaced = [n for n in MODULES if n != "mambacache" and not _under(n, CORE + LAYERS + TOOLS)]
    assert not unplaced, f"modules in no layer (move each into a folder of CORE, LAYERS or TOOLS): {unplaced}"
    core = sorted(n for n in MODULES if _under(n, CORE))
    upward = [f"{n} -> {t}" for n in core for t in sorted(_imports(n, MODULES[n], exact=True)) if not _under(t, CORE)]
    assert not upward, "core modules importing upward:\n" + "\n".join(upward)


def test_no_layer_imports_a_tool() -> None:
    """The tiers, the hand-off and the manager import no tool (tracing/, sim/, bench/, the CLI ...): a tool
    drives them, and the core reports to the tracer hook that tracing/ installs."""
    below = sorted(n for n in MODULES if _under(n, CORE + LAYERS))
    upward = [f"{n} -> {t}" for n in below for t in sorted(_imports(n, MODULES[n], exact=True)) if _under(t, TOOLS)]
    assert not upward, "modules importing a tool:\n" + "\n".join(upward)


def test_no_module_reaches_into_another_modules_privates() -> None:
    bad: list[str] = []
    for _name, path in MODULES.items():
        tree = _tree(path)
        own = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        defined = _own_privates(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            owner = ast.unparse(node.value)
            if owner in ("self", "cls") or f"{owner}.{node.attr}" in FOREIGN_PRIVATES:
                continue
            # A private of a class of the same module (a node of this module's own tree, say) is not a reach.
            if isinstance(node.value, ast.Name) and _local_instance(tree, node.value.id, own, node.attr in defined):
                continue
            bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {owner}.{node.attr}")
    assert not bad, "private attributes reached from outside their class's module:\n" + "\n".join(bad)


def _own_privates(tree: ast.Module) -> set[str]:
    """The private names the module's own classes define: methods, class attributes, slots, ``self._x = ...``."""
    names: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Assign) and any(ast.unparse(t) == "__slots__" for t in node.targets):
                names.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))
    return {n for n in names if n.startswith("_")}


def _local_instance(tree: ast.Module, var: str, own: set[str], defined_here: bool) -> bool:
    """Whether ``var`` is annotated or built, somewhere in the module, as one of its own classes; or a loop variable
    whose private (``defined_here``: one that a class of this module defines) may be of one of them. A loop
    variable has no type to read: a private that only another module's class defines is a reach through it."""
    for node in ast.walk(tree):
        annotated = isinstance(node, ast.arg) and node.arg == var and node.annotation is not None
        if annotated and any(c in ast.unparse(node.annotation) for c in own):  # type: ignore[attr-defined]
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == var for t in targets):
                text = ast.unparse(node.value) if node.value is not None else ""
                note = ast.unparse(node.annotation) if isinstance(node, ast.AnnAssign) else ""
                if any(c in text or c in note for c in (*own, "cls.__new__")):
                    return True
        if isinstance(node, (ast.For, ast.comprehension)) and ast.unparse(node.target) == var and defined_here:
            return True  # iterating a module-internal structure (checked by reading: each hit is listed above)
    return False


PUBLIC_MODULES = [
    "mambacache",
    "mambacache.tracing",
    "mambacache.hf",
    "mambacache.audit",
    "mambacache.bench",
    "mambacache.sim",
    "mambacache.testing",
    "mambacache.integrations.vllm",
    "mambacache.integrations.sglang",
]


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_has_a_docstring(module: str) -> None:
    mod = importlib.import_module(module)
    missing: list[str] = []
    for name in getattr(mod, "__all__", []):
        obj = getattr(mod, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if not (obj.__doc__ or "").strip():
            missing.append(name)
        if inspect.isclass(obj) and obj.__module__.startswith("mambacache"):
            # Methods and properties; dataclass fields are documented in the class docstring.
            for attr, value in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                if not (inspect.isfunction(value) or isinstance(value, property)):
                    continue
                # getdoc: a method that implements a documented base method inherits its docstring
                if not (inspect.getdoc(getattr(obj, attr) if inspect.isfunction(value) else value) or "").strip():
                    missing.append(f"{name}.{attr}")
    assert not missing, f"{module}: public names without a docstring: {missing}"


def test_import_mambacache_does_not_import_structlog_until_tracing_is_configured() -> None:
    code = (
        "import sys, mambacache as mc\n"
        "assert 'structlog' not in sys.modules, 'import mambacache pulled in structlog'\n"
        "spec = mc.StateSpec(num_layers=1, conv_shapes=[], temporal_shape=(2,))\n"
        "with mc.CacheManager(mc.StatePool(spec, 2)) as mgr:\n"
        "    mgr.alloc(1); mgr.flush_nowait()\n"
        "assert 'structlog' not in sys.modules, 'a flush with tracing off pulled in structlog'\n"
        "mc.tracing.configure(level='debug')\n"
        "assert 'structlog' in sys.modules and mc.tracing.is_enabled()\n"
        "mc.tracing.disable()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
