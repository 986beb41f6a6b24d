"""Guided decoding: the grammar a request's output must follow (structured outputs).

The shim turns a JSON schema, a forced tool call or an any-JSON request into one
llguidance grammar (orchestrator/shim/structured_output.py) and sends it with the request.
Here each guided sequence holds a matcher, compiled in a thread pool while the request
waits in the queue (llguidance drops the GIL: a schema that takes 100 ms to compile
does not pause the steps of everyone else). Before a step samples the sequence, the
matcher's token bitmask goes into the plan with the chunk; rank 0 drops the tokens
it excludes before sampling (worker/sampler.py). The sampled token then advances the
matcher. The mask travels in the plan, like everything a rank acts on, so no rank
decides anything alone; steps run one after another, so each mask is computed from
every token sampled so far.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance


def token_mask(tokens: Iterable[int], vocab_size: int) -> bytes:
    """A mask allowing `tokens` alone, in llguidance's layout: bit i of little-endian
    32-bit words is token i, i.e. bit i % 8 of byte i // 8."""
    mask = bytearray(-(-vocab_size // 32) * 4)
    for token in tokens:
        mask[token // 8] |= 1 << (token % 8)
    return bytes(mask)


def with_token(mask: bytes, token: int) -> bytes:
    """`mask`, allowing `token` too."""
    out = bytearray(mask)
    out[token // 8] |= 1 << (token % 8)
    return bytes(out)


class GrammarError(ValueError):
    """The grammar does not compile (a message for the client)."""


class GuideFactory:
    """Compiles grammars against the model's tokenizer. The tokenizer is read in a
    background thread from start-up (a 150K-token vocabulary takes about a second: not
    a stall of the scheduler loop at the first guided request); a failure to read it is
    kept, and refuses guided requests only."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size  # the logits' width, which may pad the tokenizer's
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._error = ""
        self._loaded = threading.Event()
        threading.Thread(target=self._load, name="guided-tokenizer", daemon=True).start()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")

    def compile(self, grammar: str) -> Future[Guide]:
        """`guide(grammar)` in the pool: the future's result, or its GrammarError."""
        return self._pool.submit(self.guide, grammar)

    def _load(self) -> None:
        try:
            text = (Path(self.tokenizer_dir) / "tokenizer.json").read_text()
            self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size,
                                                     eos_token=self.eos_token_ids or None)
        except Exception as exc:  # noqa: BLE001 -- kept for the requests that need it
            self._error = str(exc)
        finally:
            self._loaded.set()

    def guide(self, grammar: str) -> Guide:
        self._loaded.wait()
        if self._tokenizer is None:
            raise GrammarError("guided decoding is unavailable for this model's tokenizer: "
                               f"{self._error}")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"grammar: {matcher.get_error()}")
        return Guide(matcher)


class Guide:
    """One sequence's grammar state."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def allowed(self) -> bytes:
        """The tokens the next sample may take: bit i (of little-endian 32-bit words)
        set for token i."""
        return self._matcher.compute_bitmask()

    def draft_masks(self, drafts: list[int]) -> list[bytes]:
        """Speculative decoding: the masks of the samples after each draft of the longest
        prefix of `drafts` the grammar accepts (one per draft kept; the first refused
        token ends the draft). Each is what `allowed()` would give once the drafts up to
        it were accepted. The state is left as it was: the step's results advance it by
        the tokens the model kept (`accept`), exactly as plain decoding would."""
        # validate_tokens checks without consuming: a refused token consumed would put
        # the matcher in its error state, which no rollback leaves
        num = self._matcher.validate_tokens(drafts)
        masks: list[bytes] = []
        try:
            for token in drafts[:num]:
                if not self._matcher.consume_token(token):  # validated: never expected
                    raise RuntimeError(f"grammar refused validated draft {token}: "
                                       f"{self._matcher.get_error()}")
                masks.append(self._matcher.compute_bitmask())
        finally:
            if masks and not self._matcher.rollback(len(masks)):
                raise RuntimeError(f"grammar rollback failed: {self._matcher.get_error()}")
        return masks

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        return self._matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and allows nothing more (only an end of sequence)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()
