"""docs/api.md lists every request field the schemas declare (chat, completions, responses),
and every refused extension."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from pdserve.server.chat.schemas import (
    EXTENSION_DEFAULTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from pdserve.server.responses.schemas import (
    ContentPart,
    FunctionTool,
    FunctionToolChoice,
    InputItem,
    ResponsesRequest,
    TextFormat,
)

DOC = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
NAMED = set(re.findall(r"`([a-z_]+(?:\[\])?(?:\.[a-z_]+)?)`", DOC))


@pytest.mark.parametrize(
    ("model", "prefix"),
    [
        (ChatCompletionRequest, ""),
        (CompletionRequest, ""),
        (ChatMessage, "messages[]."),
        (ResponsesRequest, ""),
        (InputItem, "input[]."),
        (ContentPart, "input[].content[]."),
        (FunctionTool, "tools[]."),
        (FunctionToolChoice, "tool_choice."),
        (TextFormat, "text.format."),
    ],
)
def test_every_declared_field_is_in_the_api_doc(model: type[BaseModel], prefix: str) -> None:
    fields = {f"{prefix}{f.alias or name}" for name, f in model.model_fields.items()}
    missing = sorted(f for f in fields if f not in NAMED and f.split(".")[-1] not in NAMED)
    assert not missing, f"docs/api.md does not list {missing}"


def test_every_refused_extension_is_in_the_api_doc() -> None:
    assert not sorted(set(EXTENSION_DEFAULTS) - NAMED)
