"""The NPU executor: scalar zeroing and bounded-workspace copies.

Ascend op adapters copy a non-contiguous input into a contiguous temporary, and
a broadcast (expanded) value is such an input: zeroing with
``torch.zeros(1).expand(L, n, ...)`` therefore materialised ``n`` whole slots
and ran servers out of memory. This executor only feeds contiguous tensors:

* zero: ``t.index_fill_(1, idx, 0)`` per tensor: a scalar fill, as in SGLang's
  fix (``t[:, idx] = 0``), one op, nothing the size of the slots;
* shift (a conv tensor's time axis): gathered into the workspace as a copy is,
  shifted there position by position, then scattered (``_shift``);
* copy, rotate and commit (from a draft buffer): gather into a workspace of at most ``copy_workspace_bytes``
  with ``index_select(..., out=ws)``, then ``index_copy_`` from it. The gather
  is chunked by slots, then by layers (``t[l0:l1]`` is contiguous), and for
  states too big for the workspace even one layer at a time, by rows
  (``t[l, s]`` is contiguous), where a rotate goes cycle by cycle through one
  row chunk of scratch (``_rotate_by_rows``)::

      t.view(L, S + 1, inner)      ws (<= copy_workspace_bytes)
      [l0:l1, src chunk, :]  --index_select-->  [l1 - l0, chunk, inner]
      [l0:l1, dst chunk, :]  <--index_copy_---

It runs on any device, so its logic is tested on CPU tensors; ``torch_npu`` is
imported only when a tensor really is on an NPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._core._errors import InvalidArgumentError
from .._core._planner import CommitStage, CopyStage, HostStage, RotateStage, ShiftStage, Stage, ZeroStage
from .._core._validate import check_positive_int
from ._base import Executor, IndexBuilder, Progress, copy_host, stage_pairs

__all__ = ["NpuExecutor", "import_torch_npu"]

_torch_npu_loaded = False


def import_torch_npu() -> None:
    """Import torch_npu once; it needs the Ascend toolkit, so only on a real NPU."""
    global _torch_npu_loaded
    if not _torch_npu_loaded:
        import torch_npu  # type: ignore[import-not-found]  # noqa: F401

        _torch_npu_loaded = True


class NpuExecutor(Executor):
    name = "npu"
    takes_paged = False  # a paged tensor's layer chunks are strided: each op would stage a temporary

    def __init__(self, copy_workspace_bytes: int = 64 << 20) -> None:
        check_positive_int("copy_workspace_bytes", copy_workspace_bytes)
        self.copy_workspace_bytes = copy_workspace_bytes
        self._indices = IndexBuilder()
        # One byte buffer, grown on demand up to the bound and kept: a fresh
        # allocation per step costs page faults on CPU and allocator churn elsewhere.
        self._workspace: torch.Tensor | None = None
        self._progress = Progress()

    def _ws(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous ``numel``-element view of the workspace; never more than the bound in all."""
        nbytes = numel * dtype.itemsize
        ws = self._workspace
        if ws is None or ws.device != device or ws.numel() < nbytes:
            # Drop the old buffer before taking the new one, so two never live at once.
            del ws
            self._workspace = None
            ws = self._workspace = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return ws[:nbytes].view(dtype)

    def execute_host(self, stage: HostStage, tensor: torch.Tensor, host: torch.Tensor) -> None:
        """Offloads and restores one contiguous ``(layer, run)`` chunk at a time: no temporary, no
        non-contiguous input, on CPU tensors too (so tests see what the NPU runs)."""
        copy_host(stage, tensor, host, per_layer=True)

    def execute(self, stage: Stage, tensor: torch.Tensor, draft: torch.Tensor | None = None) -> None:
        if tensor.device.type == "npu":
            import_torch_npu()
        if isinstance(stage, CommitStage):
            # Gather from the draft buffer read as [layers, (slots + 1) * k, inner] (a view
            # of a contiguous tensor), scatter into the slots: the copy path with another source.
            if draft is None:
                raise TypeError("a CommitStage needs the pool tensor's draft buffer")
            k = draft.shape[2]
            srcs = [src * k + pos for src, pos, _ in stage.entries]
            dsts = [dst for _, _, dst in stage.entries]
            src_idx, dst_idx = self._indices.get(stage, tensor.device, srcs, dsts)
            source = draft.view(draft.shape[0], draft.shape[1] * k, -1)
            self._gather_scatter(stage, tensor, srcs, dsts, src_idx, dst_idx, source=source)
        elif isinstance(stage, ZeroStage):
            (zero_idx,) = self._indices.get(stage, tensor.device, stage.slots)
            tensor.index_fill_(1, zero_idx, 0)
        elif isinstance(stage, (CopyStage, RotateStage)):
            srcs, dsts = stage_pairs(stage)
            src_idx, dst_idx = self._indices.get(stage, tensor.device, srcs, dsts)
            self._gather_scatter(stage, tensor, srcs, dsts, src_idx, dst_idx)
        elif isinstance(stage, ShiftStage):
            srcs, dsts = stage_pairs(stage)
            src_idx, dst_idx = self._indices.get(stage, tensor.device, srcs, dsts)
            self._shift(stage, tensor, src_idx, dst_idx)
        else:
            raise TypeError(f"unknown stage {stage!r}")

    def _shift(self, stage: ShiftStage, tensor: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
        """A shift stage on a conv tensor, through the workspace, one (layer group, pair chunk) unit at a time::

            t.view(L, S + 1, rows, w)     ws <- t[l0:l1, sources]  (index_select into ws)
            ws[..., i] <- ws[..., i + k]  for i = 0 .. w - k - 1  (low to high: reads what is not yet written)
            ws[..., w - k:] <- 0;         t[l0:l1, destinations] <- ws  (index_copy_)

        No slot is in two pairs, so units are independent. Each unit's shifted
        workspace is kept in the progress record until its write is done: a repeat
        writes it again instead of shifting a slot shifted in place twice. When
        one slot of one layer does not fit the workspace, :meth:`_shift_by_columns`.
        """
        layers, n, w, k = tensor.shape[0], len(stage.pairs), tensor.shape[-1], stage.shift
        t4 = tensor.view(layers, tensor.shape[1], -1, w)
        rows = t4.shape[2]
        budget = self.copy_workspace_bytes // tensor.element_size()
        chunk = max(1, min(n, budget // (layers * rows * w)))
        group = min(layers, budget // (chunk * rows * w))
        if group == 0:
            self._shift_by_columns(stage, tensor, t4, budget)
            return
        units = [(l0, c0) for l0 in range(0, layers, group) for c0 in range(0, n, chunk)]
        unit, saved = self._progress.resume(stage, tensor)
        for u in range(unit, len(units)):
            l0, c0 = units[u]
            block = t4[l0 : l0 + group]  # a dim-0 slice: contiguous
            picked = src_idx[c0 : c0 + chunk]
            if saved is None:
                ws = self._ws(block.shape[0] * len(picked) * rows * w, tensor.dtype, tensor.device)
                saved = ws.view(block.shape[0], len(picked), rows, w)
                torch.index_select(block, 1, picked, out=saved)
                for i in range(w - k):
                    saved[..., i].copy_(saved[..., i + k])
                saved[..., w - k :].zero_()
                self._progress.mark(u, saved)
            block.index_copy_(1, dst_idx[c0 : c0 + chunk], saved)
            saved = None
            self._progress.mark(u + 1)

    def _shift_by_columns(self, stage: ShiftStage, tensor: torch.Tensor, t4: torch.Tensor, budget: int) -> None:
        """A shift whose slot does not fit the workspace even one layer at a time: no workspace at all.

        For each layer, pair and block of at most ``budget`` rows, time position
        ``i`` of the destination gets position ``i + k`` of the source, ``i`` low to
        high, then the last ``k`` positions are zeroed: in place too, every op
        reads a position no earlier op of the chain wrote, so repeating the op that
        was interrupted is harmless; the progress record counts ops.
        """
        if budget < 1:
            raise InvalidArgumentError(
                f"copy_workspace_bytes={self.copy_workspace_bytes} is smaller than one {tensor.dtype} element"
                f" ({tensor.element_size()} bytes): a shifted copy needs room for at least one"
            )
        layers, _, rows, w = t4.shape
        k, span = stage.shift, min(rows, budget)
        unit, _ = self._progress.resume(stage, tensor)
        op = 0
        for layer in range(layers):
            for src, dst in stage.pairs:
                for r0 in range(0, rows, span):
                    if op + w - k + 1 <= unit:  # this block's chain is done
                        op += w - k + 1
                        continue
                    a, b = t4[layer, src, r0 : r0 + span], t4[layer, dst, r0 : r0 + span]
                    for i in range(w - k + 1):
                        if op >= unit:
                            if i < w - k:
                                b[:, i].copy_(a[:, i + k])
                            else:
                                b[:, w - k :].zero_()
                            self._progress.mark(op + 1)
                        op += 1

    def _gather_scatter(
        self,
        stage: CopyStage | RotateStage | CommitStage,
        tensor: torch.Tensor,
        srcs: Sequence[int],
        dsts: Sequence[int],
        src_idx: torch.Tensor,
        dst_idx: torch.Tensor,
        source: torch.Tensor | None = None,
    ) -> None:
        layers, n = tensor.shape[0], len(srcs)
        t3 = tensor.view(layers, tensor.shape[1], -1)
        s3 = t3 if source is None else source  # what is gathered from: the pool tensor, or a draft buffer
        inner = t3.shape[2]
        budget = self.copy_workspace_bytes // tensor.element_size()  # elements
        rotate = isinstance(stage, RotateStage)
        # A rotate must read every member before writing any, so it cannot be
        # split by slots; a copy stage (disjoint) can.
        chunk = n if rotate else max(1, min(n, budget // (layers * inner)))
        group = min(layers, budget // (chunk * inner))
        if group == 0:
            if rotate:
                self._rotate_by_rows(stage, tensor, t3, budget)  # type: ignore[arg-type]
            else:
                for layer in range(layers):
                    for s, d in zip(srcs, dsts, strict=True):
                        t3[layer, d].copy_(s3[layer, s])  # disjoint: no workspace needed
            return
        if not rotate:
            # Taken before any write; and re-running a disjoint copy is harmless.
            ws = self._ws(group * chunk * inner, tensor.dtype, tensor.device)
            for l0 in range(0, layers, group):
                block = t3[l0 : l0 + group]  # a dim-0 slice: contiguous
                from_block = s3[l0 : l0 + group]
                for c0 in range(0, n, chunk):
                    out = ws[: block.shape[0] * min(chunk, n - c0) * inner].view(block.shape[0], -1, inner)
                    torch.index_select(from_block, 1, src_idx[c0 : c0 + chunk], out=out)
                    block.index_copy_(1, dst_idx[c0 : c0 + chunk], out)
            return
        # Rotate, one unit per layer group: gather every member into the workspace,
        # then scatter. The gathered block is kept in the progress record until its
        # scatter is done, so a repeat resumes at the group that failed.
        unit, saved = self._progress.resume(stage, tensor)
        groups = range(0, layers, group)
        for k in range(unit, len(groups)):
            block = t3[groups[k] : groups[k] + group]
            if saved is None:
                ws = self._ws(group * n * inner, tensor.dtype, tensor.device)
                saved = ws[: block.shape[0] * n * inner].view(block.shape[0], n, inner)
                torch.index_select(block, 1, src_idx, out=saved)
                self._progress.mark(k, saved)
            block.index_copy_(1, dst_idx, saved)
            saved = None
            self._progress.mark(k + 1)

    def _rotate_by_rows(self, stage: RotateStage, tensor: torch.Tensor, t3: torch.Tensor, budget: int) -> None:
        """A rotate whose members do not fit the workspace even one layer at a time.

        Each cycle ``c0 -> c1 -> .. -> c(k-1) -> c0`` is rotated in place through
        one row chunk of scratch (``width`` elements, within the bound)::

            tmp <- c(k-1);  c(k-1) <- c(k-2);  ..;  c1 <- c0;  c0 <- tmp

        Every op reads a row no earlier op of the chain wrote, so repeating the op
        that was interrupted is harmless; the progress record counts ops.
        """
        if budget < 1:
            raise InvalidArgumentError(
                f"copy_workspace_bytes={self.copy_workspace_bytes} is smaller than one {tensor.dtype} element"
                f" ({tensor.element_size()} bytes): a rotate needs room for at least one"
            )
        layers, _, inner = t3.shape
        width = min(inner, budget)
        unit, saved = self._progress.resume(stage, tensor)
        tmp = saved if saved is not None else self._ws(width, t3.dtype, t3.device)
        op = 0
        for layer in range(layers):
            row = t3[layer]
            for e0 in range(0, inner, width):
                e1 = min(inner, e0 + width)
                scratch = tmp[: e1 - e0]
                for cycle in stage.cycles:
                    k = len(cycle)
                    if op + k + 1 <= unit:  # this whole chain is done
                        op += k + 1
                        continue
                    chain = [(scratch, row[cycle[-1], e0:e1])]
                    chain += [(row[cycle[i], e0:e1], row[cycle[i - 1], e0:e1]) for i in range(k - 1, 0, -1)]
                    chain.append((row[cycle[0], e0:e1], scratch))
                    for dst, src in chain:
                        if op >= unit:
                            dst.copy_(src)
                            self._progress.mark(op + 1, tmp)
                        op += 1
