"""Speculative decoding end to end: the same tokens as plain greedy decoding, with prefix
hits, stop tokens, stop strings (through the shim), guided outputs, max_tokens, aborts
and overlap scheduling in the mix, in process and over ZeroMQ with two and four ranks
(their digests checked every step), for the tiny and the real model; afterwards no block
is leaked and the prefix index holds no rejected draft."""

from __future__ import annotations

import functools
import random

import llguidance
import pytest
from tokenizers import Tokenizer

from cache.hashing import BlockHashChain, make_extra_key
from scheduler.guided import GuideFactory
from tests.conftest import SMOLLM2, needs_smollm2
from tests.scheduler.engine_harness import inprocess_engine, zmq_engine
from tests.scheduler.test_guided import grammar
from tests.scheduler.test_overlap import check_close_timing
from tests.scheduler.test_prefix_cache_engine import BLOCK_BYTES_TINY
from wire.client import GenerateRequest, SamplingParams
from wire.config import SpeculativeConfig

# prompt_lookup_min 1: the tiny model's random weights repeat themselves little, so the
# shortest match is what gets some drafts accepted there
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
KV = 128 * BLOCK_BYTES_TINY  # room for the workloads, small enough to check every step


def workload(seed: int, n: int = 6) -> list[GenerateRequest]:
    """Prompts of one repeated token (the tiny model then repeats itself: drafts are kept),
    sharing a prefix (later ones hit earlier ones' blocks), and a random one."""
    rng = random.Random(seed)
    reqs = [GenerateRequest(f"r{i}", [7 + 50 * i] * 24 + [3] * (i + 1), 40 + 7 * i)
            for i in range(n - 1)]
    reqs.append(GenerateRequest("rand", [rng.randrange(10, 8000) for _ in range(30)], 30))
    return reqs


def drive(core, reqs: list[GenerateRequest], abort_after: dict[str, int] | None = None):
    """Two waves (the second hits the first's blocks); per request tokens and reason. Then
    checks: no leaked block, the cache's invariants, close timing, and that every block
    in the prefix index holds tokens its sequence really has (no rejected draft)."""
    sched = core.scheduler
    out = {r.request_id: {"tokens": [], "reason": None} for r in reqs}
    half = len(reqs) // 2
    for r in reqs[:half]:
        sched.add_request(r)
    for n in range(10_000):
        if n == 2:
            for r in reqs[half:]:
                sched.add_request(r)
        for rid, at in (abort_after or {}).items():
            if n == at and (o := sched.abort_request(rid)) is not None:
                out[rid]["tokens"] += o.token_ids
                out[rid]["reason"] = o.finish_reason
        if n > 2 and not core.has_work():
            break
        if core.has_work():
            for o in core.step().outputs:
                out[o.request_id]["tokens"] += o.token_ids
                out[o.request_id]["reason"] = o.finish_reason or out[o.request_id]["reason"]
    assert sched.cache.usage()["device"]["used"] == 0, "blocks leaked"
    sched.cache.check_invariants()
    check_close_timing(core.executor.plans)
    check_index_holds_real_tokens(sched, reqs, out)
    check_written_blocks_are_indexed(sched, reqs, out)
    return out


def check_index_holds_real_tokens(sched, reqs, out) -> None:
    """Every hash in the device index is a block of some request's real tokens (prompt and
    output): a block registered with a rejected draft in it would hash differently."""
    extra = make_extra_key(sched.config.model, None)
    real = set()
    for r in reqs:
        chain = BlockHashChain(sched.block_size, extra)
        chain.extend(r.prompt_token_ids + out[r.request_id]["tokens"])
        real.update(zip(*(k.tolist() for k in chain.keys())))
    index = sched.cache.device.index
    lo, hi = index.keys_of(index.registered_items())
    held = set(zip(lo.tolist(), hi.tolist()))
    assert held and held <= real, f"{len(held - real)} indexed blocks hold no real tokens"


def check_written_blocks_are_indexed(sched, reqs, out) -> None:
    """Every full block whose KV was written (all tokens but the last one each request
    got) is in the index, the last included: one filled by a drafted step's kept drafts,
    or by a token pending when the sequence last ran, is registered as it closes. (The
    workloads fit the cache: nothing is evicted.)"""
    extra = make_extra_key(sched.config.model, None)
    index = sched.cache.device.index
    lo, hi = index.keys_of(index.registered_items())
    held = set(zip(lo.tolist(), hi.tolist()))
    for r in reqs:
        chain = BlockHashChain(sched.block_size, extra)
        chain.extend((r.prompt_token_ids + out[r.request_id]["tokens"])[:-1])
        written = set(zip(*(k.tolist() for k in chain.keys())))
        assert written <= held, f"{r.request_id}: {len(written - held)} written blocks unindexed"


def with_stops(reqs: list[GenerateRequest], plain: dict) -> list[GenerateRequest]:
    """Two requests stopped by a token they generate (mid-way: likely inside a kept run)."""
    out = []
    for i, r in enumerate(reqs):
        toks = plain[r.request_id]["tokens"]
        stop = [toks[len(toks) // 2]] if i in (1, 3) else []
        out.append(GenerateRequest(r.request_id, r.prompt_token_ids, r.max_tokens,
                                   stop_token_ids=stop))
    return out


def spec_and_plain(make, reqs, abort_after=None):
    runs, stats, trims = {}, None, 0
    for spec in (None, SPEC):
        core = make(spec)
        try:
            runs[spec is not None] = drive(core, reqs, abort_after)
            if spec is not None:
                stats = core.scheduler.spec_stats
                trims = sum(len(p.trim) for p in core.executor.plans)
        finally:
            if hasattr(core, "close"):
                core.close()
    return runs[False], runs[True], stats, trims


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_greedy_tokens_are_the_same_with_speculation(default_model, overlap):
    def make(spec):
        return inprocess_engine(default_model, max_model_len=128, max_num_batched_tokens=96,
                                kv_cache_memory=KV, async_scheduling=overlap,
                                speculative=spec)

    reqs = workload(1)
    plain, spec, stats, trims = spec_and_plain(make, reqs)
    assert spec == plain
    # it really drafted, kept some drafts and rejected others (trimming blocks)
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert trims > 0
    assert {v["reason"] for v in plain.values()} == {"length"}

    stopped = with_stops(reqs, plain)
    plain, spec, _, _ = spec_and_plain(make, stopped)
    assert spec == plain
    assert {v["reason"] for v in spec.values()} == {"stop", "length"}


def test_max_tokens_is_never_passed_and_aborts_end_cleanly(default_model):
    def make(spec):
        return inprocess_engine(default_model, max_model_len=128, kv_cache_memory=KV,
                                speculative=spec)

    reqs = [GenerateRequest(f"m{n}", r.prompt_token_ids, n)
            for r, n in zip(workload(1), (1, 2, 5, 17, 26, 33))]
    plain, spec, stats, _ = spec_and_plain(make, reqs)
    assert spec == plain and stats.num_draft_tokens > 0
    assert all(len(v["tokens"]) == r.max_tokens for r, v in zip(reqs, spec.values()))

    long = [GenerateRequest("a", workload(1)[0].prompt_token_ids, 40),
            GenerateRequest("b", workload(1)[2].prompt_token_ids, 40)]
    full, _, _, _ = spec_and_plain(make, long)
    _, aborted, _, _ = spec_and_plain(make, long, {"a": 6})
    assert aborted["a"]["reason"] == "abort"
    assert aborted["a"]["tokens"] == full["a"]["tokens"][:len(aborted["a"]["tokens"])]
    assert aborted["b"] == full["b"]


def test_sampled_tokens_are_the_same_with_speculation(default_model):
    """With sampling too: a draft is kept only when the token sampled at its position (the
    request's seed, that position: what plain decoding draws there) equals it."""
    def make(spec):
        return inprocess_engine(default_model, max_model_len=128, kv_cache_memory=KV,
                                speculative=spec)

    reqs = [GenerateRequest(r.request_id, r.prompt_token_ids, 30,
                            sampling=SamplingParams(temperature=0.7, seed=i if i else None))
            for i, r in enumerate(workload(3, n=3))]
    plain, spec, stats, _ = spec_and_plain(make, reqs)
    assert spec == plain and stats.num_draft_tokens > 0


def test_the_context_end_is_never_passed(default_model):
    """Drafts stop where max_model_len leaves no room for the step's own token."""
    def make(spec):
        return inprocess_engine(default_model, max_model_len=48, kv_cache_memory=KV,
                                speculative=spec)

    reqs = [GenerateRequest("c", workload(1)[0].prompt_token_ids, 100)]
    plain, spec, stats, _ = spec_and_plain(make, reqs)
    assert spec == plain and spec["c"]["reason"] == "length"
    assert len(spec["c"]["tokens"]) == 48 - 25 and stats.num_draft_tokens > 0


def test_greedy_tokens_are_the_same_over_four_ranks(default_model):
    """World size 4 over ZeroMQ and gloo: every rank applies the trims, and the engine
    checks every rank's digest against the scheduler's after every step."""
    def make(spec):
        ctx = zmq_engine(default_model, 4, max_model_len=128, max_num_batched_tokens=96,
                         kv_cache_memory=KV, speculative=spec)
        core = ctx.__enter__()
        core.close = lambda: ctx.__exit__(None, None, None)
        return core

    reqs = workload(2, n=4)
    plain, spec, stats, trims = spec_and_plain(make, reqs)
    assert spec == plain and stats.num_accepted_tokens > 0 and trims > 0


SMOLLM2_CODE = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(8))


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    """SmolLM2's tokenizer, read from its GGUF once (its vocabulary takes seconds to parse)."""
    from orchestrator.gguf_tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(SMOLLM2).tokenizer


def smollm2_chat(question: str) -> list[int]:
    """SmolLM2's prompt for a user's question about the file above."""
    return smollm2_tokenizer().encode(
        "<|im_start|>user\nHere is a file:\n```python\n" + SMOLLM2_CODE
        + "\n```\n" + question + "<|im_end|>\n<|im_start|>assistant\n").ids


EDIT = "Rewrite the whole file, renaming f3 to g3."


def smollm2_engine(spec, **overrides):
    return inprocess_engine(str(SMOLLM2), kv_cache_memory=24 << 20, max_model_len=512,
                            speculative=spec, **overrides)


@needs_smollm2
@pytest.mark.slow
def test_the_real_model_copies_an_edit_with_the_same_tokens():
    """SmolLM2 rewriting a short file it was shown: most drafts are kept, and the output
    is the one plain greedy decoding gives."""
    ids = smollm2_chat(EDIT)
    reqs = [GenerateRequest("edit", ids, 100), GenerateRequest("edit2", ids + ids[:5], 20)]
    plain, spec, stats, _ = spec_and_plain(smollm2_engine, reqs)
    assert spec == plain
    assert stats.num_accepted_tokens > stats.num_draft_tokens / 2


class InProcessClient:
    """The shim's engine client (generate, abort) over an in-process engine: each step's
    outputs for the request, as the engine streams them (a drafted step's several tokens
    in one output)."""

    def __init__(self, core) -> None:
        self.core = core
        self.sizes: list[int] = []  # tokens per output streamed

    async def generate(self, req: GenerateRequest):
        self.core.scheduler.add_request(req)
        while self.core.has_work():
            for out in self.core.step().outputs:
                if out.request_id == req.request_id:
                    self.sizes.append(len(out.token_ids))
                    yield out

    async def abort(self, request_id: str, reason: str) -> None:
        self.core.scheduler.abort_request(request_id, reason)


@needs_smollm2
@pytest.mark.slow
def test_the_real_model_stops_where_plain_decoding_stops():
    """A stop token and a stop string (matched by the shim on the text, a drafted step's
    tokens fed to it one by one) end SmolLM2's edit at the same token with and without
    speculation, though the stop comes inside a run of kept drafts."""
    import asyncio

    from orchestrator.shim.generation import Delivery, Generation

    tok = smollm2_tokenizer()
    ids = smollm2_chat(EDIT)
    nine = tok.token_to_id("9")  # first written in "return x * 3 + 9", mid-output
    reqs = [GenerateRequest("edit", ids, 100, stop_token_ids=[nine])]
    plain, spec, stats, _ = spec_and_plain(smollm2_engine, reqs)
    assert spec == plain and stats.num_accepted_tokens > 0
    assert spec["edit"]["reason"] == "stop" and spec["edit"]["tokens"][-1] == nine

    async def through_the_shim(core) -> tuple:
        client = InProcessClient(core)
        gen = Generation(client, tok, GenerateRequest("s", ids, 100),
                         Delivery(stop=["* 3 + 9"]))
        text = "".join([piece.text async for piece in gen.pieces()])
        while core.has_work():  # the abort's close
            core.step()
        assert core.scheduler.cache.usage()["device"]["used"] == 0, "blocks leaked"
        return (text, gen.token_ids, gen.finish_reason, gen.stop_string), client.sizes

    plain, _ = asyncio.run(through_the_shim(smollm2_engine(None)))
    spec, sizes = asyncio.run(through_the_shim(smollm2_engine(SPEC)))
    assert spec == plain
    assert plain[2] == "stop" and plain[3] == "* 3 + 9"
    assert plain[0].endswith("def f3(x):\n    return x ")  # the text stops before it
    assert sizes[-1] > 1  # the stop string ended inside a drafted step's output


@needs_smollm2
@pytest.mark.slow
def test_the_real_model_follows_a_grammar_with_the_same_tokens(tmp_path):
    """SmolLM2 rewriting the file under a grammar that spells its shape: drafts come from
    the file it was shown, the grammar checks each, and the output is plain decoding's."""
    from orchestrator.gguf_tokenizer import write_tokenizer_dir

    tokenizer = str(write_tokenizer_dir(SMOLLM2, tmp_path / "tokenizer"))
    regex = llguidance.LLMatcher.grammar_from_regex(
        r"(def f[0-9]\(x\):\n    return x \* [0-9] \+ [0-9]+\n){8}")
    reqs = [GenerateRequest("guided", smollm2_chat("Rewrite the whole file."), 150,
                            grammar=regex)]
    plain, spec, stats, _ = spec_and_plain(
        lambda spec: smollm2_engine(spec, tokenizer=tokenizer), reqs)
    assert spec == plain and spec["guided"]["reason"] == "stop"
    assert stats.num_draft_tokens > stats.num_accepted_tokens > stats.num_draft_tokens / 2


def test_thinking_sequences_get_no_drafts_and_masked_ones_keep_their_tokens(default_model):
    """A thinking budget's mask is not played forward over drafts, so such a sequence
    decodes plainly beside drafted ones; a guided one may draft (its drafts checked
    against its grammar). Every one's tokens are unchanged."""
    from tests.scheduler.test_guided import SCHEMA, grammar
    from tests.scheduler.test_thinking import END, THINK
    from wire.client import ThinkingSpan

    def make(spec):
        return inprocess_engine(default_model, max_model_len=256, speculative=spec)

    free = workload(1)[0]
    reqs = [free,
            GenerateRequest("guided", free.prompt_token_ids, 120, grammar=grammar(SCHEMA)),
            GenerateRequest("thinking", free.prompt_token_ids, 30,
                            thinking=ThinkingSpan(THINK, END, budget=5, inside=True))]
    runs, plans = {}, None
    for spec in (None, SPEC):
        core = make(spec)
        runs[spec is not None] = drive(core, reqs)
        plans = core.executor.plans
    assert runs[True] == runs[False]
    assert runs[True]["guided"]["reason"] == "stop"
    drafted = {c.seq_id for p in plans for c in p.batch() if c.num_draft}
    assert 1 in drafted and 3 not in drafted  # seq ids follow the requests' order


# Grammars whose accepted text repeats (and which the prompt shows), so prompt lookup
# proposes drafts for their sequences; the random-weight model's masked samples then
# often agree with them.
REPEATS = r"(abc ){2,12}abc\."
ARRAY = {"type": "array", "items": {"const": "abc"}, "minItems": 2, "maxItems": 9}
GUIDED_TEXT = 'abc abc abc ["abc","abc","abc"]'


def guided_workload(model) -> list[GenerateRequest]:
    prompt = Tokenizer.from_file(str(model / "tokenizer.json")).encode(GUIDED_TEXT).ids
    regex = llguidance.LLMatcher.grammar_from_regex(REPEATS)
    return [GenerateRequest("regex", prompt, 60, grammar=regex),
            GenerateRequest("json", prompt, 60, grammar=grammar(ARRAY)),
            workload(1)[0],  # an unguided one drafting beside them
            GenerateRequest("regex2", prompt[:5], 40, grammar=regex)]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_guided_tokens_are_the_same_with_speculation(default_model, overlap):
    """Guided sequences get drafts the grammar accepts, each sampled row masked by the
    grammar's state after the drafts before it: the tokens are plain decoding's, and
    drafts are proposed, kept and rejected for them."""
    def make(spec):
        return inprocess_engine(default_model, max_model_len=128, kv_cache_memory=KV,
                                async_scheduling=overlap, speculative=spec)

    reqs = guided_workload(default_model)
    runs, plans, stats = {}, [], None
    for spec in (None, SPEC):
        core = make(spec)
        runs[spec is not None] = drive(core, reqs)
        plans, stats = core.executor.plans, core.scheduler.spec_stats
    assert runs[True] == runs[False]
    assert {runs[True][r]["reason"] for r in ("regex", "json", "regex2")} == {"stop"}
    guided = [c for p in plans for c in p.batch() if c.num_draft and c.allowed is not None]
    assert guided and all(len(c.draft_allowed) == c.num_draft for c in guided)
    # kept and rejected drafts, counted over the guided sequences alone (seq ids 1, 2, 4)
    kept = sum(len(toks) - 1 for r, p in zip(core.executor.results, plans)
               for c in p.batch() if c.num_draft and c.allowed is not None
               for toks in [[t for s, t in r[0].sampled if s == c.seq_id]])
    drafted = sum(c.num_draft for c in guided)
    assert 0 < kept < drafted
    assert stats.num_accepted_tokens >= kept


def test_guided_drafts_over_two_ranks_with_overlap(default_model):
    """Under overlap every rank samples, each row under its own mask from the plan: the
    engine checks every rank's samples against rank 0's after every step."""
    def make(spec):
        ctx = zmq_engine(default_model, 2, max_model_len=128, kv_cache_memory=KV,
                         async_scheduling=True, speculative=spec)
        core = ctx.__enter__()
        core.close = lambda: ctx.__exit__(None, None, None)
        return core

    reqs = guided_workload(default_model)[:2]
    plain, spec, stats, _ = spec_and_plain(make, reqs)
    assert spec == plain and stats.num_accepted_tokens > 0


def test_a_draft_token_the_grammar_refuses_ends_the_draft(default_model):
    """Drafts of two tokens the grammar allows, one it refuses, one after: the plan drafts
    the first two, with the masks the grammar gives after each, and afterwards the grammar
    is where plain decoding leaves it (it took the kept tokens alone)."""
    core = inprocess_engine(default_model, max_model_len=128, kv_cache_memory=KV,
                            speculative=SPEC)
    sched = core.scheduler
    prompt = guided_workload(default_model)[0].prompt_token_ids
    regex = llguidance.LLMatcher.grammar_from_regex(REPEATS)
    sched.add_request(GenerateRequest("g", prompt, 40, grammar=regex))
    seq = sched.sequence("g")
    while not seq.output:  # the prefill, and its first token
        core.step()

    def replay(tokens: list[int]):  # a fresh matcher fed `tokens`, as plain decoding feeds it
        guide = sched._guides.guide(regex)
        assert all(guide.accept(t) for t in tokens)
        return guide._matcher

    probe = replay(seq.output)
    allowed = lambda m: [t for t in range(sched.limits.vocab_size)  # noqa: E731
                         if m.compute_bitmask()[t // 8] >> (t % 8) & 1]
    good = []
    for _ in range(2):  # the lowest tokens the grammar allows next, one after the other
        good.append(allowed(probe)[0])
        assert probe.consume_token(good[-1])
    refused = next(t for t in range(sched.limits.vocab_size) if t not in allowed(probe))
    masks = [replay(seq.output + good[:1]).compute_bitmask(), probe.compute_bitmask()]
    before = seq.guide.allowed()

    class Stub:  # proposes the drafts above, whatever the tokens
        def propose(self, tokens, max_drafts):
            return (good + [refused, good[0]])[:max_drafts]

    seq.ngram = Stub()
    core.step()
    (chunk,) = [c for c in core.executor.plans[-1].batch() if c.seq_id == seq.seq_id]
    assert chunk.token_ids[-2:] == good and chunk.num_draft == 2
    assert chunk.allowed == before and chunk.draft_allowed == masks
    # the model kept what it kept; the grammar took those tokens and nothing else
    assert seq.guide.allowed() == replay(seq.output).compute_bitmask()


def test_draft_masks_leave_the_grammar_as_it_was(default_model):
    """`Guide.draft_masks` cuts at the first refused token and rolls back what it took."""
    factory = GuideFactory(str(default_model), 8192, [3])
    regex = llguidance.LLMatcher.grammar_from_regex(REPEATS)
    ids = Tokenizer.from_file(str(default_model / "tokenizer.json")).encode("abc abc x").ids
    x = ids[-1]
    guide = factory.guide(regex)
    before = guide.allowed()
    masks = guide.draft_masks(ids)
    assert len(masks) == len(ids) - 1  # " x" is not "abc": refused there
    assert guide.allowed() == before
    for token, mask in zip(ids[:-1], masks):
        assert guide.accept(token) and guide.allowed() == mask
    assert not guide.draft_masks([x])
