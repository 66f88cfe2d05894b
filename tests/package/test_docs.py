"""The documentation runs: every python and bash block in README.md and docs/ is executed, or marked
``<!-- not-run: reason -->`` on the line before it; docs/api.md matches the docstrings."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..support.apidoc import render

ROOT = Path(__file__).parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
MARK = re.compile(r"^<!-- not-run: (.+?) -->\s*$")


def blocks() -> list[tuple[str, int, str, str, str | None]]:
    """(file, line, language, code, not-run reason) for every fenced block."""
    found = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if m is None:
                i += 1
                continue
            start, lang = i, m.group(1)
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            mark = MARK.match(lines[start - 1]) if start else None
            found.append((path.name, start + 1, lang, "\n".join(lines[start + 1 : j]), mark.group(1) if mark else None))
            i = j + 1
    return found


RUNNABLE = [b for b in blocks() if b[2] in ("python", "bash", "sh")]


def test_every_runnable_block_runs_or_says_why_not() -> None:
    assert RUNNABLE, "no code blocks found"
    for name, line, _lang, _code, reason in RUNNABLE:
        assert reason is None or len(reason) > 10, f"{name}:{line}: a not-run mark needs a reason"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "line", "lang", "code"),
    [b[:4] for b in RUNNABLE if b[4] is None],
    ids=[f"{b[0]}:{b[1]}" for b in RUNNABLE if b[4] is None],
)
def test_doc_block_runs(name: str, line: int, lang: str, code: str, tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    cmd = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert run.returncode == 0, f"{name}:{line} failed:\n{run.stdout}\n{run.stderr}"


def test_api_reference_matches_the_docstrings() -> None:
    assert (ROOT / "docs" / "api.md").read_text(encoding="utf-8") == render(), (
        "docs/api.md is stale: python -m tests.support.apidoc > docs/api.md"
    )
