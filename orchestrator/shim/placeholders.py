"""What a text model cannot read, turned into short stable text before a chat request is
converted (anthropic_request, openai_request).

A screenshot stays in an agent's history: refusing it with a 400 would fail every later
turn of that session, for good. So by default each image, document, audio clip or file
becomes one line naming what it was:

    [image: image/png, 48213 bytes, sha256 1a2b3c4d5e6f; this model reads text only]
    [image: url, sha256 1a2b3c4d5e6f; this model reads text only]   (the URL's digest)

The same bytes always give the same line, so whatever follows still extends the cached
prefix. `--on-image reject` refuses them instead (`check_replaced`). An image whose bytes
are none of the types the APIs read (png, jpeg, gif, webp), or for Anthropic not the type
its block declares, is the 400 the real API answers (image_types.py): a placeholder would
serve what the API refuses. Anthropic block types the engine cannot act on (server tools'
calls and results, redacted thinking, search results, ...) become `[server_tool_use:
web_search; not available on this server]`, a `fallback` marker is dropped (Anthropic
does not render it either), and a type nobody knows is a 400 naming it, as Anthropic
answers: dropping it would change the prompt without a word. Text a block carries in
plain form (a plain-text document, a compaction summary) is kept as text.

    body, replaced = anthropic_readable(body)
    messages, replaced = openai_readable(messages)
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import structlog

from orchestrator.shim.errors import ApiError
from orchestrator.shim.image_types import IMAGE_TYPES, sniff_image
from orchestrator.shim.state import ServerState
from orchestrator.shim.validate import describe, invalid

log = structlog.get_logger()

MEDIA_NOTE = "this model reads text only"
BLOCK_NOTE = "not available on this server"
DIGEST_CHARS = 12  # of sha256 hex: tells blocks apart in a prompt, not a security boundary
MAX_NAME_CHARS = 64  # a tool name shown in a placeholder

# Anthropic content block types, by what happens to them. The converter reads HANDLED;
# MEDIA follow --on-image; PLACEHOLDER are known types this engine cannot act on.
ANTHROPIC_HANDLED = frozenset({"text", "thinking", "tool_use", "tool_result"})
ANTHROPIC_MEDIA = frozenset({"image", "document"})
ANTHROPIC_PLACEHOLDER = frozenset({
    "redacted_thinking", "server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
    "code_execution_tool_result", "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result", "tool_search_tool_result",
    "advisor_tool_result", "mcp_tool_use", "mcp_tool_result", "mcp_tool_listing",
    "container_upload", "search_result", "tool_reference", "browser_state",
    "tool_addition", "tool_removal", "compaction",
})
ANTHROPIC_DROPPED = frozenset({"fallback"})
# OpenAI chat content part types: text parts are read; the others follow --on-image.
OPENAI_TEXT = frozenset({"text", "input_text"})
OPENAI_MEDIA = {"image_url": "image", "input_audio": "audio", "file": "file"}

_DATA_URL = re.compile(r"data:(?P<type>[^,;]*)(?P<params>(?:;[^,;]*)*),", re.S)


@dataclass(frozen=True)
class Replaced:
    """One block of a request that was replaced by a placeholder."""

    kind: str  # "image", "document", "audio", "file", or the Anthropic block type
    where: str  # the field, as the API's errors name it: "messages.3.content.0"
    media: bool  # an image, document, audio clip or file: what --on-image reject refuses


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:DIGEST_CHARS]


def media_text(kind: str, media_type: str, data: bytes) -> str:
    return f"[{kind}: {media_type}, {len(data)} bytes, sha256 {digest(data)}; {MEDIA_NOTE}]"


def reference_text(kind: str, by: str, reference: str) -> str:
    """A file given by URL or id: its bytes are not here, so the reference's digest."""
    return f"[{kind}: {by}, sha256 {digest(reference.encode())}; {MEDIA_NOTE}]"


def block_text(kind: str, name: Any = None) -> str:
    shown = f": {name[:MAX_NAME_CHARS]}" if isinstance(name, str) and name else ""
    return f"[{kind}{shown}; {BLOCK_NOTE}]"


def decode_base64(data: Any, where: str) -> bytes:
    if not isinstance(data, str):
        raise invalid(f"{where}: Input should be a base64 string", "messages")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{where}: the data is not valid base64", "messages") from None


def check_replaced(state: ServerState, replaced: list[Replaced], session: str = "") -> None:
    """--on-image: `reject` refuses a request with media in it (400, naming the first);
    `placeholder` (the default) lets it through, counted per type and logged."""
    if not replaced:
        return
    media = [r for r in replaced if r.media]
    if media and state.options.on_image == "reject":
        first = media[0]
        raise invalid(f"{first.where}: {first.kind} content is not supported: this engine "
                      "serves a text-only model (--on-image reject)", "messages")
    counts = Counter(r.kind for r in replaced)
    for kind, n in counts.items():
        state.metrics.unsupported_blocks.labels(type=kind).inc(n)
    log.info("blocks_replaced", session=session, blocks=dict(counts), first=replaced[0].where)


# --- Anthropic Messages --------------------------------------------------------------------


def anthropic_readable(body: dict[str, Any]) -> tuple[dict[str, Any], list[Replaced]]:
    """`body` with every block the converter cannot read replaced: by text, by a
    placeholder, or (fallback markers) by nothing; an unknown type is a 400. Malformed
    shapes are left as they are, for the converter to refuse in its own words."""
    replaced: list[Replaced] = []
    out = dict(body)
    if isinstance(body.get("system"), list):
        out["system"] = _anthropic_blocks(body["system"], "system", replaced)
    messages = body.get("messages")
    if isinstance(messages, list):
        out["messages"] = [
            {**m, "content": _anthropic_blocks(m["content"], f"messages.{i}.content", replaced)}
            if isinstance(m, dict) and isinstance(m.get("content"), list) else m
            for i, m in enumerate(messages)]
    return out, replaced


def _anthropic_blocks(blocks: list[Any], where: str, replaced: list[Replaced]) -> list[Any]:
    out = []
    for i, block in enumerate(blocks):
        here = f"{where}.{i}"
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str) or kind in ANTHROPIC_HANDLED:
            if kind == "tool_result" and isinstance(block.get("content"), list):
                # Claude Code sends a screenshot (the Read tool on an image) this way
                block = {**block, "content": _anthropic_blocks(block["content"],
                                                               f"{here}.content", replaced)}
            out.append(block)
        elif kind in ANTHROPIC_DROPPED:
            continue
        elif kind in ANTHROPIC_MEDIA or kind in ANTHROPIC_PLACEHOLDER:
            out.append(_anthropic_replacement(block, kind, here, replaced))
        else:
            raise invalid(f"{here}.type: unknown content block type {describe(kind)}",
                          "messages")
    return out


def _anthropic_replacement(block: dict[str, Any], kind: str, where: str,
                           replaced: list[Replaced]) -> dict[str, Any]:
    """The text block (a thinking block, for redacted thinking) that stands for `block`;
    its cache_control marker, if any, moves with it."""
    text = _plain_text(block, kind)
    if text is None:
        media = kind in ANTHROPIC_MEDIA
        text = _anthropic_media_text(block, kind, where) if media else block_text(
            kind, block.get("name", block.get("tool_name")))
        replaced.append(Replaced(kind, where, media))
    if kind == "redacted_thinking":
        new = {"type": "thinking", "thinking": text}
    else:
        new = {"type": "text", "text": text}
    if "cache_control" in block:
        new["cache_control"] = block["cache_control"]
    return new


def _plain_text(block: dict[str, Any], kind: str) -> str | None:
    """The text a block carries as such, which a text model reads as well as any."""
    if kind == "compaction" and isinstance(block.get("content"), str):
        return block["content"]  # the summary of the turns it replaced
    source = block.get("source")
    if kind == "document" and isinstance(source, dict):
        data = source.get("data") if source.get("type") == "text" else source.get("content")
        if source.get("type") in ("text", "content") and isinstance(data, str):
            return data
    return None


def _anthropic_media_text(block: dict[str, Any], kind: str, where: str) -> str:
    """An image or a document's source: base64 (bytes), url, file (an id) or, for a
    document, content blocks."""
    source = block.get("source")
    by = source.get("type") if isinstance(source, dict) else None
    if by == "base64":
        media_type = source.get("media_type")
        if not isinstance(media_type, str):
            raise invalid(f"{where}.source.media_type: Field required", "messages")
        if kind == "image" and media_type not in IMAGE_TYPES:
            raise invalid(f"{where}.source.media_type: Input should be "
                          f"{_either(IMAGE_TYPES)}", "messages")
        data = decode_base64(source.get("data"), f"{where}.source.data")
        if kind == "image":
            _check_anthropic_image(media_type, data, where)
        return media_text(kind, media_type, data)
    if by == "url" and isinstance(source.get("url"), str):
        return reference_text(kind, "url", source["url"])
    if by == "file" and isinstance(source.get("file_id"), str):
        return reference_text(kind, "file", source["file_id"])
    if by == "content" and kind == "document":
        # its blocks by their JSON (bytes, never a Python repr: the same in every process)
        blocks = json.dumps(source.get("content"), sort_keys=True, ensure_ascii=False)
        return reference_text(kind, "content", blocks)
    raise invalid(f"{where}.source: Input should be a {kind} source with a 'type' of "
                  f"'base64', 'url' or 'file', got {describe(source)}", "messages")


def _either(names: tuple[str, ...]) -> str:
    """'a', 'b' or 'c', as Anthropic lists the values a field takes."""
    quoted = [f"'{n}'" for n in names]
    return f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _check_anthropic_image(media_type: str, data: bytes, where: str) -> None:
    """Anthropic reads an image's bytes and refuses those that are not of the type the
    block declares (400): a placeholder for them would serve what Anthropic does not."""
    actual = sniff_image(data)
    if actual is None:
        raise invalid(f"{where}.source.data: Could not process image: the data is not a "
                      f"{media_type} image", "messages")
    if actual != media_type:
        raise invalid(f"{where}.source: The image was specified using the {media_type} "
                      f"media type, but the image appears to be a {actual} image", "messages")


# --- OpenAI chat ---------------------------------------------------------------------------


def openai_readable(messages: Any) -> tuple[Any, list[Replaced]]:
    """`messages` with each image, audio or file part replaced by a placeholder text part
    and refusal parts by their text; an unknown part type is a 400. Malformed shapes are
    left for the converter."""
    replaced: list[Replaced] = []
    if not isinstance(messages, list):
        return messages, replaced
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m = {**m, "content": [_openai_part(part, f"messages[{i}].content[{j}]", replaced)
                                  for j, part in enumerate(m["content"])]}
        out.append(m)
    return out, replaced


def responses_part(part: Any, where: str, replaced: list[Replaced]) -> Any:
    """A Responses API content part, its media replaced as a chat part's would be:
    `input_image` {image_url | file_id} and `input_file` {file_data | file_id | file_url}
    become placeholder text parts; anything else is left for the converter."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "input_image":
        url, file_id = part.get("image_url"), part.get("file_id")
        if isinstance(file_id, str) and not isinstance(url, str):
            replaced.append(Replaced("image", f"'{where}'", True))
            return {"type": "text", "text": reference_text("image", "file", file_id)}
        part = {"type": "image_url", "image_url": {"url": url}}
    elif kind == "input_file":
        fields = {k: part[k] for k in ("file_data", "file_id") if isinstance(part.get(k), str)}
        if not fields and isinstance(part.get("file_url"), str):
            replaced.append(Replaced("file", f"'{where}'", True))
            return {"type": "text", "text": reference_text("file", "url", part["file_url"])}
        part = {"type": "file", "file": fields}
    else:
        return part
    return _openai_part(part, where, replaced)


def _openai_part(part: Any, where: str, replaced: list[Replaced]) -> Any:
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str) or kind in OPENAI_TEXT:
        return part
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return {"type": "text", "text": part["refusal"]}  # an assistant's earlier refusal
    if kind not in OPENAI_MEDIA:
        raise invalid(f"'{where}': unknown content part type {describe(kind)}", "messages")
    media = OPENAI_MEDIA[kind]
    replaced.append(Replaced(media, f"'{where}'", True))
    return {"type": "text", "text": _openai_media_text(part, kind, media, where)}


def _openai_media_text(part: dict[str, Any], kind: str, media: str, where: str) -> str:
    inner = part.get(kind)
    if not isinstance(inner, dict):
        raise invalid(f"'{where}.{kind}' must be an object", "messages")
    if kind == "image_url" and isinstance(inner.get("url"), str):
        return _url_text(media, inner["url"], where)
    if kind == "input_audio":
        fmt = inner.get("format")
        media_type = f"audio/{fmt}" if isinstance(fmt, str) else "audio"
        return media_text(media, media_type, decode_base64(inner.get("data"),
                                                           f"'{where}.input_audio.data'"))
    if kind == "file" and isinstance(inner.get("file_data"), str):
        return _url_text(media, inner["file_data"], where, bare_base64=True)
    if kind == "file" and isinstance(inner.get("file_id"), str):
        return reference_text(media, "file", inner["file_id"])
    raise invalid(f"'{where}.{kind}': no data in it (url, data, file_data or file_id)",
                  "messages")


def _url_text(kind: str, url: str, where: str, *, bare_base64: bool = False) -> str:
    """A `data:` URL by its bytes, any other URL by its digest; `bare_base64`: a string
    that is no URL is base64 (OpenAI's file_data)."""
    match = _DATA_URL.match(url)
    if match is None and url[:5].lower() == "data:":
        raise invalid(f"'{where}': not a valid data: URL (data:[<media type>][;base64],<data>)",
                      "messages")
    if match is None:
        if bare_base64:
            return media_text(kind, "application/octet-stream", decode_base64(url, f"'{where}'"))
        return reference_text(kind, "url", url)
    media_type = match["type"] or "text/plain"  # RFC 2397's default
    payload = url[match.end():]
    if ";base64" in match["params"].lower():
        data = decode_base64(payload, f"'{where}'")
    else:
        data = payload.encode()
    if kind == "image" and sniff_image(data) is None:
        # OpenAI reads the bytes (a JPEG labelled image/png is read as the JPEG it is) and
        # refuses what is none of the four image types
        raise ApiError(f"'{where}': You uploaded an unsupported image. Please make sure your "
                       "image has one of the following formats: ['png', 'jpeg', 'gif', "
                       "'webp'].", param="messages", code="invalid_image_format")
    return media_text(kind, media_type, data)
