"""Large CPU stages: the pools the grain, crew and policy tests share, and the crew made to share every stage."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

import mambacache as mc
from mambacache._core._planner import plan_step
from mambacache._executors._crew import crew
from mambacache._executors._torch import TorchExecutor

from .util import paged_pool

# (name, spec): each slot's view over both layers is past the grain; the rows are cut into complex128
# pieces (fp32, 16-byte rows) or int16 ones (bf16 rows of 2 mod 4 bytes, two pieces per row).
SPECS = {
    "wide": mc.StateSpec(num_layers=2, conv_shapes=[(8, 4)], temporal_shape=(4, 64, 65), draft_tokens=2),
    "narrow": mc.StateSpec(
        num_layers=2,
        conv_shapes=[(5, 3)],
        temporal_shape=(3, 61, 181),
        conv_dtype=torch.bfloat16,
        temporal_dtype=torch.bfloat16,
        draft_tokens=2,
    ),
}


def random_bytes(tensors: list[torch.Tensor], seed: int) -> None:
    """Any bit pattern, NaN payloads included: a piece's dtype must not change a byte."""
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))


def make_pool(name: str, paged: bool) -> mc.StatePool:
    spec = SPECS[name]
    if paged:
        return paged_pool(mc.StateSpec(spec.num_layers, spec.conv_shapes, spec.temporal_shape, spec.conv_dtype,
                                       spec.temporal_dtype), 8)  # fmt: skip
    return mc.StatePool(spec, 8)


@contextlib.contextmanager
def shared(chunk_bytes: int = 512, min_views: int = 2) -> Iterator[None]:
    """Every stage of two views or more and twice ``chunk_bytes`` goes to the crew, in chunks of about that, with
    two torch threads (the crew takes a helper per torch thread past the first; the suite runs with one). A
    torch executor made without ``large_stages`` takes the crew's way: under ``"auto"`` a stage shape an earlier
    test measured on a loaded host may run inline, and these tests are about the crew."""
    defaults = TorchExecutor.__init__.__kwdefaults__
    assert defaults is not None and defaults["large_stages"] == "auto"
    old = crew.chunk_bytes, crew.min_views, torch.get_num_threads()
    crew.chunk_bytes, crew.min_views = chunk_bytes, min_views
    torch.set_num_threads(2)
    defaults["large_stages"] = "crew"
    try:
        yield
    finally:
        defaults["large_stages"] = "auto"
        crew.chunk_bytes, crew.min_views = old[:2]
        torch.set_num_threads(old[2])


def host_stages() -> list[Any]:
    """Offloads and restores of single slots and of runs (slots 2-4 -> host 1-3 is one run of three)."""
    return [
        *plan_step([mc.Offload(2, 1), mc.Offload(3, 2), mc.Offload(4, 3), mc.Offload(7, 5)]).stages,
        *plan_step([mc.Restore(1, 5, keep=True), mc.Restore(2, 6, keep=True), mc.Restore(5, 1, keep=True)]).stages,
        *plan_step([mc.Restore(3, 8, keep=True)]).stages,
    ]
