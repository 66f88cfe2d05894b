"""The package stays lint-clean, formatted and strictly typed (the dev extra installs both tools)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=240)


@pytest.mark.skipif(shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(), reason="ruff")
def test_ruff_check_and_format() -> None:
    check = run("ruff", "check", "mambacache", "tests", "examples")
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = run("ruff", "format", "--check", "mambacache", "tests", "examples")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


@pytest.mark.slow
def test_mypy_strict() -> None:
    pytest.importorskip("mypy")
    result = run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr
