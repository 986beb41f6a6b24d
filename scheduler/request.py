"""A request as the scheduler tracks it: one sequence of tokens and its progress."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from cache.hashing import BlockHashChain
from scheduler.guided import Guide
from scheduler.speculation import NgramIndex
from scheduler.thinking import ThinkingBudget
from wire.client import GenerateRequest, RequestOutput, UncachedTokens


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # in the queue; the ranks hold nothing for it
    RUNNING = "running"  # admitted; the ranks hold its block table
    FINISHED = "finished"  # done; closed by the plan after its last step


@dataclass
class Sequence:
    """The request as it arrived (`request`, never modified) and its progress."""

    seq_id: int
    request: GenerateRequest
    stop_token_ids: frozenset[int]  # the request's, and EOS unless it ignores EOS
    extra_key: bytes  # the model and the request's cache salt: what its KV may be shared with
    # The prompt's block hashes, computed once and extended as tokens arrive: hashing
    # a long prompt is the dominant cost of a lookup. None: prefix caching is off.
    chain: BlockHashChain | None = None
    guide_pending: Future[Guide] | None = None  # its grammar, while it compiles
    thinking: ThinkingBudget | None = None  # its reasoning span, counted and capped
    arrival: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose KV is written (or being written this step)
    # tokens sampled by steps whose results have not come back yet (0 or 1 when a plan is
    # made; overlap scheduling): the next decode runs one as PENDING_TOKEN
    num_pending: int = 0
    block_ids: list[int] = field(default_factory=list)  # the table as the scheduler has it
    opened: bool = False  # the ranks hold its block table
    held: bool = False  # waiting, with its cached prefix held by the cache (`hold`)
    turn_ended: bool = False  # its answer ended without a tool call (`end_turn`)
    num_sent_blocks: int = 0  # leading `block_ids` the ranks hold (sent in plans)
    last_step: int = -1  # last step that ran this sequence's tokens
    num_emitted: int = 0  # output tokens already sent to the requester
    finish_reason: str | None = None
    num_device_cached: int = 0
    num_host_cached: int = 0
    num_disk_cached: int = 0
    uncached: UncachedTokens | None = None  # why the rest of its prompt was computed
    uncached_told: bool = False  # an output carried `uncached` (its first after admission)
    first_token_time: float | None = None
    admitted_time: float | None = None  # its first admission (`AdmissionControl._start`)
    num_preemptions: int = 0
    error: str | None = None  # why it ended, when it ended with an error
    error_type: str | None = None
    guide: Guide | None = None  # the compiled grammar its output follows (guided decoding)
    # speculative decoding: where its n-grams occur (None: no drafts for it), and the draft
    # tokens of the step in flight, counted in num_computed until the result says how many
    # the model kept
    ngram: NgramIndex | None = None
    num_drafts: int = 0
    # a continuation's output tokens the grammar has yet to take (`resume`): its guide is
    # compiled later, in the queue
    guide_backlog: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # prompt + output in one list, appended in place: a 450K-token prompt must not
        # be copied every time a step slices it or the cache hashes it.
        self._tokens = list(self.request.prompt_token_ids)

    def append_output(self, token: int) -> None:
        self.output.append(token)
        self._tokens.append(token)

    def resume(self, output: list[int]) -> None:
        """A continuation after an engine restart (GenerateRequest.resumed_output): take
        `output`, already streamed to the client, as if sampled here, and move the thinking
        span over it as `stop_reason` would; the answer's tokens wait in `guide_backlog` for
        the grammar, compiled later. The sequence then runs like a preempted one: its first
        chunks recompute prompt + output, and its next sample is at the position (the
        seed's too) where the undisturbed run sampled it."""
        for token in output:
            self.append_output(token)
            spanned = self.thinking is not None and self.thinking.accept(token)
            if self.guide_pending is not None and not spanned:
                self.guide_backlog.append(token)
        self.num_emitted = len(output)  # sent already, by the engine that died

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def session_id(self) -> str | None:
        return self.request.session_id

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def tokens(self) -> list[int]:
        """Every token of the sequence (prompt + output); do not modify."""
        return self._tokens

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def stop_reason(self, token: int, max_model_len: int) -> str | None:
        """Why `token`, just appended, ends the sequence (None: it goes on); a grammar or
        thinking span takes the token in here."""
        if token in self.stop_token_ids:  # the end, inside a span or not: not reasoning
            return "stop"
        spanned = self.thinking is not None and self.thinking.accept(token)
        if self.guide is not None and not spanned:  # the grammar holds the answer only
            if not self.guide.accept(token):  # rank 0 sampled outside the mask it was sent
                self.error_type = "internal"
                self.error = f"token {token} broke the request's grammar: {self.guide.error}"
                return "error"
            if self.guide.complete:  # the grammar allows nothing more: the answer is whole
                return "stop"
        # max_tokens, or before it the room the context leaves after the prompt
        if (len(self.output) >= self.request.max_tokens
                or self.num_tokens >= max_model_len):
            return "length"
        return None

    def take_output(self) -> RequestOutput:
        """The output to stream now: the tokens not sent yet, and the end if it came."""
        # every running sequence, every step: positional, no properties
        output = self.output
        new = output[self.num_emitted:]
        self.num_emitted = len(output)
        request = self.request
        if self.status is not SeqStatus.FINISHED:
            # why its prompt missed: with its first output only (then known for good)
            uncached = None if self.uncached_told else self.uncached
            self.uncached_told = True
            return RequestOutput(
                request.request_id, new, False, None, len(request.prompt_token_ids),
                self.num_device_cached, self.num_host_cached, None, None,
                self.thinking.num_tokens if self.thinking is not None else 0,
                self.num_disk_cached, uncached)
        return RequestOutput(
            request_id=request.request_id,
            token_ids=new,
            finished=True,
            finish_reason=self.finish_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_device_cached_tokens=self.num_device_cached,
            num_host_cached_tokens=self.num_host_cached,
            error=self.error,
            error_type=self.error_type,
            num_reasoning_tokens=self.thinking.num_tokens if self.thinking is not None else 0,
            num_disk_cached_tokens=self.num_disk_cached,
            uncached=self.uncached,
            queue_s=self.admitted_time - self.arrival if self.admitted_time else 0.0,
            prefill_s=(self.first_token_time - self.admitted_time
                       if self.first_token_time and self.admitted_time else 0.0),
        )
