"""Request bodies shaped like Claude Code's (2.1.x) `POST /v1/messages?beta=true`.

What matters is the shape, taken from a captured request: three system blocks
starting with the per-session billing header, `cache_control` markers, a `role:
"system"` turn inside `messages`, a dozen tools with JSON schemas, `metadata.user_id`
holding the session, `max_tokens: 128000`, `thinking`, `context_management`,
`output_config`, and `anthropic-beta` values this server has never heard of.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from typing import Any

TOOL_NAMES = ["Agent", "Bash", "Edit", "Glob", "Grep", "NotebookEdit", "Read", "TaskCreate",
              "TodoWrite", "WebFetch", "WebSearch", "Write"]
BETAS = ("claude-code-20250219,context-1m-2025-08-07,interleaved-thinking-2025-05-14,"
         "context-management-2025-06-27,prompt-caching-scope-2026-01-05,"
         "mid-conversation-system-2026-04-07,some-future-beta-2099-01-01")
SYSTEM = (
    "\nYou are an interactive agent that helps users with software engineering tasks. "
    "Use the instructions below and the tools available to you to assist the user.\n\n"
    "# Doing tasks\n- Read files before editing them.\n- Keep changes small.\n"
)


def tool(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "description": f"{name}: does what its name says. Use it when the task needs it.",
        "input_schema": {
            "type": "object",
            "properties": {
                "command" if name == "Bash" else "path": {"type": "string",
                                                          "description": "what to act on"},
                "timeout": {"type": "number"},
            },
            "required": ["command" if name == "Bash" else "path"],
            "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#",
        },
    }


def first_user_turn(prompt: str) -> dict[str, Any]:
    return {"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nToday's date is 2026-11-29.\n"
                                 "</system-reminder>\n\n"},
        {"type": "text", "text": prompt, "cache_control": {"type": "ephemeral"}},
    ]}


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A valid RGB PNG of `width` x `height` pixels (a stand-in for a screenshot)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    rows = b"".join(b"\x00" + bytes((x * 7 + y * 13 + seed) % 256 for x in range(3 * width))
                    for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


def image_block(data: bytes) -> dict[str, Any]:
    """An image as Claude Code sends one: pasted into the prompt, or read by its Read tool
    (then inside the tool_result's content)."""
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(data).decode()}}


def screenshot_history(screenshot: bytes) -> list[dict[str, Any]]:
    """A session whose history holds images: a pasted screenshot, then one the Read tool
    returned, then the user's next question."""
    return [
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>\nToday's date is 2026-11-29.\n"
                                     "</system-reminder>\n\n"},
            image_block(screenshot),
            {"type": "text", "text": "The build page looks broken, see the screenshot."}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look at the saved screenshot too."},
            {"type": "tool_use", "id": "toolu_01Read", "name": "Read",
             "input": {"path": "/tmp/build.png"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01Read",
             "content": [image_block(png(24, 16, seed=5))]},
            {"type": "text", "text": "What do you see?",
             "cache_control": {"type": "ephemeral"}}]},
    ]


def claude_code_request(session: str, messages: list[dict[str, Any]] | None = None, *,
                        stream: bool = True) -> tuple[dict[str, Any], dict[str, str]]:
    """(body, headers) of one request of session `session`."""
    if messages is None:
        messages = [
            first_user_turn("say hello"),
            {"role": "system", "content": "Available agent types for the Agent tool:\n"
                                          "- general-purpose: researches complex questions"},
        ]
    body = {
        "model": "claude-opus-4-8",
        "max_tokens": 128000,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197."
                                     f"{session[:3]}; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude "
                                     "Agent SDK.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
        ],
        "messages": messages,
        "tools": [tool(n) for n in TOOL_NAMES],
        "metadata": {"user_id": json.dumps({"device_id": "d0", "account_uuid": "",
                                            "session_id": session})},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "temperature": 1,
        "stream": stream,
    }
    headers = {
        "anthropic-version": "2023-06-01",
        "anthropic-beta": BETAS,
        "anthropic-dangerous-direct-browser-access": "true",
        "x-app": "cli",
        "x-claude-code-session-id": session,
        "x-api-key": "dummy",
        "user-agent": "claude-cli/2.1.197 (external, sdk-cli)",
    }
    return body, headers
