"""A reasoning model's thinking span, followed token by token, and its budget.

Reasoning models (Qwen3, QwQ, DeepSeek-R1) write `<think> ... </think>` before their
answer. The shim names the two tags' token ids (and whether the prompt opened the span
already); here each sampled token moves the span along, so the scheduler knows how many
output tokens were reasoning (OpenAI's `reasoning_tokens`) and can hold the span to a
budget (Anthropic's `thinking.budget_tokens`): once the span holds `budget` tokens, the
only token the next sample may take is the end tag, sent to rank 0 as the chunk's mask
like a grammar's (scheduler/guided.py). The model then answers, within the request's
max_tokens, as SGLang and vLLM do. A request may have both a span and a grammar (a
reasoning model asked for a response format): the grammar holds the answer after the
span, and only the answer's tokens advance it.

The tags must be single tokens that the detokenizer keeps (they are, in these models'
tokenizers); the shim sends no span otherwise, and the budget is not enforced. A span
opens in the prompt or with the output's first token, as these models write it; a start
tag later on is text. (The shim's splitter, orchestrator/shim/reasoning.py, also opens a span
after leading whitespace, or written as several tokens: such a span, which these models
do not write, is the client's reasoning but is neither counted nor capped here.)
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler.guided import token_mask, with_token
from wire.client import ThinkingSpan


class ThinkingBudget:
    def __init__(self, span: ThinkingSpan, vocab_size: int) -> None:
        self._span = span
        self._inside = span.inside
        self._may_open = not span.inside  # only the first output token may open it
        self.num_tokens = 0  # reasoning tokens so far (the tags not counted)
        self._vocab_size = vocab_size

    def mask(self, answer: Callable[[], bytes | None]) -> bytes | None:
        """The next sample's mask. Inside the span: None (any token), or the end tag
        alone once the budget is spent. Outside: the answer's (`answer()`, a grammar's
        or None), which the start tag joins while the span may still open."""
        if self._inside:
            budget = self._span.budget
            spent = budget is not None and self.num_tokens >= budget
            return token_mask([self._span.end_token_id], self._vocab_size) if spent else None
        mask = answer()
        if mask is None or not self._may_open or mask.count(0) == len(mask):
            return mask  # (an empty mask is a broken grammar: the sampler's to report)
        return with_token(mask, self._span.start_token_id)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token: True if it was the span's (its tags included),
        False if it was the answer's."""
        spanned = True
        if self._inside:
            if token == self._span.end_token_id:
                self._inside = False
            else:
                self.num_tokens += 1
        elif self._may_open and token == self._span.start_token_id:
            self._inside = True
        else:
            spanned = False
        self._may_open = False
        return spanned
