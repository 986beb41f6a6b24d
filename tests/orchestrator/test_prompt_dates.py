"""What a client's date costs when it changes (docs/agents.md, "Dates inside the prompt").

opencode rebuilds "Today's date: ..." at the end of its system prompt on every request;
Codex CLI states the date in an `<environment_context>` user message after its developer
prompt. After midnight a session's next request differs from its last one at the date, so
everything after the date is computed again, once. The engine keeps the client's date as
sent (the model must know the date); these tests render yesterday's and today's request
through the shim's own render path and hold that decision to its premise: the date
reaches the model verbatim, and the prompt breaks at the date, not before it. A template
or a rewrite that moved the break earlier would fail here.

Run with `-s` to see the figures: for each session length, the prompt's length, the
first token where the two renders differ and the tokens after it (the recompute).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient
from tokenizers import Tokenizer

from orchestrator.gguf_tokenizer import write_tokenizer_dir
from orchestrator.shim.chat_template import ChatTemplate
from orchestrator.shim.server import build_app
from tests.conftest import SMOLLM2, needs_smollm2
from tests.orchestrator.codex_body import DEVELOPER, codex_request, message
from tests.orchestrator.scripted_engine import ScriptedEngine

YESTERDAY, TODAY = "Thu Dec 03 2026", "Fri Dec 04 2026"
CODEX_YESTERDAY, CODEX_TODAY = "2026-12-03", "2026-12-04"
TURNS = (0, 4, 16, 64)

OPENCODE_SYSTEM = ("You are opencode, an interactive CLI tool that helps users with software "
                   "engineering tasks.\n\n# Tone and style\nBe concise. Use the tools.\n") * 8
OPENCODE_TOOL_NAMES = ("bash", "edit", "webfetch", "glob", "grep", "list", "read", "write",
                       "todowrite", "todoread", "task", "patch")


def opencode_tools() -> list[dict[str, Any]]:
    params = {"type": "object", "properties": {
        "path": {"type": "string", "description": "The absolute path."},
        "text": {"type": "string", "description": "What to write or look for."}},
        "required": ["path"]}
    return [{"type": "function", "function": {
        "name": name, "description": f"The {name} tool: use it when the task needs it. " * 6,
        "parameters": params}} for name in OPENCODE_TOOL_NAMES]


def opencode_body(date: str, turns: int) -> dict[str, Any]:
    """opencode's request after `turns` turns: the environment and the date at the end of
    its system prompt, each turn a tool call, its result and an answer."""
    system = (f"{OPENCODE_SYSTEM}\n<env>\n  Working directory: /work/project\n  Platform: linux"
              f"\n  Today's date: {date}\n</env>")
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"Turn {t}: look at module_{t}.py and fix it."},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": f"call_{t}", "type": "function",
                "function": {"name": "read", "arguments": f'{{"path": "/work/module_{t}.py"}}'}}]},
            {"role": "tool", "tool_call_id": f"call_{t}",
             "content": f"def f_{t}(x):\n    return x + {t}\n" * 4},
            {"role": "assistant", "content": f"module_{t}.py is fixed."},
        ]
    messages.append({"role": "user", "content": "and now the tests"})
    return {"model": "m", "max_tokens": 64, "tool_choice": "auto", "messages": messages,
            "tools": opencode_tools(), "stream": False}


def codex_body(date: str, turns: int) -> dict[str, Any]:
    """Codex's request after `turns` turns, its environment context rebuilt with `date` in
    place (the worst case: Codex may instead append a new context when it changes)."""
    items = [message("developer", DEVELOPER),
             message("user", "<environment_context>\n  <cwd>/work/project</cwd>\n  <shell>bash"
                             f"</shell>\n  <current_date>{date}</current_date>\n"
                             "</environment_context>")]
    for t in range(turns):
        items += [
            message("user", f"Turn {t}: look at module_{t}.py and fix it."),
            {"type": "function_call", "id": f"fc_{t}", "call_id": f"call_{t}",
             "name": "exec_command", "arguments": f'{{"cmd": "cat module_{t}.py"}}'},
            {"type": "function_call_output", "call_id": f"call_{t}",
             "output": f"def f_{t}(x):\n    return x + {t}\n" * 4},
            message("assistant", f"module_{t}.py is fixed."),
        ]
    items.append(message("user", "and now the tests"))
    return codex_request("s", items, stream=False)[0]


CLIENTS = {  # client: (render path, body builder, yesterday, today)
    "opencode": ("/v1/chat/completions", opencode_body, YESTERDAY, TODAY),
    "codex": ("/v1/responses", codex_body, CODEX_YESTERDAY, CODEX_TODAY),
}


def render_client(tokenizer: Tokenizer, template: ChatTemplate) -> TestClient:
    engine = ScriptedEngine(tokenizer, max_model_len=1 << 20)
    app = build_app(engine, tokenizer, model_name="m", chat_template=template)
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> tuple[Tokenizer, ChatTemplate]:
    out = write_tokenizer_dir(SMOLLM2, tmp_path_factory.mktemp("smollm2"))
    template = ChatTemplate.from_model_dir(out)
    assert template is not None
    return Tokenizer.from_file(str(Path(out) / "tokenizer.json")), template


@pytest.fixture(params=["tiny-llama", pytest.param("smollm2", marks=needs_smollm2)])
def model(request, tiny_tokenizer, tiny_template) -> Iterator[tuple[str, Tokenizer, TestClient]]:
    """The tiny model's Qwen-style template (tools after the system prompt) and SmolLM2's
    own template (plain ChatML, which renders no tools)."""
    if request.param == "tiny-llama":
        tokenizer, template = tiny_tokenizer, tiny_template
    else:
        tokenizer, template = request.getfixturevalue("smollm2")
    with render_client(tokenizer, template) as c:
        yield request.param, tokenizer, c


def render(client: TestClient, path: str, body: dict[str, Any]) -> list[int]:
    r = client.post(f"{path}/render", json=body)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


@pytest.mark.parametrize("client_name", CLIENTS)
def test_a_date_change_breaks_the_prompt_at_the_date_and_the_date_is_kept(model,
                                                                           client_name) -> None:
    model_name, tokenizer, client = model
    path, build, yesterday, today = CLIENTS[client_name]
    print(f"\n{client_name} on {model_name}: turns, prompt tokens, first differing token, "
          "tokens to recompute (share of the prompt)")
    for turns in TURNS:
        before = render(client, path, build(yesterday, turns))
        after = render(client, path, build(today, turns))
        text = tokenizer.decode(after, skip_special_tokens=False)
        # the model sees the client's date as sent: the engine rewrites nothing
        assert today in text and yesterday not in text
        assert tokenizer.decode(before, skip_special_tokens=False) == text.replace(
            today, yesterday)
        # the break is at the date: what precedes it is all the text before the date (but
        # for the token the date's first characters may share with it), no earlier
        brk = first_difference(before, after)
        head = tokenizer.decode(after[:brk], skip_special_tokens=False)
        date_at = text.index(today)
        assert text.startswith(head) and date_at - len(head) <= 16, (model_name, head[-40:])
        recompute = len(after) - brk
        print(f"  {turns:3d} {len(after):7d} {brk:7d} {recompute:7d} "
              f"({recompute / len(after):.0%})")


def test_the_first_request_after_midnight_logs_and_counts_one_prefix_break(
        tiny_tokenizer, tiny_template) -> None:
    """The date's cost is not silent: the session's first request with the new date is a
    `prefix_break` at the date's token (logged, counted in deepinfer_prefix_breaks_total,
    kept for `deepinfer-inspect cache`), and the next request extends it again."""
    engine = ScriptedEngine(tiny_tokenizer, max_model_len=1 << 16)
    app = build_app(engine, tiny_tokenizer, model_name="m", chat_template=tiny_template)
    metrics = app.state.shim.metrics
    headers = {"x-session-id": "ses_opencode"}
    with TestClient(app, raise_server_exceptions=False) as client:
        def turn(body: dict[str, Any]) -> dict[str, Any]:
            engine.script("done.")
            r = client.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            return {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}

        late = opencode_body(YESTERDAY, 4)
        answer = turn(late)
        assert metrics.recent_prefix_breaks == deque()
        # after midnight opencode resends the conversation with today's date
        morning = opencode_body(TODAY, 4)
        morning["messages"] += [answer, {"role": "user", "content": "good morning"}]
        expected = first_difference(render(client, "/v1/chat/completions", late),
                                    render(client, "/v1/chat/completions", morning))
        answer = turn(morning)
        [report] = metrics.recent_prefix_breaks
        assert report.session == "m|ses_opencode"  # the model's name keys its sessions
        assert report.num_common_tokens == expected
        assert metrics.registry.get_sample_value("deepinfer_prefix_breaks_total") == 1
        morning["messages"] += [answer, {"role": "user", "content": "next"}]
        turn(morning)
        assert metrics.registry.get_sample_value("deepinfer_prefix_breaks_total") == 1
