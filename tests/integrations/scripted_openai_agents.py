"""The smallest scripted model for OpenAI Agents SDK releases that ship none (before 0.21).

From 0.21 the tests use the SDK's own ``agents.testing``; this stands in for the part of it they
use: ``ScriptedModel(turns)`` answers each model request with its next turn, records each
request's input in ``calls`` and checks, in ``assert_complete``, that every turn was asked for;
``assistant_message`` and ``function_call`` build output items as the SDK's own helpers do.
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agents import Model, ModelResponse, Usage
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)


@dataclass(frozen=True)
class ModelCall:
    """One request the model received: its input items, as they were sent."""

    input: Any


class ScriptedModel(Model):
    """Answers each request with the next of its turns (each a list of output items)."""

    def __init__(self, turns: Sequence[Sequence[Any]]) -> None:
        self._turns = [list(turn) for turn in turns]
        self.calls: list[ModelCall] = []

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        given = kwargs["input"] if "input" in kwargs else args[1]
        self.calls.append(ModelCall(copy.deepcopy(given)))
        if not self._turns:
            raise AssertionError(f"the model was asked with no turn left: {given!r}")
        return ModelResponse(output=self._turns.pop(0), usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the scripted model does not stream")

    def assert_complete(self) -> None:
        assert not self._turns, f"{len(self._turns)} scripted turn(s) were never asked for"


def assistant_message(text: str) -> ResponseOutputMessage:
    """A final text answer."""
    return ResponseOutputMessage(
        id="scripted-message",
        type="message",
        role="assistant",
        status="completed",
        content=[ResponseOutputText(text=text, type="output_text", annotations=[], logprobs=[])],
    )


def function_call(name: str, arguments: Mapping[str, Any], *, call_id: str) -> Any:
    """A call of the tool ``name`` with ``arguments`` under ``call_id``."""
    return ResponseFunctionToolCall(
        id=call_id,
        call_id=call_id,
        type="function_call",
        name=name,
        arguments=json.dumps(arguments, ensure_ascii=False, separators=(",", ":")),
    )
