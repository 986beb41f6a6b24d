"""The client side of the side-by-side benchmarks: the model's vocabulary (what a load may
draw) and one streamed `POST /v1/completions` with token-id prompts, read the same way from
DeepInfer and from vLLM (`vs_vllm.py`, `trace.py`)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

SERVED_NAME = "bench"  # the `model` every engine is asked for


# --- the model's vocabulary -------------------------------------------------------------


@dataclass(frozen=True)
class Vocab:
    """What the load may draw from: ids below `size`, none of `special`."""

    size: int
    bos: int | None
    special: frozenset[int]
    max_model_len: int

    def drawable(self) -> list[int]:
        return [i for i in range(self.size) if i not in self.special]


def model_vocab(model: Path) -> Vocab:
    """The vocabulary of a GGUF file (its tokenizer, as the engine builds it) or an HF
    directory (tokenizer.json and config.json)."""
    from tokenizers import Tokenizer

    if model.suffix == ".gguf":
        from orchestrator.gguf_tokenizer import load_gguf_tokenizer
        from worker.gguf import load_config

        built = load_gguf_tokenizer(model)
        tok, bos = built.tokenizer, built.bos_token_id
        cfg = load_config(model)
        size, max_len = cfg.vocab_size, cfg.max_position_embeddings
        special = {i for i in (built.bos_token_id, built.eos_token_id) if i is not None}
    else:
        tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        config = json.loads((model / "config.json").read_text())
        size, max_len = config["vocab_size"], config.get("max_position_embeddings", 2048)
        bos = config.get("bos_token_id")
        special = {i for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                   for i in _ids(config.get(k))}
    special |= set(tok.get_added_tokens_decoder())  # control and added tokens
    size = min(size, tok.get_vocab_size(with_added_tokens=True))
    return Vocab(size=size, bos=bos, special=frozenset(special), max_model_len=max_len)


def _ids(v: Any) -> list[int]:
    return [] if v is None else [v] if isinstance(v, int) else list(v)


# --- one request ------------------------------------------------------------------------


@dataclass
class Completion:
    ttft_s: float
    latency_s: float
    token_ids: list[int]
    usage: dict[str, Any] = field(default_factory=dict)
    request_id: str = ""  # the stream's `id` (DeepInfer's request id, as its logs name it)


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: list[int],
                            max_tokens: int,
                            headers: dict[str, str] | None = None) -> Completion:
    """POST /v1/completions, streamed: the time to the first token, to the end, the
    tokens (`token_ids` of each choice: DeepInfer always sends them, vLLM when asked with
    `return_token_ids`) and the last chunk's usage."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    t0 = time.perf_counter()
    ttft: float | None = None
    tokens: list[int] = []
    usage: dict[str, Any] = {}
    request_id = ""
    async with client.stream("POST", f"{url}/v1/completions", json=body,
                             headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"POST /v1/completions: HTTP {r.status_code}: {r.text[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"error mid-stream: {chunk['error']}")
            request_id = request_id or str(chunk.get("id") or "")
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids")
                if ids is None and choice.get("text"):
                    raise RuntimeError("the stream carries no token_ids: the harness needs "
                                       "the answer's tokens to extend the history")
                if ids:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    tokens += ids
            if chunk.get("usage"):
                usage = chunk["usage"]
    latency = time.perf_counter() - t0
    return Completion(latency if ttft is None else ttft, latency, tokens, usage, request_id)


def cached_of(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
