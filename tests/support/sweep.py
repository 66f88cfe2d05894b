"""Which ops an every-op fault sweep injects at: all of them in CI, a deterministic sample by default.

``MAMBACACHE_FULL_SWEEP=1`` (``.ci/run`` sets it) runs a fault before every op
of the step; without it the sweep takes the first and last few ops and an even
spread between, so a local ``pytest`` stays quick and still covers the start,
the end and the middle of every stage on every executor variant.
"""

from __future__ import annotations

import os

SAMPLE = 24  # fault points per sweep when sampling


def full_sweep() -> bool:
    return os.environ.get("MAMBACACHE_FULL_SWEEP", "") not in ("", "0")


def fault_points(total: int) -> list[int]:
    """Ops ``1..total`` to fault before: all under a full sweep, else at most ``SAMPLE`` of them."""
    if full_sweep() or total <= SAMPLE:
        return list(range(1, total + 1))
    edges = {1, 2, 3, total - 2, total - 1, total}
    spread = {1 + round(i * (total - 1) / (SAMPLE - len(edges) - 1)) for i in range(SAMPLE - len(edges))}
    return sorted(edges | spread)
