"""A request continued after an engine restart (GenerateRequest.resumed_output), on the
real scheduler and model: sent to a fresh engine with the output the dead one had
streamed, it goes on with exactly the tokens the undisturbed run wrote after them --
greedy, sampled with a seed (sampling is keyed by (seed, position)), under a grammar
the continuation's guide first moves over the resumed answer, and with a thinking span
and its budget moved over the resumed reasoning. What it streams never repeats the
resumed tokens; its blocks all go back to the cache when it ends."""

from __future__ import annotations

import pytest

from orchestrator.shim.structured_output import after_reasoning, json_grammar
from tests.scheduler.engine_harness import inprocess_engine, run_until_done
from tests.scheduler.test_guided import SCHEMA, grammar
from tests.scheduler.test_thinking import END, PROMPT, THINK
from wire.client import GenerateRequest, SamplingParams, ThinkingSpan


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed)


REQUESTS = [
    GenerateRequest("greedy", PROMPT, 24, ignore_eos=True),
    GenerateRequest("sampled", PROMPT, 24, ignore_eos=True, sampling=seeded(11)),
    GenerateRequest("guided", PROMPT, 200, grammar=grammar(SCHEMA)),
    GenerateRequest("guided-sampled", PROMPT, 200, grammar=grammar(SCHEMA),
                    sampling=seeded(3)),
    # thinks until its budget (4), then answers in the format: resumed inside the span,
    # and in the answer
    *(GenerateRequest(rid, PROMPT, 200,
                      grammar=after_reasoning(json_grammar(SCHEMA, "response_format")),
                      thinking=ThinkingSpan(THINK, END, inside=True, budget=4))
      for rid in ("think-then-json", "think-then-json-late")),
    GenerateRequest("capped", PROMPT, 12,
                    thinking=ThinkingSpan(THINK, END, inside=True, budget=5)),
]
# where each is cut: the dead engine had streamed this many of its tokens
CUT = {"greedy": 9, "sampled": 13, "guided": 7, "guided-sampled": 10,
       "think-then-json": 3, "think-then-json-late": 8, "capped": 4}


@pytest.fixture(scope="module")
def undisturbed(default_model) -> dict[str, dict]:
    return run_until_done(inprocess_engine(default_model), REQUESTS)


def continuation(req: GenerateRequest, output: list[int]) -> GenerateRequest:
    return GenerateRequest(f"{req.request_id}.r1", req.prompt_token_ids, req.max_tokens,
                           sampling=req.sampling, ignore_eos=req.ignore_eos,
                           grammar=req.grammar, thinking=req.thinking, resumed_output=output)


def test_a_continuation_goes_on_as_the_undisturbed_run(default_model, undisturbed) -> None:
    assert undisturbed["think-then-json"]["tokens"][4] == END  # the span ends at its budget
    assert undisturbed["capped"]["reasoning"] == 5
    core = inprocess_engine(default_model)  # the restarted engine: other seq ids
    continued = run_until_done(core, [
        continuation(req, undisturbed[req.request_id]["tokens"][:CUT[req.request_id]])
        for req in REQUESTS])
    for req in REQUESTS:
        rid, cut = req.request_id, CUT[req.request_id]
        want, got = undisturbed[rid], continued[f"{rid}.r1"]
        assert got["tokens"] == want["tokens"][cut:], rid  # no token again, none missing
        assert (got["finish_reason"], got["reasoning"]) == (
            want["finish_reason"], want["reasoning"]), rid
    # the continuation's first sample came after recomputing prompt + resumed output
    # (seq 1: the greedy one, added first)
    first = next(c for plan in core.executor.plans for c in plan.batch()
                 if c.seq_id == 1 and c.sample)
    assert first.start_pos + len(first.token_ids) == len(PROMPT) + CUT["greedy"]
    usage = core.scheduler.cache.usage()
    assert usage["device"]["used"] == 0, usage  # every block back in the cache


def test_a_resumed_output_the_grammar_refuses_ends_the_request(default_model) -> None:
    """The resumed tokens are moved through the grammar: tokens it refuses end the
    request with an error, as a grammar that does not compile does."""
    core = inprocess_engine(default_model)
    # "JK": no JSON object starts so
    bad = GenerateRequest("bad", PROMPT, 50, grammar=grammar(SCHEMA), resumed_output=[50, 51])
    out = run_until_done(core, [bad])["bad"]
    assert out["finish_reason"] == "error" and out["tokens"] == []
