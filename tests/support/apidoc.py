"""Generates docs/api.md from the docstrings: ``python -m tests.support.apidoc > docs/api.md``.

tests/package/test_docs.py fails when docs/api.md differs from what this prints, so the
reference cannot drift from the code.
"""

from __future__ import annotations

import inspect
import re
from types import ModuleType

import mambacache as mc
import mambacache.audit
import mambacache.hf
import mambacache.testing
import mambacache.tracing

MODULES: list[tuple[ModuleType, str]] = [
    (mc, "`import mambacache as mc`: the core"),
    (mambacache.tracing, "`mc.tracing`: slot-lifecycle tracing and its analyzer"),
    (mambacache.hf, "`mc.hf`: transformers integration"),
    (mambacache.audit, "`mc.audit`: what a block of torch code allocates, feeds and syncs"),
    (mambacache.testing, "`mc.testing`: the sequential oracle, the reference executor, fault injection"),
]


def _signature(obj: object) -> str:
    try:
        sig = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    return re.sub(r" at 0x[0-9a-f]+", "", sig)


def _doc(obj: object) -> str:
    return inspect.getdoc(obj) or ""


def _first_paragraph(obj: object) -> str:
    return _doc(obj).split("\n\n")[0].replace("\n", " ")


def _members(module: ModuleType, cls: type) -> dict[str, object]:
    """``cls``'s own members, then those of its package bases that ``module`` does not export (a private base
    class): the public surface, wherever it is written."""
    members = dict(vars(cls))
    for base in cls.__mro__[1:]:
        if base.__module__.startswith("mambacache.") and base.__name__ not in module.__all__:
            for attr, value in vars(base).items():
                members.setdefault(attr, value)
    return members


def render() -> str:
    out = ["# API reference", "", "Generated from the docstrings by `python -m tests.support.apidoc > docs/api.md`;",
           "`tests/package/test_docs.py` fails when this page and the code disagree.", ""]  # fmt: skip
    for module, title in MODULES:
        out += [f"## {title}", ""]
        for name in sorted(module.__all__, key=lambda n: (not inspect.isclass(getattr(module, n)), n.lower())):
            obj = getattr(module, name)
            if inspect.isclass(obj):
                kind = "exception" if issubclass(obj, BaseException) else "class"
                bases = ""
                if kind == "exception":
                    bases = " (" + ", ".join(b.__name__ for b in obj.__bases__) + ")"
                    out += [f"### `{name}`{bases}", "", _first_paragraph(obj), ""]
                    continue
                out += [f"### `{name}{_signature(obj)}`", "", _doc(obj), ""]
                for attr, value in _members(module, obj).items():
                    if attr.startswith("_") or attr in getattr(obj, "__dataclass_fields__", {}):
                        continue
                    func = getattr(value, "__func__", value)
                    if isinstance(value, property):
                        out.append(f"- `{attr}` (property): {_first_paragraph(value)}")
                    elif inspect.isfunction(func):
                        prefix = "async " if inspect.iscoroutinefunction(func) else ""
                        out.append(f"- `{prefix}{attr}{_signature(func)}`: {_first_paragraph(func)}")
                out.append("")
            elif callable(obj):
                out += [f"### `{name}{_signature(obj)}`", "", _doc(obj), ""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
