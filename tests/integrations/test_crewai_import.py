"""``twiceshy.integrations.crewai`` without CrewAI: the import error names the extra to install.

In a module of its own, without CrewAI imports, so it runs where CrewAI is not installed too.
"""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_adapter_without_crewai_names_the_extra() -> None:
    """Without CrewAI installed, importing the adapter says which extra to install."""
    code = (
        "import sys; sys.modules['crewai'] = None\n"
        "try:\n    import twiceshy.integrations.crewai\n"
        "except ImportError as exc:\n    print(exc)\n"
        "else:\n    print('imported')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "twiceshy.integrations.crewai needs CrewAI" in out.stdout
    assert "pip install 'twiceshy[crewai]'" in out.stdout
