"""A soak of the transfer between tensor-parallel sizes over gloo: threads, faults at drawn ops, late and full peers.

Two runs of three processes (``tests/workers/reslice_soak.py``): TP 1 -> TP 2
(a ``ReslicingSender`` cutting each state into the shards of two decode ranks)
and TP 2 -> TP 1 (a ``ReslicingReceiver`` joining the shards of two prefill
ranks). The sum of what each process saw: every exported state delivered
exactly once by every prefill rank and verified exactly once by every decode
rank, byte for byte against the oracle's state as the layout cuts it (its shard,
or the whole state joined), no thread past its deadline, and every process
holding nothing at the end (each checks ``check_idle`` itself). The figures are
printed (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from ...support.link import free_port
from ...support.soak import report
from ...workers.reslice_soak import reslice_soak_worker

pytestmark = pytest.mark.slow


def _sum(counts: list[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for c in counts:
        total.update(c)
    return dict(sorted(total.items()))


@pytest.mark.parametrize(("mode", "count"), [("1to2", 150), ("2to1", 150)])
def test_a_reslicing_soak_loses_nothing_and_never_hangs(mode: str, count: int, tmp_path: Path) -> None:
    start = time.monotonic()
    seed = int(os.environ.get("MAMBACACHE_SOAK_SEED", "0"))  # another draw of faults, delays and timings
    mp.spawn(reslice_soak_worker, args=(free_port(), mode, count, str(tmp_path), seed), nprocs=3, join=True)
    wall = time.monotonic() - start
    seen = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    prefills = {n: s for n, s in seen.items() if n.startswith("prefill")}
    decodes = {n: s for n, s in seen.items() if n.startswith("decode")}
    assert len(prefills) + len(decodes) == 3, sorted(seen)
    want = [f"r-{i}" for i in range(count)]
    for name, stats in prefills.items():
        assert stats["exported"] == want, f"{name} exported {stats['exported']}"
        twice = [r for r, n in Counter(stats["delivered"]).items() if n > 1]
        assert not twice, f"{name} delivered {twice} more than once"
        assert sorted(stats["delivered"]) == sorted(want), (
            f"{name} never delivered {set(want) - set(stats['delivered'])}"
        )
    for name, stats in decodes.items():
        twice = [r for r, n in Counter(stats["verified"]).items() if n > 1]
        assert not twice, f"{name} verified {twice} more than once"
        assert sorted(stats["verified"]) == sorted(want), f"{name} lost {sorted(set(want) - set(stats['verified']))}"
    p, d = list(prefills.values()), list(decodes.values())
    line = (
        f"reslice soak {mode[0]} -> {mode[-1]} (seed {seed}): {count} states, {sum(s['batches'] for s in p)} batches"
        f" ({sum(s['states'] for s in p)} states sent by {len(p)} prefill ranks),"
        f" {sum(s['failed_sends'] for s in p)} failed sends retried,"
        f" sender refusals {_sum([s['refusals'] for s in p])},"
        f" receiver refusals {_sum([s['refusals'] for s in d])}, {sum(s['failed_receives'] for s in d)} failed"
        f" receives, {sum(s['delays'] for s in d)} receiver delays past the timeout,"
        f" {sum(s['expected'] for s in d)} slots awaiting states in place ({sum(s['in_place'] for s in d)} landed"
        f" there), every byte of every {'shard' if mode == '1to2' else 'joined state'} exact, 0 lost, 0 twice,"
        f" 0 hangs, {wall:.1f}s wall"
    )
    report(line)
