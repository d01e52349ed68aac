"""A protected tool for test_temporal.py's workflow that calls it in workflow code, imported
into Temporal's sandbox as it is (passed through)."""

from __future__ import annotations

import twiceshy
from twiceshy.integrations.temporal import protect

ledger = twiceshy.Ledger("memory://", counts_interval=None)
calls: list[int] = []


@protect(ledger, effect=twiceshy.KEYED)
async def misplaced_tool(amount: int) -> int:
    """Never runs: it is called in workflow code."""
    calls.append(amount)
    return amount


def _agent_tool() -> object:
    """An OpenAI Agents function tool protected by twiceshy's adapter."""
    from agents import function_tool

    from twiceshy.integrations.openai_agents import protect as protect_tools

    @function_tool
    async def misplaced_agent_tool(amount: int) -> int:
        """Never runs: it is invoked in workflow code."""
        calls.append(amount)
        return amount

    (protected,) = protect_tools([misplaced_agent_tool], ledger, default=twiceshy.KEYED)
    return protected


misplaced_agent_tool = _agent_tool()
