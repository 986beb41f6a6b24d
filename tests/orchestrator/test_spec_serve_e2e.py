"""`deepinfer-run serve --speculative-config`, launched: the nested config crosses from the
launcher to the scheduler (the run directory) and on to the ranks (the codec), and the
engine answers, with drafts proposed and checked, the tokens plain greedy decoding gives.

Speculation was driven in process only, and every engine started with the flag exited
at start: the scheduler read the config back from JSON with the speculative part a dict.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.orchestrator.e2e_helpers import Served, complete
from tests.orchestrator.test_serve_e2e import hf_greedy

pytestmark = pytest.mark.slow

# prompt_lookup_min 1: the tiny model's random weights repeat themselves little
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
NEW_TOKENS = 24


def draft_tokens(url: str) -> float:
    """deepinfer_spec_draft_tokens_total from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = [line.split()[-1] for line in text.splitlines()
              if line.startswith("deepinfer_spec_draft_tokens_total ")]
    assert len(values) == 1, "no speculative counters in /metrics"
    return float(values[0])


def test_serve_with_a_speculative_config_answers_with_drafts(default_model, tmp_path):
    prompt = [7] * 24 + [3]  # one repeated token: what comes after it is drafted from it
    engine = Served(default_model, tmp_path / "run", nproc=2,
                    extra_args=["--speculative-config", json.dumps(SPEC)])
    try:
        before = draft_tokens(engine.url)
        out = complete(engine.url, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                       ignore_eos=True)
        after = draft_tokens(engine.url)
    finally:
        assert engine.stop() == 0, engine.errors()
    assert before == 0 < after, "no draft was proposed"
    assert out["usage"]["completion_tokens"] == NEW_TOKENS
    assert out["choices"][0]["token_ids"] == hf_greedy(default_model, prompt, NEW_TOKENS)
