"""The runnable examples of docs/durable_engines.md, by the file name each one is titled with
(```python title="dbos_shop.py"```), and a way to run them as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "durable_engines.md"


def examples() -> dict[str, str]:
    """Each titled Python block of the page, by its title."""
    blocks = re.findall(r'```python title="([^"]+)"\n(.*?)\n```', PAGE.read_text(), re.S)
    return dict(blocks)


def run_example(
    where: Path, files: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Write ``files`` (page titles) to ``where`` and run the last one there, as a user would."""
    written = examples()
    for name in files:
        (where / name).write_text(written[name] + "\n")
    return subprocess.run(
        [sys.executable, files[-1]],
        cwd=where,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
