"""The request simulator: a scheduler around a CacheManager, checked against isolated generation."""

from ._models import MODELS as MODELS
from ._models import HFModel as HFModel
from ._models import SimModel as SimModel
from ._models import ToyModel as ToyModel
from ._models import build_model as build_model
from ._scheduler import FAULTS as FAULTS
from ._scheduler import PREEMPT as PREEMPT
from ._scheduler import SCENARIOS as SCENARIOS
from ._scheduler import SimConfig as SimConfig
from ._scheduler import SimReport as SimReport
from ._scheduler import simulate as simulate

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
