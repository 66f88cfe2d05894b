"""The analyzer's view of state hand-offs between engines: exports, received states, imports.

A piece of the analysis pass of its own: what is in flight between two
engines at each line of one engine's trace, and the three anomalies that shows.

* ``read-before-import``: the engine read a slot whose imported state had not
  landed. Two ways the trace shows it: a flush ran while request ``r`` held a
  slot allocated after the state received for ``r`` arrived, and that state
  still waited in staging, never imported (the slot holds something else:
  LMCache#2863's state never loaded); or a
  flush carrying an import failed (``step.error``) and, before any flush
  completed, a later step read the slot (a fork from it, an offload, an export, a
  commit), so the engine ran on as if the import had landed. (A read of a slot that awaits
  its state in place, ``slot.expect`` with no import since, is flagged by the
  pass itself: ``_analyze._Pass.awaited_read``.)
* ``import-never-completed`` (``expect_idle``): a received state never
  imported, or an import whose flush never completed, at the end.
* ``export-misrouted``: a ``transfer.send`` to one rank named an export
  addressed (``to=``) to another.
* ``export-undelivered`` (``expect_idle``): an export no ``transfer.send`` ever
  named (no acknowledgement from a peer) by the end.

A release that withdraws an export (``transfer.withdraw``) and a received
state given up (``transfer.discard``) end their hand-offs without an anomaly:
the engine chose so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Handoffs"]

Flag = Callable[[str, "int | None", int, "int | None", "str | None", str], None]


@dataclass(slots=True)
class _Import:
    """An import whose step no flush has completed since it was queued."""

    host: int | None
    line: int
    step: int | None
    request_id: str | None
    failed_line: int | None = None  # a step.error since: its flush did not complete
    flagged: bool = False  # a read-before-import was reported for it already


def _not_after(step: int | None, then: int | None) -> bool:
    """Whether ``step`` is not later than ``then`` (a line without a step is taken as the same step)."""
    return step is None or then is None or step <= then


class Handoffs:
    """What one engine's trace shows in flight between engines, line by line.

    Invariants: ``exports`` holds, per request, the exports no ``transfer.send``
    has named yet (oldest first: a send delivers the oldest); ``arrived`` the
    states a ``transfer.receive`` landed that no ``slot.import`` has read;
    ``unlanded`` the staged imports no completed flush has run yet (one in
    place queues no work: its state is in the slot at its line). A slot's release
    ends its import's tracking: whatever was pending no longer reaches a tenant.
    """

    __slots__ = ("arrived", "counts", "exports", "flag", "last_failure", "unlanded")

    def __init__(self, flag: Flag, counts: dict[str, int]) -> None:
        self.flag, self.counts = flag, counts
        # request id -> [(slot, staging host slot or None in place, line, to)]
        self.exports: dict[str, list[tuple[int, int | None, int, int | None]]] = {}
        self.arrived: dict[str, tuple[str, int, int]] = {}  # request id -> (where it waits, peer, line of the receive)
        self.unlanded: dict[int, _Import] = {}  # pool slot -> its import
        self.last_failure: tuple[int, str | None] | None = None  # (line, error) of the last transfer.failed

    # -- the slot events --------------------------------------------------
    def exported(self, slot: int, host: int | None, line: int, rid: str | None, to: int | None = None) -> None:
        """``slot.export`` (addressed to rank ``to``, or to any): in flight until a ``transfer.send`` names it."""
        self.counts["exports"] += 1
        if rid is not None:
            self.exports.setdefault(rid, []).append((slot, host, line, to))

    def imported(
        self, slot: int, host: int | None, line: int, step: int | None, rid: str | None, peer: int | None
    ) -> int | None:
        """``slot.import``: the received state is read; returns the rank it came from (the line's, or its receive's)."""
        self.counts["imports"] += 1
        came = self.arrived.pop(rid, None) if rid is not None else None
        if host is not None:  # in place (no host slot) the state is in the slot already: no flush to wait for
            self.unlanded[slot] = _Import(host, line, step, rid)
        return peer if peer is not None or came is None else came[1]

    def read(self, slot: int, line: int, step: int | None, rid: str | None, what: str) -> None:
        """``what`` reads ``slot`` (its state goes somewhere): flag it if its import's flush failed before."""
        imp = self.unlanded.get(slot)
        if imp is None or imp.failed_line is None or imp.flagged or _not_after(step, imp.step):
            return
        imp.flagged = True
        message = (
            f"{what} slot {slot} in step {step}, but the import of {imp.request_id!r} into it (line {imp.line},"
            f" step {imp.step}) had not landed: its flush failed on line {imp.failed_line} and none completed since"
        )
        self.flag("read-before-import", slot, line, step, rid, message)

    def gone(self, slot: int) -> None:
        """The slot was released (or allocated anew): its import no longer concerns a tenant."""
        self.unlanded.pop(slot, None)

    def waiting(self, tenant: str | None) -> tuple[str, int, int] | None:
        """``(where, peer, line)`` of a state received for ``tenant`` and not imported, if any."""
        return self.arrived.get(tenant) if tenant is not None and self.arrived else None

    # -- flushes ----------------------------------------------------------
    def flushed(self, step: int | None) -> None:
        """``step.flush``: every import queued for this step or an earlier one has landed."""
        if self.unlanded:
            for slot in [s for s, imp in self.unlanded.items() if _not_after(imp.step, step)]:
                del self.unlanded[slot]

    def errored(self, line: int, step: int | None) -> None:
        """``step.error``: the imports of this step or earlier are kept for a retry, not landed."""
        for imp in self.unlanded.values():
            if imp.failed_line is None and _not_after(imp.step, step):
                imp.failed_line = line

    # -- the transfer's own lines ------------------------------------------
    def transfer(self, r: dict[str, Any], line: int) -> list[tuple[int, str]]:
        """A ``transfer.*`` line; returns ``(slot, request id)`` of each export a send delivered."""
        event, ids, peer = r["event"], r["request_ids"], r["peer"]
        if event == "transfer.failed":
            self.counts["transfer_failures"] += 1
            self.last_failure = (line, r["error"])
            return []
        if event == "transfer.withdraw":  # a release gave up the oldest export of each id: nothing was sent
            for rid in ids:
                pending = self.exports.get(rid)
                if pending:
                    pending.pop(0)
                    if not pending:
                        del self.exports[rid]
            return []
        if event == "transfer.discard":  # the decode side gave up the arrived state: no import will read it
            for rid in ids:
                self.arrived.pop(rid, None)
            return []
        if event == "transfer.receive":
            self.counts["states_received"] += len(ids)
            if "slots" in r:
                for rid, slot in zip(ids, r["slots"], strict=True):
                    self.arrived[rid] = (f"slot {slot} (landed in place)", peer, line)
            else:
                for rid, host in zip(ids, r["hosts"], strict=True):
                    self.arrived[rid] = (f"staging host slot {host}", peer, line)
            return []
        self.counts["states_sent"] += len(ids)
        sent = []
        for rid in ids:
            pending = self.exports.get(rid)
            if pending:
                slot, _, at, to = pending.pop(0)
                if not pending:
                    del self.exports[rid]
                sent.append((slot, rid))
                if to is not None and peer is not None and to != peer:
                    message = f"the export of {rid!r} from slot {slot} (line {at}) was for rank {to}, sent to {peer}"
                    self.flag("export-misrouted", slot, line, r.get("step"), rid, message)
        return sent

    # -- the end of the trace ------------------------------------------------
    def finish(self, line: int, step: int | None) -> None:
        """With ``expect_idle``: every hand-off still in flight at the end is an anomaly."""
        for rid, (where, peer, at) in self.arrived.items():
            message = (
                f"the state received for {rid!r} from rank {peer} on line {at} was never imported: {where} still"
                " holds it"
            )
            self.flag("import-never-completed", None, line, step, rid, message)
        for slot, imp in self.unlanded.items():
            why = f" (its flush failed on line {imp.failed_line})" if imp.failed_line is not None else ""
            message = (
                f"the import of {imp.request_id!r} into slot {slot} (line {imp.line}, step {imp.step}) never"
                f" landed: no flush of its step completed{why}"
            )
            self.flag("import-never-completed", slot, line, step, imp.request_id, message)
        failure = self.last_failure
        why = f"; the last transfer failure, line {failure[0]}: {failure[1]}" if failure is not None else ""
        for rid, pending in self.exports.items():
            for slot, host, at, _ in pending:
                staged = "in place" if host is None else f"staging host slot {host}"
                message = (
                    f"the export of {rid!r} from slot {slot} (line {at}, {staged}) was never"
                    f" acknowledged by a peer{why}"
                )
                self.flag("export-undelivered", slot, line, step, rid, message)
