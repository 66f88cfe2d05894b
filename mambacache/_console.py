"""Terminal output shared by the CLI commands: a progress bar, tables, JSON, usage checks."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any


class UsageError(Exception):
    """Bad input to a command: reported as one line, exit 2, before any work starts."""


class OutputError(Exception):
    """A report the command made could not be written (a full disk, a quota): one line naming the path and the
    cause, exit 1, for the work ran; a path that can be seen to be unwritable is a :class:`UsageError` first."""

    def __init__(self, path: str | Path, exc: OSError) -> None:
        super().__init__(f"cannot write {path}: {exc.strerror or exc}")


def unwritable(path: str | Path) -> str | None:
    """Why ``path`` cannot be written as an output file (None: it can), found by opening it for appending (and
    removing it again when it was not there): a folder, a missing or read-only folder, ``/proc``, a full quota
    all read as they would at the end of the run, but now, before minutes of work."""
    p = Path(path)
    if p.is_dir():
        return f"{p} is a folder; give a file path"
    if not p.parent.is_dir():
        above = next((a for a in p.parents if a.exists()), None)
        if above is not None and not above.is_dir():
            return f"{p}: {above} is a file, not a folder"
        return f"{p}: folder {p.parent} does not exist"
    existed = p.exists()
    try:
        with open(p, "a", encoding="utf-8"):  # "a" changes nothing in a file that exists
            pass
        if not existed:
            p.unlink()
    except OSError as exc:
        return f"cannot write {p}: {exc.strerror or exc}"
    return None


def check_distinct(*named: tuple[str, str | Path | None]) -> None:
    """:class:`UsageError` when two of ``named`` (an option's name, its path; None and ``-`` pass) name one
    file: the later write would replace the earlier, or a report its own input."""
    seen: dict[Path, str] = {}
    for option, path in named:
        if path is None or str(path) == "-":
            continue
        real = Path(path).resolve()
        if real in seen:
            raise UsageError(f"{seen[real]} and {option} name one file ({path}): give each its own")
        seen[real] = option


def check_output_path(path: str | Path | None) -> None:
    """:class:`UsageError` for an output path that cannot be written (see :func:`unwritable`); None and ``-``
    (stdout) pass."""
    if path is not None and str(path) != "-":
        reason = unwritable(path)
        if reason is not None:
            raise UsageError(reason)


def output_path(*, stdout: bool = False) -> Any:
    """An argparse type for every command's output files (``--json``, ``--plot``, ``--trace``): the path is
    checked writable when the command line is parsed, so a bad one is argparse's one-line error, exit 2, before
    any work; ``-`` is stdout where ``stdout`` allows it."""

    def parse(text: str) -> str:
        if not (stdout and text == "-"):
            reason = unwritable(text)
            if reason is not None:
                raise argparse.ArgumentTypeError(reason)
        return text

    parse.__name__ = "path"
    return parse


def plot_path() -> Any:
    """An argparse type for ``--plot``: :func:`output_path`'s check, after the name's: an extension matplotlib
    writes (checked when matplotlib is there; without it the command refuses ``--plot`` anyway), and none is
    ``.png``, added to the path returned, as matplotlib adds it when saving, so the file said is the file
    written."""

    def parse(text: str) -> str:
        suffix = Path(text).suffix.lower().lstrip(".")
        if not suffix:
            text += ".png"
        else:
            try:
                from matplotlib.backend_bases import FigureCanvasBase
            except ImportError:
                pass
            else:
                kinds = FigureCanvasBase.get_supported_filetypes()
                if suffix not in kinds:
                    raise argparse.ArgumentTypeError(
                        f"{text}: matplotlib writes no .{suffix} files; use .png, .svg, .pdf (or {', '.join(kinds)})"
                    )
        reason = unwritable(text)
        if reason is not None:
            raise argparse.ArgumentTypeError(reason)
        return text

    parse.__name__ = "plot path"
    return parse


def executor_name(*extra: str) -> Any:
    """An argparse type: a registered executor's name (or one of ``extra``), else argparse's one-line error."""

    def parse(text: str) -> str:
        from ._executors import known_executors

        known = [*known_executors(), *extra]
        if text not in known:
            raise argparse.ArgumentTypeError(f"unknown executor {text!r}; known: {', '.join(known)}")
        return text

    parse.__name__ = "executor"
    return parse


def need_matplotlib(flag: str) -> None:
    """Fail at once, with the install line, when a plot is asked for and matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"{flag} needs matplotlib: pip install 'mambacache[plot]'") from None


class Progress:
    """Progress of ``total`` units of work: on a terminal a one-line bar, redrawn at most every 0.1 s; off one (a
    log, CI) a line every ``every`` seconds and one at the end, as pip and pytest report. Both show the phase
    (``note``) and an estimate of the time left, from the rate so far. A context manager: the bar's line ends
    however the block does, so an interrupt's message starts on its own line."""

    def __init__(
        self, total: int, label: str, stream: IO[str] | None = None, width: int = 30, every: float = 5.0
    ) -> None:
        self.total, self.label, self.width, self.every = max(total, 1), label, width, every
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self.done = 0
        self._start = time.perf_counter()
        self._last = self._start if not self.enabled else 0.0
        self._bar_drawn = False  # a bar line is open on the terminal: close() ends it

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done += n
        now = time.perf_counter()
        finished = self.done >= self.total
        if self.enabled and (now - self._last > 0.1 or finished):
            self._last = now
            filled = int(self.width * min(self.done, self.total) / self.total)
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {self._figures(now)} {note}\033[K")
            self.stream.flush()
            self._bar_drawn = True
        elif not self.enabled and (now - self._last >= self.every or finished):
            self._last = now
            self.stream.write(f"{self.label}: {self._figures(now)} {note}".rstrip() + "\n")
            self.stream.flush()

    def _figures(self, now: float) -> str:
        """``done/total``, the time so far and, until the end, an estimate of the time left."""
        elapsed = now - self._start
        left = elapsed / self.done * (self.total - self.done) if 0 < self.done < self.total else None
        return f"{self.done}/{self.total} {elapsed:5.1f}s" + (f", about {left:.0f}s left" if left is not None else "")

    def line(self, text: str) -> None:
        """A milestone line for logs (not a terminal), where a bar would be noise."""
        if not self.enabled:
            elapsed = time.perf_counter() - self._start
            self.stream.write(f"{self.label}: {text} ({self.done}/{self.total}, {elapsed:.1f}s)\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar_drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._bar_drawn = False


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A plain-text table: numbers right-aligned, text left-aligned."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(r[i], (int, float)) for r in rows) if rows else False for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric, strict=True)
        ).rstrip()

    out = [title] if title else []
    out += [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path``; ``-`` means stdout."""
    text = json.dumps(data, indent=2, sort_keys=False)
    if str(path) == "-":
        sys.stdout.write(text + "\n")
        return
    try:
        Path(path).write_text(text + "\n", encoding="utf-8")
    except OSError as exc:
        raise OutputError(path, exc) from None


def say_written(what: str, path: str, json_path: str | None) -> None:
    """One line naming a file the command wrote: on stdout, or on stderr when stdout carries the JSON
    (``json_path`` is ``-``); nothing for the JSON on stdout itself."""
    if path != "-":
        (sys.stderr if json_path == "-" else sys.stdout).write(f"{what}: {path}\n")


def save_figure(fig: Any, path: str, dpi: int = 120) -> None:
    """``fig`` saved to ``path`` (see :func:`plot_path`) and closed, saved or not; :class:`OutputError` when the
    file cannot be written."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=dpi)
    except OSError as exc:
        raise OutputError(path, exc) from None
    finally:
        plt.close(fig)


def int_at_least(low: int, high: int | None = None) -> Any:
    """An argparse type: an int >= ``low`` (and <= ``high``; a bad value is argparse's one-line error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
        return value

    parse.__name__ = f"int>={low}"
    return parse


def float_in(low: float, high: float | None = None, *, low_open: bool = False) -> Any:
    """An argparse type: a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        bad_low = value <= low if low_open else value < low
        if not math.isfinite(value) or bad_low or (high is not None and value > high):
            bound = f"{'(' if low_open else '['}{low:g}, {'inf)' if high is None else f'{high:g}]'}"
            raise argparse.ArgumentTypeError(f"must be in {bound}, got {text}")
        return value

    parse.__name__ = "number"
    return parse
