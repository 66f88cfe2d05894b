"""``python -m mambacache`` and the ``mambacache`` command's entry point (:func:`run`).

Until :func:`~mambacache._cli.main` takes over, Ctrl-C ends the process at once with one line and exit 130:
importing the command's modules (and torch, seconds on a loaded machine) leaves nothing to clean up. Installed
here, when the entry point is imported, not by ``mambacache._cli``, which programs and tests import as well."""

import os
import signal
import sys


def _interrupted(signum: int, frame: object) -> None:
    os.write(2, b"mambacache: interrupted\n")
    raise SystemExit(130)  # printed by no one: the line above is the whole message


signal.signal(signal.SIGINT, _interrupted)


def run() -> int:
    """The ``mambacache`` command: :func:`mambacache._cli.main` on ``sys.argv``."""
    from ._cli import main

    return main()


if __name__ == "__main__":
    sys.exit(run())
