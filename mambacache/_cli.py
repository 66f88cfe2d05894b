"""The ``mambacache`` command: simulate, bench, trace."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

from . import __version__

# Each subcommand's one-line help, here rather than in its module: `mambacache --help` and `--version` list
# them without importing the modules (and torch, seconds on a loaded machine).
COMMANDS = {
    "simulate": "run a continuous-batching workload on real models and check outputs against isolated generation",
    "bench": "clear/copy speed, workspace and host overhead against the bandwidth bound and the `sglang` path",
    "trace": "analyse a JSON-lines lifecycle trace",
}


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (and --help for the rest), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _top() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction[_Parser]]:
    parser = _Parser(
        prog="mambacache", description="Manage, simulate and benchmark hybrid models' recurrent state caches."
    )
    parser.add_argument("--version", action="version", version=f"mambacache {__version__}")
    return parser, parser.add_subparsers(dest="command", required=True)


# The module that adds each subcommand's parser (simulate's and bench's import torch; trace's does not).
_MODULES = {"simulate": "mambacache.sim._cli", "bench": "mambacache.bench._cli", "trace": "mambacache.tracing._report"}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line: every subcommand's parser, or ``only``'s with the others as names that take anything
    (their modules not imported)."""
    import importlib

    parser, sub = _top()
    for name, text in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(_MODULES[name]).add_parser(sub, text)
        else:
            sub.add_parser(name, help=text, add_help=False)
    return parser


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser of each subcommand of :func:`build_parser`'s ``parser``, by name."""
    return next(dict(a.choices) for a in parser._actions if isinstance(a, argparse._SubParsersAction) and a.choices)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 success, 1 a finding (anomalies, mismatches) or a report that could not be written, 2 bad
    input or usage, 130 interrupted (at any moment, torch's import included)."""
    previous = None
    try:
        previous = _raise_on_interrupt()
        return _run(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:
        sys.stderr.write("mambacache: interrupted\n")
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _raise_on_interrupt() -> Any:
    """Ctrl-C as KeyboardInterrupt while the command works, so that its clean-up runs (a partial trace removed, a
    competing process stopped): the handler it replaces (None off the main thread, where it stays)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, signal.default_int_handler)


def _run(argv: list[str]) -> int:
    from ._console import OutputError, UsageError

    # --version, --help and a missing or unknown subcommand are answered here, before any subcommand's module
    # (and torch) is imported; then only the named subcommand's.
    command = build_parser(only="").parse_known_args(argv)[0].command
    parser = build_parser(only=command)
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's error, naming it: "mambacache simulate: error: unrecognized arguments: ..."
        subcommands(parser)[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args))
    except UsageError as exc:
        sys.stderr.write(f"mambacache {args.command}: {exc}\n")
        return 2
    except OutputError as exc:
        sys.stderr.write(f"mambacache {args.command}: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
