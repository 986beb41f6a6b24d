"""Responses API bodies -> chat requests, without an engine: item conversion, tools and
namespaces, what never reaches the prompt, and bad input as 400s in OpenAI's words."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from orchestrator.shim.errors import ApiError
from orchestrator.shim.responses_request import parse_responses_request
from tests.orchestrator.codex_body import codex_request, first_turn, message

CALL = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "exec_command",
        "arguments": '{"cmd": "ls"}', "status": "completed"}
OUTPUT = {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "a.py"}


def parse(body: dict[str, Any], headers: dict[str, str] | None = None):
    return parse_responses_request(body, headers or {})


def test_codex_first_request() -> None:
    body, headers = codex_request("sess-1")
    req = parse(body, headers)
    chat = req.chat
    assert [m["role"] for m in chat.messages] == ["system", "user", "user"]  # developer: system
    assert chat.messages[2]["content"] == "fix the failing test"
    assert chat.session == "gpt-5-codex|sess-1" and req.session_source == "prompt_cache_key"
    assert chat.delivery.stream and chat.max_tokens is None  # the server's default limit
    names = [t["function"]["name"] for t in chat.tools]
    assert names == ["exec_command", "update_plan", "codex_apps.search", "codex_apps.fetch",
                     "codex_apps.list", "codex_apps.open", "codex_apps.close"]
    assert req.call_name("codex_apps.fetch") == ("fetch", "codex_apps")
    assert req.call_name("exec_command") == ("exec_command", None)
    assert chat.tool_choice.mode == "auto" and chat.tool_choice.parallel


def test_session_from_the_header_without_prompt_cache_key() -> None:
    body, headers = codex_request("sess-2")
    del body["prompt_cache_key"]
    req = parse(body, headers)
    assert (req.chat.session, req.session_source) == ("gpt-5-codex|sess-2", "session-id")
    req = parse(body, {})
    assert req.session_source == "none" and req.chat.session.startswith("gpt-5-codex|conv-")


def test_item_ids_and_extra_fields_never_reach_the_messages() -> None:
    """Two sessions' first requests differ in item ids (and any other field the model
    does not read): the same messages."""
    one, _ = codex_request("a")
    two = copy.deepcopy(one)
    for item in two["input"]:
        item["id"] = "msg_other"
        item["status"] = "completed"
        item["x_future_field"] = {"anything": [1, 2]}
        for part in item["content"]:
            part["annotations"], part["logprobs"] = [], []
    assert parse(one).chat.messages == parse(two).chat.messages


def test_an_answer_round_trips_to_one_assistant_message() -> None:
    """reasoning, message and function_call of one answer: one assistant message, as the
    chat API sends it; the call's output: a tool message."""
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "look first"}],
                 "encrypted_content": None}
    said = message("assistant", "Listing.", phase="commentary")
    items = [*first_turn("go"), reasoning, said, CALL, OUTPUT]
    chat = parse({"model": "m", "input": items}).chat
    assistant, tool = chat.messages[-2:]
    assert assistant == {"role": "assistant", "content": "Listing.",
                         "reasoning_content": "look first",
                         "tool_calls": [{"id": "call_1", "type": "function", "function": {
                             "name": "exec_command", "arguments": {"cmd": "ls"}}}]}
    assert tool == {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}


def test_reasoning_summary_when_no_content_and_nothing_when_encrypted_only() -> None:
    summary = {"type": "reasoning", "id": "rs_1",
               "summary": [{"type": "summary_text", "text": "plan"}]}
    encrypted = {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "xyz"}
    chat = parse({"model": "m", "input": [message("user", "hi"), summary, CALL]}).chat
    assert chat.messages[-1]["reasoning_content"] == "plan"
    chat = parse({"model": "m", "input": [message("user", "hi"), encrypted,
                                          message("assistant", "ok")]}).chat
    assert chat.messages[-1] == {"role": "assistant", "content": "ok"}


def test_namespaced_call_renders_as_the_model_named_it() -> None:
    call = {**CALL, "name": "fetch", "namespace": "codex_apps"}
    chat = parse({"model": "m", "input": [message("user", "hi"), call, OUTPUT]}).chat
    assert chat.messages[1]["tool_calls"][0]["function"]["name"] == "codex_apps.fetch"


def test_plain_string_input_instructions_and_short_messages() -> None:
    chat = parse({"model": "m", "instructions": "Be brief.", "input": "hi"}).chat
    assert chat.messages == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "hi"}]
    chat = parse({"model": "m", "input": [{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": [
                                              {"type": "output_text", "text": "yo"}]}]}).chat
    assert chat.messages == [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "yo"}]


def test_forced_tool_choice_and_options() -> None:
    body, _ = codex_request("s")
    body.update(tool_choice={"type": "function", "name": "fetch", "namespace": "codex_apps"},
                parallel_tool_calls=False, max_output_tokens=7, temperature=0,
                cache_salt="tenant-a", store=True)
    chat = parse(body).chat
    assert (chat.tool_choice.mode, chat.tool_choice.name) == ("named", "codex_apps.fetch")
    assert not chat.tool_choice.parallel
    assert (chat.max_tokens, chat.sampling.temperature, chat.cache_salt) == (7, 0.0, "tenant-a")
    body["tool_choice"] = {"type": "function", "name": "exec_command"}
    assert parse(body).chat.tool_choice.name == "exec_command"


def test_hosted_tools_are_left_out() -> None:
    req = parse({"model": "m", "input": "hi", "tools": [
        {"type": "web_search"}, {"type": "custom", "name": "apply_patch"},
        {"type": "function", "name": "f"}]})
    assert [t["function"]["name"] for t in req.chat.tools] == ["f"]
    assert req.tools_left_out == ["web_search", "custom"]


def test_cache_control_marks() -> None:
    items = [message("user", "one"), {**message("user", "two"),
                                      "cache_control": {"type": "ephemeral"}},
             message("user", "three")]
    chat = parse({"model": "m", "instructions": "sys", "input": items}).chat
    assert [(m.num_messages, m.ttl_s) for m in chat.retention_marks] == [(3, 300.0)]


BAD = {  # name: (change to a valid body, the param the error names, words in its message)
    "unknown_item_type": (lambda b: b["input"].append({"type": "web_search_call"}),
                          "input", "unsupported input item type"),
    "output_without_call": (lambda b: b["input"].append(OUTPUT), "input",
                            "no function_call with call_id 'call_1'"),
    "non_json_arguments": (lambda b: b["input"].append({**CALL, "arguments": "{cmd: ls"}),
                           "input", "not valid JSON"),
    "arguments_not_an_object": (lambda b: b["input"].append({**CALL, "arguments": "[1]"}),
                                "input", "must be a JSON object"),
    "arguments_as_object": (lambda b: b["input"].append({**CALL, "arguments": {"cmd": "ls"}}),
                            "input", "must be a string"),
    "call_without_call_id": (lambda b: b["input"].append({**CALL, "call_id": None}),
                             "input", "call_id"),
    "unknown_role": (lambda b: b["input"].append({"role": "wizard", "content": "hi"}),
                     "input", "role"),
    "unknown_part": (lambda b: b["input"].append(
        {"role": "user", "content": [{"type": "input_video", "url": "x"}]}), "input",
        "unknown content part type"),
    "item_not_object": (lambda b: b["input"].append("hi"), "input", "must be an object"),
    "empty_input": (lambda b: b.update(input=[]), "input", "non-empty"),
    "input_number": (lambda b: b.update(input=5), "input", "non-empty"),
    "item_reference": (lambda b: b["input"].append({"type": "item_reference", "id": "x"}),
                       "input", "not keep"),
    "previous_response_id": (lambda b: b.update(previous_response_id="resp_1"),
                             "previous_response_id", "not stored"),
    "conversation": (lambda b: b.update(conversation="conv_1"), "conversation", "not stored"),
    "background": (lambda b: b.update(background=True), "background", "not supported"),
    "unknown_tool_type": (lambda b: b["tools"].append({"type": "teleport"}), "tools",
                          "unsupported tool type"),
    "tool_without_name": (lambda b: b["tools"].append({"type": "function"}), "tools", "name"),
    "namespace_without_tools": (lambda b: b["tools"].append({"type": "namespace", "name": "n"}),
                                "tools", "namespace"),
    "duplicate_tool": (lambda b: b["tools"].append(b["tools"][0]), "tools", "two tools"),
    "strict_not_bool": (lambda b: b["tools"].append({"type": "function", "name": "g",
                                                     "strict": "yes"}), "tools", "strict"),
    "tool_choice_unknown_tool": (lambda b: b.update(tool_choice={"type": "function",
                                                                 "name": "nope"}),
                                 "tool_choice", "no tool named"),
    "tool_choice_shape": (lambda b: b.update(tool_choice={"type": "allowed_tools"}),
                          "tool_choice", "must be"),
    "max_output_tokens_string": (lambda b: b.update(max_output_tokens="5"),
                                 "max_output_tokens", "positive integer"),
    "stream_string": (lambda b: b.update(stream="yes"), "stream", "boolean"),
    "temperature_range": (lambda b: b.update(temperature=3), "temperature", "[0, 2]"),
    "instructions_list": (lambda b: b.update(instructions=["x"]), "instructions", "string"),
    "prompt_cache_key_number": (lambda b: b.update(prompt_cache_key=5), "prompt_cache_key",
                                "string"),
    "text_format": (lambda b: b.update(text={"format": {"type": "yaml"}}), "text", "format"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_400_naming_the_field(case) -> None:
    change, param, words = BAD[case]
    body, headers = codex_request("s")
    body = copy.deepcopy(body)
    change(body)
    with pytest.raises(ApiError) as info:
        parse(body, headers)
    err = info.value
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param), err.body()
    assert words in err.message, err.message
