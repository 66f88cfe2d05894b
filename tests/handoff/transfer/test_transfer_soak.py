"""A soak of real StateTransfers over gloo (issue #32): threads, faults at drawn ops, late peers, a killed peer.

Two runs (``tests/workers/transfer_soak.py``): one prefill and one decode
process, and one prefill and two decode processes where the second decode
engine exits halfway and a new process joins through the store in its place.
The sum of what each process saw: every exported state delivered exactly once
(to the rank it was exported to, where the manager routes) and verified byte
for byte against the oracle, no thread past its deadline, and the prefill side
holding nothing at the end. The figures are printed (``pytest -s``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from ...support.link import free_port
from ...support.soak import report
from ...workers.transfer_soak import SCALE, soak_worker

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("decoders", "per_peer"), [(1, 60), (2, 30)])
def test_a_soak_loses_nothing_and_never_hangs(decoders: int, per_peer: int, tmp_path: Path, transport: str) -> None:
    per_peer *= SCALE
    start = time.monotonic()
    procs = decoders + 1 + (decoders == 2)  # the three-rank run has a process that joins later
    mp.spawn(soak_worker, args=(free_port(), decoders, per_peer, str(tmp_path)), nprocs=procs, join=True)
    wall = time.monotonic() - start
    seen = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    prefill = seen.pop("prefill")
    exported, delivered = prefill["exported"], prefill["delivered"]
    assert sorted(delivered) == sorted(exported), "a state was never delivered"
    verified: dict[str, list[str]] = {}
    for name, stats in seen.items():
        for rid in stats["verified"]:
            verified.setdefault(rid, []).append(name)
    twice = {r: names for r, names in verified.items() if len(names) > 1}
    assert not twice, f"states verified more than once: {twice}"
    assert sorted(verified) == sorted(exported), f"lost: {sorted(set(exported) - set(verified))}"
    for rid, names in verified.items():
        rank = seen[names[0]]["rank"]
        assert exported[rid] == rank == delivered[rid], f"{rid} for rank {exported[rid]} reached rank {rank}"
    line = (
        f"soak {decoders + 1} ranks over {transport}: {prefill['batches']} batches, {prefill['states']} states,"
        f" {prefill['failed_sends']} failed sends retried, {prefill['refusals']} refusals for room,"
        f" {sum(s['failed_receives'] for s in seen.values())} failed receives,"
        f" {sum(s['delays'] for s in seen.values())} receiver delays past the timeout,"
        f" {sum(s['expected'] for s in seen.values())} slots awaiting states in place"
        f" ({sum(s['in_place'] for s in seen.values())} landed there), 0 lost, 0 twice, 0 hangs,"
        f" every state at the rank it was exported to, {wall:.1f}s wall"
    )
    report(line)
