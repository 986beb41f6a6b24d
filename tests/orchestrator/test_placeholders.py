"""Content a text model cannot read: images, documents, audio and files become stable
text placeholders (the same bytes, the same text; so a session with a screenshot keeps
hitting the cache), `--on-image reject` keeps the 400, known Anthropic block types the
engine cannot act on become placeholders, unknown ones are a 400 naming the type; in
both chat APIs, on scripted engine outputs."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from orchestrator.shim.errors import ApiError
from orchestrator.shim.placeholders import (
    Replaced,
    anthropic_readable,
    block_text,
    media_text,
    openai_readable,
)
from tests.orchestrator.scripted_engine import ScriptedEngine
from tests.orchestrator.test_anthropic_api import assert_error, make_client, post

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(200))  # bytes are bytes: no decoder looks at them
OTHER_PNG = PNG[:-1] + b"\x00"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def image(data: bytes = PNG, **extra: Any) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": b64(data)}, **extra}


def user(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


@pytest.fixture
def engine(tiny_tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tiny_tokenizer, max_model_len=4096)


@pytest.fixture
def client(engine, tiny_tokenizer, tiny_template) -> Iterator[TestClient]:
    with make_client(engine, tiny_tokenizer, tiny_template) as c:
        yield c


def prompt_of(engine: ScriptedEngine, i: int = -1) -> str:
    return engine.tokenizer.decode(engine.requests[i].prompt_token_ids, skip_special_tokens=False)


def unsupported_count(client: TestClient, kind: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'deepinfer_unsupported_blocks_total{{type="{kind}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# --- the placeholder text ------------------------------------------------------------------


def test_the_wording_is_stable_and_the_digest_follows_the_bytes() -> None:
    """The exact text is a promise: changing it would miss every cached session once."""
    assert media_text("image", "image/png", b"abc") == (
        "[image: image/png, 3 bytes, sha256 ba7816bf8f01; this model reads text only]")
    assert media_text("image", "image/png", PNG) == media_text("image", "image/png", PNG)
    assert media_text("image", "image/png", PNG) != media_text("image", "image/png", OTHER_PNG)
    assert block_text("server_tool_use", "web_search") == (
        "[server_tool_use: web_search; not available on this server]")
    assert block_text("redacted_thinking") == "[redacted_thinking; not available on this server]"


def test_anthropic_blocks_by_kind() -> None:
    body = {"system": [text("sys")], "messages": [
        user(image(), text("what is this?")),
        {"role": "assistant", "content": [
            {"type": "redacted_thinking", "data": "ZW5j"},
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
             "input": {"query": "x"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
            {"type": "fallback", "from": {}, "to": {}},
            {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a.png"}}]},
        user({"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            image(OTHER_PNG, cache_control={"type": "ephemeral"}),
            {"type": "tool_reference", "tool_name": "Grep"}]},
             {"type": "image", "source": {"type": "url", "url": "https://x/a.png"}},
             {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                             "data": "plain words"}},
             {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                             "data": b64(b"%PDF-1.7")}},
             {"type": "compaction", "content": "summary of earlier turns"}),
    ]}
    out, replaced = anthropic_readable(body)
    m = out["messages"]
    assert m[0]["content"] == [text(media_text("image", "image/png", PNG)), text("what is this?")]
    assert m[1]["content"] == [
        {"type": "thinking", "thinking": "[redacted_thinking; not available on this server]"},
        text("[server_tool_use: web_search; not available on this server]"),
        text("[web_search_tool_result; not available on this server]"),
        body["messages"][1]["content"][4]]  # fallback dropped, as Anthropic renders it
    result = m[2]["content"][0]["content"]
    assert result == [{"type": "text", "text": media_text("image", "image/png", OTHER_PNG),
                       "cache_control": {"type": "ephemeral"}},  # the marker moves with it
                      text("[tool_reference: Grep; not available on this server]")]
    assert m[2]["content"][1]["text"].startswith("[image: url, sha256 ")
    assert m[2]["content"][2:] == [text("plain words"), text(
        media_text("document", "application/pdf", b"%PDF-1.7")), text("summary of earlier turns")]
    assert [(r.kind, r.where, r.media) for r in replaced] == [
        ("image", "messages.0.content.0", True),
        ("redacted_thinking", "messages.1.content.0", False),
        ("server_tool_use", "messages.1.content.1", False),
        ("web_search_tool_result", "messages.1.content.2", False),
        ("image", "messages.2.content.0.content.0", True),
        ("tool_reference", "messages.2.content.0.content.1", False),
        ("image", "messages.2.content.1", True),
        ("document", "messages.2.content.3", True)]
    assert body["messages"][0]["content"][0]["type"] == "image"  # the client's body unchanged
    assert out["system"] == body["system"]


@pytest.mark.parametrize("block, fragment", [
    ({"type": "nope"}, 'messages.0.content.0.type: unknown content block type "nope"'),
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@"}},
     "messages.0.content.0.source.data: the data is not valid base64"),
    ({"type": "image", "source": {"type": "base64", "data": "AAAA"}}, "source.media_type"),
    ({"type": "image", "source": {"type": "ftp"}}, "messages.0.content.0.source: Input should"),
    ({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "video"}]},
     'messages.0.content.0.content.0.type: unknown content block type "video"'),
])
def test_anthropic_bad_blocks(block, fragment) -> None:
    with pytest.raises(ApiError) as err:
        anthropic_readable({"messages": [user(block)]})
    assert fragment in err.value.message and err.value.status == 400


def test_openai_parts_by_kind() -> None:
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(PNG)}"}},
        {"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}},
        {"type": "input_audio", "input_audio": {"data": b64(b"RIFF"), "format": "wav"}},
        {"type": "file", "file": {"file_data": f"data:application/pdf;base64,{b64(b'%PDF')}",
                                  "filename": "a.pdf"}},
        {"type": "file", "file": {"file_id": "file-abc"}}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
        {"role": "user", "content": "plain"}]
    out, replaced = openai_readable(messages)
    parts = [p["text"] for p in out[0]["content"]]
    assert parts[0] == "look"
    assert parts[1] == media_text("image", "image/png", PNG)  # as Anthropic's, byte for byte
    assert parts[2].startswith("[image: url, sha256 ")
    assert parts[3] == media_text("audio", "audio/wav", b"RIFF")
    assert parts[4] == media_text("file", "application/pdf", b"%PDF")
    assert parts[5].startswith("[file: file, sha256 ")
    assert out[1]["content"] == [{"type": "text", "text": "I cannot."}]
    assert out[2] == messages[2]
    assert [r.kind for r in replaced] == ["image", "image", "audio", "file", "file"]
    assert replaced[0] == Replaced("image", "'messages[0].content[1]'", True)
    with pytest.raises(ApiError, match="unknown content part type \"nope\""):
        openai_readable([{"role": "user", "content": [{"type": "nope"}]}])


# --- through the API -------------------------------------------------------------------------


def test_an_image_in_the_history_is_served_and_its_prefix_is_stable(client, engine) -> None:
    before = unsupported_count(client, "image")
    history = [user(image(), text("what is in this screenshot?"))]
    for _ in range(2):
        engine.script("A chart.")
        assert post(client, {"messages": history}).status_code == 200
    first, second = engine.requests
    assert first.prompt_token_ids == second.prompt_token_ids  # same bytes, same prompt
    assert media_text("image", "image/png", PNG) in prompt_of(engine)
    engine.script("ok")
    other = [user(image(OTHER_PNG), text("what is in this screenshot?"))]
    assert post(client, {"messages": other}).status_code == 200
    assert engine.requests[2].prompt_token_ids != first.prompt_token_ids
    assert unsupported_count(client, "image") == before + 3
    # count_tokens sees the same prompt
    r = client.post("/v1/messages/count_tokens", json={"model": "m", "messages": history})
    assert r.json()["input_tokens"] == len(first.prompt_token_ids)


def test_on_image_reject_keeps_the_400(engine, tiny_tokenizer, tiny_template) -> None:
    with make_client(engine, tiny_tokenizer, tiny_template, on_image="reject") as c:
        for stream in (False, True):
            r = post(c, {"stream": stream, "messages": [user(
                text("hi"), {"type": "tool_result", "tool_use_id": "t", "content": [image()]})]})
            msg = assert_error(r, 400, "invalid_request_error")
            assert msg.startswith("messages.0.content.1.content.0: image content is not "
                                  "supported")
        r = c.post("/v1/messages/count_tokens", json={"model": "m", "messages": [user(image())]})
        assert_error(r, 400, "invalid_request_error")
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": [{
            "role": "user", "content": [{"type": "image_url", "image_url": {
                "url": "https://x/a.png"}}]}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "image content is not supported" in r.json()["error"]["message"]
        # what is no media still passes: a known block the engine cannot act on, text docs
        engine.script("ok")
        r = post(c, {"messages": [user({"type": "search_result", "source": "s", "title": "t",
                                        "content": [text("x")]},
                                       {"type": "document", "source": {
                                           "type": "text", "media_type": "text/plain",
                                           "data": "words"}})]})
        assert r.status_code == 200, r.text
    assert len(engine.requests) == 1


def test_unknown_block_type_is_a_400_naming_it(client, engine) -> None:
    for stream in (False, True):
        r = post(client, {"stream": stream, "messages": [user(text("hi"), {"type": "nope"})]})
        msg = assert_error(r, 400, "invalid_request_error")
        assert msg == 'messages.0.content.1.type: unknown content block type "nope"'
    assert engine.requests == []


def test_openai_chat_image_is_a_placeholder(client, engine) -> None:
    engine.script("ok")
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{
        "role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(PNG)}"}},
            {"type": "text", "text": "what is this?"}]}]})
    assert r.status_code == 200, r.text
    assert media_text("image", "image/png", PNG) + "\nwhat is this?" in prompt_of(engine)


# --- images whose bytes are not what they say --------------------------------------------

JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(100)
GIF = b"GIF89a" + bytes(100)
WEBP = b"RIFF\x64\x00\x00\x00WEBPVP8 " + bytes(100)


def typed_image(media_type: str, data: bytes) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                        "data": b64(data)}}


@pytest.mark.parametrize("media_type, data, message", [
    ("image/png", b"\0\0\0",  # "AAAA"
     "messages.0.content.0.source.data: Could not process image: the data is not a "
     "image/png image"),
    ("image/png", b"%PDF-1.7\n" + bytes(50),
     "messages.0.content.0.source.data: Could not process image: the data is not a "
     "image/png image"),
    ("image/png", JPEG,
     "messages.0.content.0.source: The image was specified using the image/png media type, "
     "but the image appears to be a image/jpeg image"),
    ("image/webp", GIF,
     "messages.0.content.0.source: The image was specified using the image/webp media "
     "type, but the image appears to be a image/gif image"),
    ("image/bmp", PNG,
     "messages.0.content.0.source.media_type: Input should be 'image/jpeg', 'image/png', "
     "'image/gif' or 'image/webp'"),
], ids=["zeros", "a-pdf", "jpeg-declared-png", "gif-declared-webp", "bmp"])
def test_anthropic_image_bytes_not_of_their_type_are_a_400(client, engine, media_type, data,
                                                           message) -> None:
    """As Anthropic answers: no placeholder for an image it could not read."""
    for stream in (False, True):
        r = post(client, {"stream": stream, "messages": [user(typed_image(media_type, data),
                                                              text("what is this?"))]})
        assert assert_error(r, 400, "invalid_request_error") == message
    r = client.post("/v1/messages/count_tokens", json={"model": "m", "messages": [user(
        typed_image(media_type, data))]})
    assert assert_error(r, 400, "invalid_request_error") == message
    # inside a tool result, as Claude Code's Read tool sends a screenshot
    r = post(client, {"messages": [user({"type": "tool_result", "tool_use_id": "t",
                                         "content": [typed_image(media_type, data)]})]})
    assert assert_error(r, 400, "invalid_request_error").startswith(
        "messages.0.content.0.content.0.source")
    assert engine.requests == []


@pytest.mark.parametrize("media_type, data", [
    ("image/png", PNG), ("image/jpeg", JPEG), ("image/gif", GIF), ("image/webp", WEBP)])
def test_anthropic_images_of_each_type_are_placeholders(client, engine, media_type,
                                                        data) -> None:
    engine.script("ok")
    r = post(client, {"messages": [user(typed_image(media_type, data), text("hi"))]})
    assert r.status_code == 200, r.text
    assert media_text("image", media_type, data) in prompt_of(engine)


@pytest.mark.parametrize("url", [
    "data:image/png;base64,AAAA",  # three zero bytes
    f"data:image/png;base64,{b64(b'%PDF-1.7')}",
    "data:image/png,not-an-image",
    "data:,",
], ids=["zeros", "a-pdf", "text", "empty"])
def test_openai_image_bytes_that_are_no_image_are_a_400(client, engine, url) -> None:
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{
        "role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                    {"type": "text", "text": "what is this?"}]}]})
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {
        "message": "'messages[0].content[0]': You uploaded an unsupported image. Please make "
                   "sure your image has one of the following formats: ['png', 'jpeg', "
                   "'gif', 'webp'].",
        "type": "invalid_request_error", "param": "messages", "code": "invalid_image_format"}}
    assert engine.requests == []


def test_openai_reads_an_images_bytes_whatever_its_label(client, engine) -> None:
    """OpenAI decodes the bytes (a JPEG labelled image/png is read as a JPEG): served."""
    for label, data in (("image/png", JPEG), ("image/jpg", JPEG), ("image/webp", WEBP)):
        engine.script("ok")
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{
            "role": "user", "content": [{"type": "image_url", "image_url": {
                "url": f"data:{label};base64,{b64(data)}"}}]}]})
        assert r.status_code == 200, r.text
        assert media_text("image", label, data) in prompt_of(engine)
