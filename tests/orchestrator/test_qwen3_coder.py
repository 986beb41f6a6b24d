"""The qwen3_coder tool-call parser on outputs shaped as Qwen3-Coder writes them (as its
chat template renders calls back): calls with typed values come out whole in any
chunking of the stream, a call that does not parse is the model's text, and a forced
call's grammar accepts exactly what the parser reads back as a call."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.shim.qwen3_coder import typed_value
from orchestrator.shim.structured_output import tool_call_grammar
from orchestrator.shim.tool_parsers import Event, TextEvent, ToolCall, make_tool_parser
from tests.orchestrator.test_structured_output import follows
from tests.orchestrator.test_tool_parsers import chunkings
from tests.orchestrator.test_tool_parsers import run as run_parser


def tool(name: str, properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties, "required": required or [], **extra}}}


TOOLS = [
    tool("Bash", {"command": {"type": "string"}, "timeout": {"type": "integer"},
                  "run_in_background": {"type": "boolean"}}, ["command"]),
    tool("Edit", {"file_path": {"type": "string"}, "old_string": {"type": "string"},
                  "new_string": {"type": "string"}, "replace_all": {"type": "boolean"}},
         ["file_path", "old_string", "new_string"]),
    tool("TodoWrite", {"todos": {"type": "array", "items": {"$ref": "#/$defs/todo"}}},
         ["todos"], **{"$defs": {"todo": {
             "type": "object", "properties": {"content": {"type": "string"},
                                              "status": {"enum": ["pending", "done"]}},
             "required": ["content", "status"], "additionalProperties": False}}}),
    tool("get_weather", {"city": {"type": "string"}, "days": {"type": ["integer", "null"]},
                         "scale": {"type": "number"}, "unit": {"enum": ["c", "f"]},
                         "options": {"type": "object"},
                         "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
         ["city"]),
    {"type": "function", "function": {"name": "Anything"}},  # no schema: any parameters
]


def call(name: str, **params: str) -> str:
    """A call as the template renders it (a value as str(value) or JSON)."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def run(chunks: list[str], tools: list[dict] = TOOLS) -> list[Event]:
    """Feed chunks; merge adjacent text events (chunking may split text anywhere)."""
    return run_parser("qwen3_coder", chunks, tools)


LS = call("Bash", command="ls -la")
OLD = "def f():\n    return 1\n"  # its trailing newline is the value's: kept
EDIT = call("Edit", file_path="/src/a.py", old_string=OLD, new_string="\ndef f():\n    return 2")

RECORDED = [
    ("single call", LS, [ToolCall("Bash", {"command": "ls -la"})]),
    ("text before (its trailing whitespace is the template's)",
     "I'll list the files first.\n\n" + LS,
     [TextEvent("I'll list the files first."), ToolCall("Bash", {"command": "ls -la"})]),
    ("several calls", LS + "\n" + call("Bash", command="pwd") + "\n",
     [ToolCall("Bash", {"command": "ls -la"}), ToolCall("Bash", {"command": "pwd"})]),
    ("multi-line strings: one newline each side is the format's", EDIT,
     [ToolCall("Edit", {"file_path": "/src/a.py", "old_string": OLD,
                        "new_string": "\ndef f():\n    return 2"})]),
    ("typed values", call("Bash", command="sleep 1", timeout="60000",
                          run_in_background="True") + call(
        "get_weather", city="Paris", days="null", scale="2.5", unit="c",
        options='{"lang": "fr", "hours": [9, 12]}', note="null") + call(
        "TodoWrite", todos='[{"content": "Run tests", "status": "pending"}]'),
     [ToolCall("Bash", {"command": "sleep 1", "timeout": 60000, "run_in_background": True}),
      ToolCall("get_weather", {"city": "Paris", "days": None, "scale": 2.5, "unit": "c",
                               "options": {"lang": "fr", "hours": [9, 12]}, "note": None}),
      ToolCall("TodoWrite", {"todos": [{"content": "Run tests", "status": "pending"}]})]),
    ("a value not of its type stays the text", call(
        "Bash", command="42", timeout="soon", run_in_background="yes") + call(
        "get_weather", city="null", days="1.5", scale="[1]", options="not json"),
     [ToolCall("Bash", {"command": "42", "timeout": "soon", "run_in_background": "yes"}),
      ToolCall("get_weather", {"city": "null", "days": "1.5", "scale": "[1]",
                               "options": "not json"})]),
    ("unknown parameter, unknown tool: text",
     call("Bash", command="ls", cwd="/tmp", depth="3") + call("Mystery", n="3"),
     [ToolCall("Bash", {"command": "ls", "cwd": "/tmp", "depth": "3"}),
      ToolCall("Mystery", {"n": "3"})]),
    ("no parameters; several functions in one tag; loose whitespace",
     "<tool_call><function=Anything></function></tool_call>"
     "<tool_call>\n<function=Anything>\n  <parameter=a>x</parameter>\n</function>\n"
     "<function=Bash>\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>",
     [ToolCall("Anything", {}), ToolCall("Anything", {"a": "x"}),
      ToolCall("Bash", {"command": "ls"})]),
    ("unterminated at finish, but whole: EOS before </tool_call>",
     "Sure.\n" + LS.removesuffix("\n</tool_call>") + "\n",
     [TextEvent("Sure."), ToolCall("Bash", {"command": "ls -la"})]),
    ("text after a call", LS + "\nDone.", [ToolCall("Bash", {"command": "ls -la"}),
                                           TextEvent("\nDone.")]),
    ("no calls", "Just text, with <tags> and <tool_ but no call.",
     [TextEvent("Just text, with <tags> and <tool_ but no call.")]),
]


@pytest.mark.parametrize("text, expected", [r[1:] for r in RECORDED], ids=[r[0] for r in RECORDED])
def test_recorded_outputs(text: str, expected: list[Event]) -> None:
    for chunks in chunkings(text):
        assert run(chunks) == expected, chunks


MALFORMED = [
    "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</function>\n</tool_call>",
    "<tool_call>\n<function=Bash>\nls\n<parameter=command>\nls\n</parameter>\n</function>\n"
    "</tool_call>",  # text between the elements
    "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n</tool_call>",
    "<tool_call>\n{\"name\": \"Bash\", \"arguments\": {}}\n</tool_call>",  # Hermes' JSON
    "<tool_call>\n</tool_call>",
    "Hi\n<tool_call>\n<function=Bash>\n<parameter=command>\nl",  # cut off by max_tokens
    "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n",  # no </function>
    call("Bash", command="echo \ud83d"),  # a lone surrogate: no response could carry it
    call("TodoWrite", todos="[" * 150 + "]" * 150),  # past json_body's depth limit
]


@pytest.mark.parametrize("bad", MALFORMED)
def test_a_malformed_call_is_the_models_text(bad: str) -> None:
    for chunks in chunkings(bad):
        assert run(chunks) == [TextEvent(bad)], chunks


def test_text_streams_before_the_call_completes() -> None:
    p = make_tool_parser("qwen3_coder", TOOLS)
    assert p.feed("Let me lo") == [TextEvent("Let me lo")]
    assert p.feed("ok.\n\n<tool") == [TextEvent("ok.")]  # "\n\n<tool" may start a call
    assert p.feed("_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n") == []
    assert p.feed("</function>\n</tool_call>") == [ToolCall("Bash", {"command": "ls"})]
    assert p.feed("\n") == [] and p.finish() == []


@pytest.mark.parametrize("text, schema, value", [
    ("7", {"type": "integer"}, 7), ("-7", {"type": "number"}, -7), ("7.5", {"type": "integer"},
                                                                     "7.5"),
    ("1e3", {"type": "number"}, 1000.0), ("NaN", {"type": "number"}, "NaN"),
    ("FALSE", {"type": "boolean"}, False), ("true", {"type": "string"}, "true"),
    ("null", {"type": "string"}, "null"), ("null", {"type": "integer"}, None),
    ('"quoted"', {"type": ["string", "integer"]}, '"quoted"'),
    ("3", {"type": ["string", "integer"]}, 3), ("3", {"oneOf": [{"type": "array"}]}, "3"),
    ("[3]", {"oneOf": [{"type": "array"}]}, [3]), ("2", {"enum": [1, 2]}, 2),
    ("2", {"enum": ["1", "2"]}, "2"), ("{}", {"type": "object"}, {}), ("{}", None, "{}"),
    ("[" * 5000 + "]" * 5000, {"type": "array"}, "[" * 5000 + "]" * 5000),
])
def test_typed_value(text: str, schema, value) -> None:
    assert typed_value(text, schema) == value and type(typed_value(text, schema)) is type(value)


# --- any chunking gives the same events as the whole (property) -----------------------

PIECES = ["<tool_call>", "</tool_call>", "<function=Bash>", "<function=get_weather>",
          "</function>", "<parameter=command>", "<parameter=days>", "<parameter=options>",
          "</parameter>", "\n", "\n\n", " ", "ls -la", "42", '{"a": 1}', "null", "True", "<",
          "</", "<tool_", "<function=", "text", "é"]
WHOLE_CALLS = [LS, EDIT, call("get_weather", city="Rome", days="3", options="{}")]


@st.composite
def outputs(draw) -> str:
    """Fragments of the format in any order (often malformed), and whole calls."""
    parts = draw(st.lists(st.one_of(st.sampled_from(PIECES), st.sampled_from(WHOLE_CALLS),
                                    st.text(max_size=4)), max_size=24))
    return "".join(parts)


@settings(max_examples=300, deadline=None)
@given(text=outputs(), cuts=st.lists(st.integers(0, 2000), max_size=8))
def test_any_chunking_gives_the_events_of_the_whole(text: str, cuts: list[int]) -> None:
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    whole = run([text])
    assert run(chunks) == whole
    # without a call, the text out is exactly the model's
    out = "".join(e.text for e in whole if isinstance(e, TextEvent))
    if not any(isinstance(e, ToolCall) for e in whole):
        assert out == text


# --- tool_choice: the forced opening and its grammar -----------------------------------


def test_a_forced_opening_is_read_as_the_start_of_the_call() -> None:
    p = make_tool_parser("qwen3_coder", TOOLS)
    assert p.opening("Bash") == "<tool_call>\n<function=Bash>\n"
    assert p.feed(p.opening("Bash")) == []
    assert p.feed("<parameter=command>\nls\n</parameter>\n</function>") == []
    assert p.finish() == [ToolCall("Bash", {"command": "ls"})]
    q = make_tool_parser("qwen3_coder", TOOLS)
    assert q.feed(q.opening(None)) == [] and q.feed("oops") + q.finish() == [
        TextEvent("<tool_call>\n<function=oops")]


FORCED = [  # (tool, the answer after "<tool_call>\n<function=", the call it is, allowed)
    ("Bash", "Bash>\n<parameter=command>\nls -la\n</parameter>\n</function>",
     {"command": "ls -la"}, True),
    ("Bash", "Bash>\n<parameter=command>\ncd /\nls\n\n</parameter>\n<parameter=timeout>\n5\n"
     "</parameter>\n<parameter=run_in_background>\nfalse\n</parameter>\n</function>",
     {"command": "cd /\nls\n", "timeout": 5, "run_in_background": False}, True),
    ("Bash", "Bash>\n<parameter=command>\n\n</parameter>\n</function>", {"command": ""}, True),
    ("Bash", "Bash>\n<parameter=timeout>\n5\n</parameter>\n</function>", None, False),  # required
    ("Bash", "Bash>\n<parameter=command>\nls\n</parameter>\n<parameter=timeout>\nsoon\n"
     "</parameter>\n</function>", None, False),  # not an integer
    ("Bash", "Bash>\n<parameter=command>\na</parameter>b\n</parameter>\n</function>", None,
     False),  # a value holding the closing tag
    ("TodoWrite", 'TodoWrite>\n<parameter=todos>\n[{"content": "x", "status": "done"}]\n'
     "</parameter>\n</function>", {"todos": [{"content": "x", "status": "done"}]}, True),
    ("TodoWrite", 'TodoWrite>\n<parameter=todos>\n[{"content": "x", "status": "later"}]\n'
     "</parameter>\n</function>", None, False),  # held to the $defs the schema refers to
    ("get_weather", "get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n"
     "f\n</parameter>\n</function>", {"city": "Paris", "unit": "f"}, True),
    ("get_weather", "get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n"
     "k\n</parameter>\n</function>", None, False),
    ("Anything", "Anything>\n<parameter=x>\n1\n</parameter>\n</function>", {"x": "1"}, True),
    ("Anything", "Anything>\n</function>", {}, True),
]


@pytest.mark.parametrize("named", [True, False])
@pytest.mark.parametrize("name, rest, arguments, allowed", FORCED)
def test_a_forced_call_grammar_accepts_exactly_a_call(guides, tiny_tokenizer, named, name,
                                                      rest, arguments, allowed) -> None:
    p = make_tool_parser("qwen3_coder", TOOLS)
    opening = p.opening(name if named else None)
    assert p.call_format == "xml"
    grammar = tool_call_grammar(TOOLS, name if named else None, p.opening, p.call_format)
    answer = (p.opening(None) + rest)[len(opening):]
    assert follows(guides, grammar, tiny_tokenizer, answer) == allowed, answer
    if allowed:
        reader = make_tool_parser("qwen3_coder", TOOLS)
        assert reader.feed(opening) == []
        assert reader.feed(answer) + reader.finish() == [ToolCall(name, arguments)]


def test_a_forced_call_names_only_the_requests_tools(guides, tiny_tokenizer) -> None:
    p = make_tool_parser("qwen3_coder", TOOLS)
    grammar = tool_call_grammar(TOOLS, None, p.opening, p.call_format)
    assert not follows(guides, grammar, tiny_tokenizer, "Other>\n</function>")
    assert follows(guides, grammar, tiny_tokenizer, "Anything>\n</function>")


# --- the real engine under the grammar -------------------------------------------------

PICK = [tool("Pick", {"color": {"enum": ["red", "green", "blue"]},
                      "n": {"type": "integer", "minimum": 1, "maximum": 9},
                      "ok": {"type": "boolean"}}, ["color", "n", "ok"],
             additionalProperties=False),
        tool("Done", {}, additionalProperties=False)]


@pytest.mark.slow  # the engine's start: seconds alone, a minute on a loaded 2-core machine
def test_the_random_model_writes_a_forced_call_the_parser_reads(default_model,
                                                                tiny_tokenizer) -> None:
    """The scheduler masks the random-weight model's tokens with the grammar (greedy and
    sampled): its answer, after the opening, is a call the parser reads whole (the
    grammar's end is `</function>`, then EOS: no closing tag)."""
    from tests.scheduler.engine_harness import inprocess_engine, run_until_done
    from wire.client import GenerateRequest, SamplingParams

    requests, openings = [], {}
    for name, seed in (("Pick", None), (None, 1)):
        p = make_tool_parser("qwen3_coder", PICK)
        grammar = tool_call_grammar(PICK, name, p.opening, p.call_format)
        prompt = tiny_tokenizer.encode("<|im_start|>user\nPick one.<|im_end|>\n"
                                       "<|im_start|>assistant\n" + p.opening(name)).ids
        rid = f"{name}-{seed}"
        openings[rid] = p.opening(name)
        sampling = SamplingParams() if seed is None else SamplingParams(temperature=1.0,
                                                                        seed=seed)
        requests.append(GenerateRequest(rid, prompt, max_tokens=48, grammar=grammar,
                                        sampling=sampling))
    out = run_until_done(inprocess_engine(default_model, full_cache_check_every=0), requests)
    for rid, opening in openings.items():
        assert out[rid]["finish_reason"] == "stop", out[rid]
        reader = make_tool_parser("qwen3_coder", PICK)
        text = tiny_tokenizer.decode(out[rid]["tokens"])
        [event] = reader.feed(opening) + reader.feed(text) + reader.finish()
        assert isinstance(event, ToolCall), text
        if event.name == "Pick":
            args = event.arguments
            assert set(args) == {"color", "n", "ok"} and args["color"] in ("red", "green", "blue")
            assert type(args["n"]) is int and 1 <= args["n"] <= 9 and type(args["ok"]) is bool
        else:
            assert rid.startswith("None") and (event.name, event.arguments) == ("Done", {})
