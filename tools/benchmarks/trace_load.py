"""A coding-agent trace as a script: sessions that grow turn by turn, pause, spawn sub-agents,
send title requests and compact their history near the context limit.

The shape is that of published traces of Claude Code and Codex: about 96% of input tokens
are cache reads; Codex on SWE-bench Pro runs a median of 33 turns, adds ~2.2K tokens a turn
and grows from 12K to 80K tokens, pausing 5.2 s (median) to 81 s (p99) between turns,
log-normally; sub-agents appear in 44% of sessions (they start from another system prompt,
run a few turns and end); compactions replace a history with a summary near the context
limit; clients send short title requests. The defaults scale the lengths down to a tiny
model with 16K positions (a 2,000-token system prompt, ~500 tokens a turn, a median of 12
turns); `time_scale` shrinks every pause and the spacing of session starts for a machine
that serves far fewer tokens a second than a GPU node.

Pure Python and numpy: no I/O, no clock, no asyncio. `tools/benchmarks/trace.py` sends the
requests over HTTP; a virtual-time simulator can drive the same sessions (`instant_timeline`
is such a driver, with answers that come back at once). How a driver runs one session:

    request = session.next_request(None)           # at session.start_s
    while request is not None:
        start each of session.spawned() child.start_s from now (a child is a TraceSession)
        wait until every session named in request.wait_for has ended,
        then request.pause_before_s; send request.prompt; answer = the tokens it got back
        request = session.next_request(answer)

Sub-agents and title requests are separate `TraceSession`s that their parent makes when it
gets to them (`spawned()`, right after the `next_request` call that started them): a title
request with the session's first request (its prompt: a short system prompt of its own and
the user's first message; the parent does not wait for it); sub-agents once the answer of
the turn that launched them comes back (the parent's next request waits for them to end:
its tool call returns their reports, with no pause after). Their start_s is an offset from
that moment (0: at once).

Every prompt is the previous prompt + the answer + the new turn's tokens, except right after
a compaction: when the next prompt (and its answer) would pass `compaction_at` of
`context_limit`, the session first sends its history + a compaction instruction (a
"compaction_summary" request; its answer is dropped), then continues from BOS + its system
prompt + a `summary_tokens` summary + the turn that did not fit. The summary's tokens are
drawn, not the answer's: a tiny model's answer of `max_tokens` would not make one, and the
cache sees the same thing either way (a new prompt that shares only the system prompt).

Tokens are drawn from `vocab` by a generator seeded with (seed, salt, what they are): the
same params give the same sessions, and the same prompts given the same answers. System
prompts are shared by the sessions of one agent kind (sub-agents of a kind share theirs,
titles theirs); every other token (first message, turns, summaries) belongs to one session
and turn only. `salt` changes the tokens and nothing else (same lengths, pauses, turns):
the runner's rounds use it so that no round hits another's cache.

`SeenPrefix` keeps what an engine has been sent and has answered, block-hashed as the engines
hash their prefix cache, so a request's "tokens recomputed that the engine had seen before"
is `max(0, seen_tokens - cached_tokens)` (`recomputed_seen`).
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

Z99 = 2.3263478740408408  # the standard normal's 99th percentile


@dataclass(frozen=True)
class TraceParams:
    """The load. Lengths in tokens, times in seconds before `time_scale` (which multiplies
    every pause and the spacing of session starts)."""

    sessions: int = 20  # top-level sessions (sub-agents and titles come on top)
    seed: int = 0  # the structure (turns, lengths, pauses, starts) and the tokens
    salt: str = ""  # the tokens only: another salt, the same trace with other tokens
    kinds: int = 2  # distinct agent kinds, each with its own shared system prompt
    system_tokens: int = 2000
    first_user_tokens: int = 300
    turn_tokens_median: int = 500  # what a turn adds: tool result + user text (log-normal)
    turn_tokens_sigma: float = 0.6
    turns_median: int = 12  # turns of a top-level session (log-normal, at least 1)
    turns_sigma: float = 0.5
    pause_median_s: float = 5.2  # between an answer and the next request (log-normal)
    pause_p99_s: float = 81.0
    time_scale: float = 0.5
    stagger_s: float = 12.0  # mean spacing of session starts (exponential gaps)
    max_tokens: int = 32  # every answer's length (the runner sends ignore_eos)
    context_limit: int = 16384
    compaction_at: float = 0.85  # of context_limit: compact before a prompt would pass it
    summary_tokens: int = 1000  # what a compaction leaves after the system prompt
    compaction_prompt_tokens: int = 100  # the instruction appended to ask for the summary
    subagent_prob: float = 0.44  # of top-level sessions, those that launch sub-agents
    subagents_max: int = 2  # launched together, 1 to this many
    subagent_turns_min: int = 2
    subagent_turns_max: int = 5
    subagent_system_tokens: int = 1000  # sub-agents' own system prompt, one per kind
    title_prob: float = 0.5  # of top-level sessions, those that send a title request
    title_system_tokens: int = 100
    title_max_tokens: int = 12
    vocab: tuple[int, ...] = tuple(range(100, 8000))  # drawable ids (the runner: the model's)
    bos: int | None = None  # put first in every prompt when set

    def __post_init__(self) -> None:
        if min(self.sessions, self.kinds, self.turns_median, self.max_tokens,
               self.title_max_tokens, self.subagent_turns_min) < 1:
            raise ValueError("sessions, kinds, turns_median, max_tokens, title_max_tokens "
                             "and subagent_turns_min must be >= 1")
        if self.subagent_turns_max < self.subagent_turns_min or self.subagents_max < 1:
            raise ValueError("subagent_turns_max must be >= subagent_turns_min, "
                             "subagents_max >= 1")
        if not 0 < self.pause_median_s < self.pause_p99_s:
            raise ValueError("0 < pause_median_s < pause_p99_s")
        if self.time_scale <= 0 or self.stagger_s < 0:
            raise ValueError("time_scale must be > 0 and stagger_s >= 0")
        if not 0 < self.compaction_at <= 1:
            raise ValueError("compaction_at is a share of context_limit, in (0, 1]")
        if not self.vocab:
            raise ValueError("vocab is empty")
        if self.compaction_limit + self.compaction_prompt_tokens + self.max_tokens \
                > self.context_limit:
            raise ValueError("a compaction request (a history at compaction_at of "
                             "context_limit, the instruction and the answer) would not fit "
                             "context_limit: lower compaction_at")
        # the largest prompt that restarts a session must leave room to grow
        restart = (1 + max(self.system_tokens, self.subagent_system_tokens)
                   + max(self.summary_tokens, self.first_user_tokens) + self.max_turn_tokens)
        if restart + self.max_tokens > self.compaction_limit:
            raise ValueError(f"a session restarted after a compaction ({restart} tokens and "
                             f"its answer) would not fit under compaction_at * context_limit "
                             f"({self.compaction_limit}): lower system_tokens, summary_tokens "
                             f"or turn_tokens_median, or raise context_limit")

    @property
    def compaction_limit(self) -> int:
        """A prompt and its answer stay at or under this many tokens."""
        return int(self.compaction_at * self.context_limit)

    @property
    def max_turn_tokens(self) -> int:
        """A turn's tokens are capped here (a log-normal's far tail would not fit)."""
        return max(1, self.context_limit // 8)

    @property
    def pause_sigma(self) -> float:
        """The log-normal's sigma with the stated median and 99th percentile."""
        return math.log(self.pause_p99_s / self.pause_median_s) / Z99


@dataclass
class TraceRequest:
    """One request of a session, as the client sends it."""

    prompt: list[int]
    max_tokens: int
    pause_before_s: float  # after the previous answer (and the wait_for sessions' ends)
    kind: str  # "turn" | "subagent" | "title" | "compaction_summary"
    session_id: str
    turn: int  # the request's index in its session, from 0
    wait_for: tuple[str, ...] = ()  # sessions that must end before this one is sent


@dataclass
class _Plan:
    """A session's structure, drawn once: what each turn adds and the pause before it."""

    turns: int
    turn_tokens: list[int]  # [turns]; turn 0's is the first user message
    pauses_s: list[float]  # [turns]; turn 0's is 0 (start_s places the session)
    subagent_after_turn: int | None = None  # its answer launches sub-agents
    num_subagents: int = 0
    title: bool = False


class TraceSession:
    """One session's script: a top-level agent, a sub-agent or a title request."""

    def __init__(self, params: TraceParams, session_id: str, kind: int, role: str,
                 start_s: float, plan: _Plan, system: list[int], first_user: list[int]) -> None:
        self.params = params
        self.session_id = session_id
        self.kind = kind  # the agent kind (which shared system prompt)
        self.role = role  # "main" | "subagent" | "title"
        self.start_s = start_s  # main: from the run's start; else from the spawning call
        self.plan = plan
        self._system = system  # BOS + the shared system prompt
        self._first_user = first_user
        self._prompt: list[int] | None = None  # the last request's
        self._turn = 0  # turns sent (compaction requests not counted)
        self._index = 0  # requests sent
        self._pending: list[int] | None = None  # the turn a compaction put off
        self._compactions = 0
        self._spawned: list[TraceSession] = []
        self.done = False

    def spawned(self) -> list[TraceSession]:
        """The sessions the latest `next_request` call started (each once)."""
        out, self._spawned = self._spawned, []
        return out

    def next_request(self, answer: list[int] | None) -> TraceRequest | None:
        """The next request given the answer to the previous one (None before the first);
        None once the session is over."""
        if self.done:
            raise RuntimeError(f"session {self.session_id} is over")
        if self._prompt is None:
            if answer is not None:
                raise ValueError("the first request has no answer before it")
            self._spawned = self._title()
            return self._emit(self._system + self._first_user, 0.0, advance=True)
        if answer is None:
            raise ValueError(f"session {self.session_id}: the answer to request "
                             f"{self._index - 1} is missing")
        history = self._prompt + list(answer)
        if self._pending is not None:  # the summary came back: go on from it
            pending, self._pending = self._pending, None
            return self._emit(self._system + self._summary() + pending, 0.0, advance=True)
        if self._turn >= self.plan.turns:
            self.done = True
            return None
        children: tuple[str, ...] = ()
        pause = self.plan.pauses_s[self._turn]
        if self.plan.subagent_after_turn == self._turn - 1:
            self._spawned = self._subagents()
            children, pause = tuple(c.session_id for c in self._spawned), 0.0
        new = self._draw(self.plan.turn_tokens[self._turn], "turn", self._turn)
        if len(history) + len(new) + self.max_tokens > self.params.compaction_limit:
            self._pending = new
            instruction = self._draw(self.params.compaction_prompt_tokens, "compact", self.kind,
                                     shared=True)
            return self._emit(history + instruction, pause, kind="compaction_summary",
                              wait_for=children)
        return self._emit(history + new, pause, advance=True, wait_for=children)

    @property
    def max_tokens(self) -> int:
        return self.params.title_max_tokens if self.role == "title" else self.params.max_tokens

    def _emit(self, prompt: list[int], pause_s: float, *, advance: bool = False,
              kind: str | None = None, wait_for: tuple[str, ...] = ()) -> TraceRequest:
        self._prompt = prompt
        self._turn += advance
        request = TraceRequest(prompt, self.max_tokens, pause_s,
                               kind or ("turn" if self.role == "main" else self.role),
                               self.session_id, self._index, wait_for)
        self._index += 1
        return request

    def _summary(self) -> list[int]:
        self._compactions += 1
        return self._draw(self.params.summary_tokens, "summary", self._compactions)

    def _draw(self, n: int, *key: object, shared: bool = False) -> list[int]:
        return draw_tokens(self.params, n, *(key if shared else (self.session_id, *key)))

    def _title(self) -> list[TraceSession]:
        if not self.plan.title:
            return []
        p = self.params
        system = _bos(p) + draw_tokens(p, p.title_system_tokens, "title-system")
        plan = _Plan(turns=1, turn_tokens=[len(self._first_user)], pauses_s=[0.0])
        return [TraceSession(p, f"{self.session_id}/title", self.kind, "title", 0.0, plan,
                             system, self._first_user)]

    def _subagents(self) -> list[TraceSession]:
        p = self.params
        system = _bos(p) + draw_tokens(p, p.subagent_system_tokens, "subagent-system", self.kind)
        out = []
        for j in range(self.plan.num_subagents):
            sid = f"{self.session_id}/sub{j}"
            rng = _rng(p.seed, "structure", sid)
            turns = int(rng.integers(p.subagent_turns_min, p.subagent_turns_max + 1))
            plan = _draw_plan(p, rng, turns)
            first = draw_tokens(p, p.first_user_tokens, sid, "first")
            out.append(TraceSession(p, sid, self.kind, "subagent", 0.0, plan, system, first))
        return out


def make_trace(params: TraceParams) -> list[TraceSession]:
    """The top-level sessions, by start time (deterministic in params)."""
    p = params
    gaps = _rng(p.seed, "starts").exponential(1.0, p.sessions) * p.stagger_s
    gaps[0] = 0.0  # the run starts with its first session
    start_s = np.cumsum(gaps) * p.time_scale
    sessions = []
    for i in range(p.sessions):
        sid = f"s{i}"
        kind = i % p.kinds
        rng = _rng(p.seed, "structure", sid)
        turns = max(1, round(float(rng.lognormal(math.log(p.turns_median), p.turns_sigma))))
        plan = _draw_plan(p, rng, turns)
        plan.title = bool(rng.random() < p.title_prob)
        if turns >= 2 and rng.random() < p.subagent_prob:
            plan.subagent_after_turn = int(rng.integers(0, turns - 1))
            plan.num_subagents = int(rng.integers(1, p.subagents_max + 1))
        system = _bos(p) + draw_tokens(p, p.system_tokens, "system", kind)
        first = draw_tokens(p, p.first_user_tokens, sid, "first")
        sessions.append(TraceSession(p, sid, kind, "main", float(start_s[i]), plan, system,
                                     first))
    return sessions


def _draw_plan(p: TraceParams, rng: np.random.Generator, turns: int) -> _Plan:
    sizes = rng.lognormal(math.log(p.turn_tokens_median), p.turn_tokens_sigma, turns)
    pauses = rng.lognormal(math.log(p.pause_median_s), p.pause_sigma, turns) * p.time_scale
    turn_tokens = [p.first_user_tokens] + [int(min(max(1, round(s)), p.max_turn_tokens))
                                           for s in sizes[1:]]
    return _Plan(turns, turn_tokens, [0.0] + [float(x) for x in pauses[1:]])


def draw_tokens(params: TraceParams, n: int, *key: object) -> list[int]:
    """n ids from params.vocab, deterministic in (seed, salt, key)."""
    vocab = _vocab_array(params.vocab)
    idx = _rng(params.seed, params.salt, *key).integers(0, len(vocab), n)
    return vocab[idx].tolist()


@functools.lru_cache(maxsize=4)
def _vocab_array(vocab: tuple[int, ...]) -> np.ndarray:
    return np.asarray(vocab, dtype=np.int64)


def _rng(*key: object) -> np.random.Generator:
    """A generator seeded by the key's text: stable across processes and Python versions
    (str hashes are salted per process)."""
    digest = hashlib.blake2b("/".join(map(str, key)).encode(), digest_size=16).digest()
    return np.random.default_rng(int.from_bytes(digest, "little"))


def _bos(p: TraceParams) -> list[int]:
    return [] if p.bos is None else [p.bos]


# --- what an engine has seen ------------------------------------------------------------


class SeenPrefix:
    """What an engine has been sent and has answered, as a chain of block hashes
    (h_i = H(h_{i-1}, tokens of block i), whole blocks only, as a prefix cache keys them).

    Call `add(prompt, answer)` when a request's answer is complete: the engine has then
    computed the KV of the prompt and of every answer token but the last (a sampled token
    is never fed back). `seen_tokens(prompt)` is how many leading tokens of a new prompt
    were in those whole blocks, capped where a cache hit stops: the last prompt token must
    run to give logits, so at most the whole blocks before it."""

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size
        self._hashes: set[bytes] = set()

    def add(self, prompt: list[int], answer: list[int] | None = None) -> None:
        tokens = list(prompt) + list(answer or [])[:-1]
        for h in self._chain(tokens, len(tokens) // self.block_size):
            self._hashes.add(h)

    def seen_tokens(self, prompt: list[int]) -> int:
        n = 0
        for h in self._chain(prompt, (len(prompt) - 1) // self.block_size):
            if h not in self._hashes:
                break
            n += self.block_size
        return n

    def _chain(self, tokens: list[int], num_blocks: int) -> Iterable[bytes]:
        bs, h = self.block_size, b""
        arr = np.asarray(tokens[:num_blocks * bs], dtype=np.int64)
        for i in range(num_blocks):
            h = hashlib.blake2b(h + arr[i * bs:(i + 1) * bs].tobytes(), digest_size=16).digest()
            yield h


def recomputed_seen(seen_tokens: int, cached_tokens: int) -> int:
    """Prompt tokens the engine computed again though it had seen them before."""
    return max(0, seen_tokens - cached_tokens)


# --- a driver with instant answers ------------------------------------------------------


@dataclass
class Timeline:
    """What every session sends, and when, if answers came back at once."""

    sent: list[tuple[float, TraceRequest]] = field(default_factory=list)  # by time
    ends: dict[str, float] = field(default_factory=dict)  # session id -> its end

    @property
    def span_s(self) -> float:
        return max(self.ends.values(), default=0.0)

    def live_context(self, step_s: float = 0.5) -> np.ndarray:
        """Tokens of live history at every step_s: over the sessions that have sent a
        request and not ended, each one's last prompt and its answer (what a cache must
        keep for its next turn)."""
        grid = np.arange(0.0, self.span_s + step_s, step_s)
        live = np.zeros(len(grid))
        by_session: dict[str, list[tuple[float, int]]] = {}
        for t, r in self.sent:
            by_session.setdefault(r.session_id, []).append((t, len(r.prompt) + r.max_tokens))
        for sid, points in by_session.items():
            ends = [t for t, _ in points[1:]] + [self.ends[sid]]
            for (t0, tokens), t1 in zip(points, ends):
                live[(grid >= t0) & (grid < t1)] += tokens
        return live


def instant_timeline(params: TraceParams) -> Timeline:
    """Drives make_trace(params) as a client would, each answer `max_tokens` copies of the
    vocabulary's first id, back the moment it is sent: the load's own timing, with no
    engine in the way (an engine only stretches it)."""
    out = Timeline()
    heap: list[tuple[float, int, TraceSession, list[int] | None]] = []
    order = 0

    def ready(t: float, session: TraceSession, answer: list[int] | None) -> None:
        nonlocal order
        heapq.heappush(heap, (t, order, session, answer))
        order += 1

    blocked: list[tuple[TraceSession, TraceRequest]] = []

    def send(t: float, session: TraceSession, request: TraceRequest) -> None:
        t += request.pause_before_s
        out.sent.append((t, request))
        ready(t, session, [params.vocab[0]] * request.max_tokens)

    for s in make_trace(params):
        ready(s.start_s, s, None)
    while heap:
        t, _, session, answer = heapq.heappop(heap)
        request = session.next_request(answer)
        for child in session.spawned():
            ready(t + child.start_s, child, None)
        if request is None:
            out.ends[session.session_id] = t
            for parent, waiting in list(blocked):
                if all(w in out.ends for w in waiting.wait_for):
                    blocked.remove((parent, waiting))
                    send(max(out.ends[w] for w in waiting.wait_for), parent, waiting)
        elif all(w in out.ends for w in request.wait_for):
            send(max([t, *(out.ends[w] for w in request.wait_for)]), session, request)
        else:
            blocked.append((session, request))
    assert not blocked, "a session waits for one that never ends"
    out.sent.sort(key=lambda x: x[0])
    return out
