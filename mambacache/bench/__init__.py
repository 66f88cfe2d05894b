"""``mambacache bench``: clear and copy paths against the bandwidth bound and SGLang's pre-fix code; a state transfer
against a plain send of the same bytes."""

from ._cli import add_parser as add_parser
from ._presets import PRESETS as PRESETS
from ._run import Result as Result
from ._run import host_overhead as host_overhead
from ._run import run_preset as run_preset
from ._run import tracing_overhead as tracing_overhead
from ._xfer import transfer_vs_send as transfer_vs_send

__all__ = ["PRESETS", "Result", "add_parser", "host_overhead", "run_preset", "tracing_overhead", "transfer_vs_send"]
