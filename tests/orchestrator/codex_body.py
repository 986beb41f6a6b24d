"""Request bodies shaped like Codex CLI's (0.171) `POST /v1/responses`, as captured
against a recording server (/work/shared/FIELD-NOTES.md, "Other coding agents as
clients"): stateless (`store: false`, the whole history each turn), no `instructions`
and no `max_output_tokens`; a developer message, the environment context and the user's
turn as `input_text` parts, every item with its own `id`; `function` tools with
`strict: false` and one `namespace` tool nesting functions; `reasoning`, `include`,
`prompt_cache_key` (the session) and `client_metadata`; the `session-id` header.
"""

from __future__ import annotations

import uuid
from typing import Any

DEVELOPER = ("You are Codex, a coding agent. You and the user share the same workspace and "
             "collaborate to achieve the user's goals.\n\n# Working\n- Read before you edit.\n"
             "- Keep changes minimal.\n") * 4
SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}},
          "required": ["cmd"], "additionalProperties": False}
# the namespace's functions: a call the grammar holds to a few tokens (a forced one, e2e)
APP_SCHEMA = {"type": "object", "properties": {"scope": {"enum": ["repo", "file"]}},
              "required": ["scope"], "additionalProperties": False}


def function_tool(name: str, description: str = "",
                  parameters: dict[str, Any] = SCHEMA) -> dict[str, Any]:
    return {"type": "function", "name": name,
            "description": description or f"{name}: does what its name says.",
            "strict": False, "parameters": parameters}


TOOLS = [
    function_tool("exec_command", "Runs a command in a PTY, returning output."),
    function_tool("update_plan", "Updates the task plan."),
    {"type": "namespace", "name": "codex_apps", "description": "Apps the user connected.",
     "tools": [function_tool(n, parameters=APP_SCHEMA)
               for n in ("search", "fetch", "list", "open", "close")]},
]


def item_id(prefix: str) -> str:
    """A fresh item id, as each Codex session's items carry."""
    return f"{prefix}_{uuid.uuid4().hex}"


def message(role: str, text: str, **extra: Any) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "id": item_id("msg"), "role": role,
            "content": [{"type": kind, "text": text}], **extra}


def first_turn(prompt: str) -> list[dict[str, Any]]:
    return [
        message("developer", DEVELOPER),
        message("user", "<environment_context>\n  <cwd>/work/project</cwd>\n  <shell>bash"
                        "</shell>\n  <current_date>2026-12-04</current_date>\n"
                        "</environment_context>"),
        message("user", prompt),
    ]


def codex_request(session: str, items: list[dict[str, Any]] | None = None,
                  stream: bool = True) -> tuple[dict[str, Any], dict[str, str]]:
    body = {
        "model": "gpt-5-codex", "instructions": None,
        "input": items if items is not None else first_turn("fix the failing test"),
        "tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"}, "store": False, "stream": stream,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": session,
        "client_metadata": {"originator": "codex_exec"},
    }
    headers = {"session-id": session, "x-codex-turn-metadata": '{"turn": 1}',
               "authorization": "Bearer dummy"}
    return body, headers
