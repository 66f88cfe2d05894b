"""The request simulator: a scheduler around a CacheManager, checked against isolated generation.

The settings and names (:class:`SimConfig`, ``SCENARIOS``...) import without torch; the models and the
scheduler are imported on first use."""

from typing import TYPE_CHECKING
from typing import Any as _Any

from ._config import FAULTS as FAULTS
from ._config import MODELS as MODELS
from ._config import PREEMPT as PREEMPT
from ._config import SCENARIOS as SCENARIOS
from ._config import SimConfig as SimConfig

if TYPE_CHECKING:
    from ._models import HFModel as HFModel
    from ._models import SimModel as SimModel
    from ._models import ToyModel as ToyModel
    from ._models import build_model as build_model
    from ._scheduler import SimReport as SimReport
    from ._scheduler import simulate as simulate

_LAZY = {
    **dict.fromkeys(("HFModel", "SimModel", "ToyModel", "build_model"), "_models"),
    **dict.fromkeys(("SimReport", "simulate"), "_scheduler"),
}


def __getattr__(name: str) -> _Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "FAULTS",
    "MODELS",
    "PREEMPT",
    "SCENARIOS",
    "HFModel",
    "SimConfig",
    "SimModel",
    "SimReport",
    "ToyModel",
    "build_model",
    "simulate",
]
