"""tools/benchmarks/vs_vllm.py without vLLM: the load's tokens, the stream client against a
canned vLLM-style stream, the summary and ratios; end to end (slow) with a second
DeepInfer standing in for the peer through the same OpenAI code path."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import pytest
from rich.console import Console

from orchestrator.config import repo_env
from tools.benchmarks import isa_cap, peers
from tools.benchmarks import vs_vllm as bvv


def test_vocab_of_the_tiny_model_leaves_out_its_special_tokens(default_model):
    vocab = bvv.model_vocab(default_model)
    config = json.loads((default_model / "config.json").read_text())
    assert vocab.size == config["vocab_size"] and vocab.bos == config["bos_token_id"]
    assert {config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]} <= vocab.special
    assert not set(vocab.drawable()) & vocab.special


def test_prompts_share_the_system_prompt_and_nothing_else(default_model):
    vocab = bvv.model_vocab(default_model)
    load = bvv.Load(agents=3, system_tokens=50, steps=3, tool_result_tokens=30, salt="a")
    p = bvv.Prompts(vocab, load)
    system = p.system()
    assert system[0] == vocab.bos and len(system) == 51
    assert system == bvv.Prompts(vocab, load).system()  # the same for every engine
    other_run = bvv.Prompts(vocab, bvv.Load(system_tokens=50, salt="b")).system()
    assert other_run[1:5] != system[1:5]  # the salt changes the start of the shared prompt
    pieces = [tuple(p.header(a)) for a in range(3)]
    pieces += [tuple(p.tool_result(a, s)) for a in range(3) for s in range(3)]
    assert len(set(pieces)) == len(pieces)
    assert all(len(x) == 30 for x in pieces[3:]) and len(pieces[0]) == bvv.HEADER_TOKENS
    drawn = {t for x in [system[1:], *pieces] for t in x}
    assert not drawn & vocab.special and max(drawn) < vocab.size


def _canned_stream(request: httpx.Request) -> httpx.Response:
    """vLLM's shape: token_ids per choice when asked, an empty first chunk, usage last."""
    body = json.loads(request.content)
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["return_token_ids"] and body["ignore_eos"] and body["temperature"] == 0
    n = len(body["prompt"])
    chunks = [{"choices": [{"index": 0, "text": "", "token_ids": []}], "usage": None}]
    chunks += [{"choices": [{"index": 0, "text": f"t{i}", "token_ids": [100 + i]}],
                "usage": None} for i in range(body["max_tokens"])]
    chunks.append({"choices": [], "usage": {"prompt_tokens": n, "completion_tokens": 3,
                                            "prompt_tokens_details": {"cached_tokens": n // 2}}})
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


def test_stream_client_reads_tokens_ttft_and_cached_usage():
    async def go():
        transport = httpx.MockTransport(_canned_stream)
        async with httpx.AsyncClient(transport=transport) as client:
            return await bvv.stream_completion(client, "http://peer", [1, 2, 3, 4], 3)

    out = asyncio.run(go())
    assert out.token_ids == [100, 101, 102]
    assert 0 <= out.ttft_s <= out.latency_s
    assert out.usage["prompt_tokens"] == 4 and bvv.cached_of(out.usage) == 2


def test_the_load_extends_each_history_by_the_answer(default_model):
    vocab = bvv.model_vocab(default_model)
    load = bvv.Load(agents=2, system_tokens=40, steps=3, tool_result_tokens=10, max_tokens=3,
                    salt="s")
    sent: list[list[int]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content)["prompt"])
        return _canned_stream(request)

    async def go():
        steps: list[bvv.Step] = []
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport) as client:
            p = bvv.Prompts(vocab, load)
            bar = bvv.tqdm(disable=True)
            await asyncio.gather(*(bvv.run_agent(i, client, "http://x", p, p.system(), 0.0,
                                                 steps, bar) for i in range(2)))
        return steps

    steps = asyncio.run(go())
    assert len(steps) == 6 and sorted(s.step for s in steps) == [0, 0, 1, 1, 2, 2]
    first = [s for s in sent if len(s) == 1 + 40 + bvv.HEADER_TOKENS + 10]
    assert len(first) == 2
    for s in sent:  # every later prompt is an earlier one + the answer + a tool result
        prev = [f for f in sent if len(f) == len(s) - 13 and s[:len(f)] == f]
        assert s in first or (prev and s[len(prev[0]):len(prev[0]) + 3] == [100, 101, 102])


def _steps(ttft: float, latency: float) -> list[bvv.Step]:
    return [bvv.Step(a, s, 0.0, ttft * (3 if s == 0 else 1), latency, 1000, 500 if s else 0,
                     9) for a in range(2) for s in range(3)]


def test_summary_ratios_and_table():
    ours = bvv.summarize(_steps(0.1, 0.9), wall_s=2.0, max_tokens=9)
    peer = bvv.summarize(_steps(0.2, 1.8), wall_s=4.0, max_tokens=9)
    assert ours["prompt_tok_s"] == 3000 and ours["hit_ratio"] == pytest.approx(2000 / 6000)
    assert ours["first_step_ttft_p50_s"] == pytest.approx(0.3)
    assert ours["later_steps_ttft_p50_s"] == pytest.approx(0.1)
    assert ours["decode_step_p50_ms"] == pytest.approx(100)
    q = bvv.ratios(ours, peer)
    assert q["prompt_tok_s"] == pytest.approx(2) and q["ttft_p50_s"] == pytest.approx(0.5)
    assert q["hit_ratio"] == pytest.approx(1) and q["wall_s"] == pytest.approx(0.5)
    console = Console(width=200, record=True)
    console.print(bvv.report_table({"DeepInfer": ours, "vLLM-CPU": peer}, "t"))
    text = console.export_text()
    assert "DeepInfer / vLLM-CPU" in text and "2.00x" in text and "0.50x" in text


@pytest.mark.slow
def test_end_to_end_against_a_stand_in_peer(default_model, tmp_path, capsys):
    out = tmp_path / "r.json"
    bvv.main(["--model", str(default_model), "--peer", "deepinfer", "--agents", "2",
              "--system-tokens", "64", "--steps", "2", "--tool-result-tokens", "16",
              "--max-tokens", "4", "--no-machine-rates", "--json", str(out), "--repeats", "2"],
             console=Console(width=200))
    result = json.loads(out.read_text())
    rows = list(result["runs"].values())
    for row in rows:  # two rounds each, on prompts of their own; the median one reported
        rates = row["rounds_prompt_tok_s"]
        assert len(rates) == 2 and rates == sorted(rates) and row["prompt_tok_s"] == rates[1]
        assert (row["prompt_tok_s_min"], row["prompt_tok_s_max"]) == (rates[0], rates[1])
        salts = row["round_salts"]
        assert len(set(salts)) == 2 and all(s.startswith(result["load"]["salt"]) for s in salts)
    assert len(rows) == 2 and result["ratio_of"] == "DeepInfer / DeepInfer (stand-in peer)"
    for row in rows:
        assert row["requests"] == 4 and row["output_tokens"] == 16
        # 1 + 64 + 20 + 16 and then + 4 + 16, for each agent
        assert row["prompt_tokens"] == 2 * (101 + 121)
        assert row["cached_tokens"] > 0 and 0 < row["hit_ratio"] < 1
        assert row["ttft_p50_s"] <= row["latency_p50_s"]
    assert result["ratios"]["prompt_tokens"] == 1 and result["ratios"]["prompt_tok_s"] > 0
    assert result["machine"]["cpu"] and result["load"]["salt"]
    printed = capsys.readouterr().out
    assert "machine:" in printed and "prompt tok/s" in printed


def test_the_avx2_cap_hides_the_cpus_wider_units_from_the_peers_kernel_choice(tmp_path):
    """vLLM-CPU picks _C, _C_AVX512 or _C_AVX2 by these torch.cpu checks (CPUID, not the
    library caps): under the cap's PYTHONPATH every one of them says no."""
    path = isa_cap.peer_python_path("avx2", tmp_path)
    checks = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
              "_is_amx_tile_supported")
    code = f"import torch.cpu as c; print([getattr(c, n)() for n in {checks!r}])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": path}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[False,", "False,", "False,", "False]"]
    assert isa_cap.peer_python_path(None, tmp_path) is None


@pytest.mark.slow
def test_a_run_held_to_avx2_runs_under_the_caps_and_says_so(default_model, tmp_path):
    """As a user types it: the harness re-runs itself under the caps (torch reads them as
    it loads), the engines inherit them, and the figures are marked."""
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k not in isa_cap.CAPS["avx2"]}
    r = subprocess.run(
        [sys.executable, "-m", "tools.benchmarks.vs_vllm", "--cap-isa", "avx2",
         "--model", str(default_model), "--peer", "deepinfer", "--agents", "1",
         "--system-tokens", "32", "--steps", "1", "--tool-result-tokens", "8",
         "--max-tokens", "2", "--no-machine-rates", "--json", str(out)],
        capture_output=True, text=True, env=repo_env() | env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["machine"]["isa_cap"] == "avx2" and result["args"]["cap_isa"] == "avx2"
    assert "code held to avx2 (--cap-isa)" in r.stdout
    assert all(row["requests"] == 1 for row in result["runs"].values())


def test_peer_paths_are_made_absolute_but_not_resolved(tmp_path, monkeypatch):
    venv_python = tmp_path / "venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to("/usr/bin/env")  # as a venv's python: a link out of the venv
    monkeypatch.chdir(tmp_path)
    args = bvv.parse_args(["--peer-python", "venv/bin/python", "--peer-dir", "peer"])
    assert args.peer_python == str(venv_python)  # the peer starts in another directory
    assert args.peer_dir == str(tmp_path / "peer") and args.salt


def test_only_the_shared_memory_files_nobody_maps_are_removed(tmp_path):
    import mmap

    (tmp_path / "psm_old").write_bytes(b"x")  # there before the peer started: kept
    before = peers.shm_names(tmp_path)
    for name in ("psm_leaked", "psm_in_use", "other"):
        (tmp_path / name).write_bytes(b"y" * 4096)
    with open(tmp_path / "psm_in_use", "r+b") as f, mmap.mmap(f.fileno(), 0):
        removed = peers.remove_leaked_shm(before, shm=tmp_path)
    assert removed == ["psm_leaked"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "psm_in_use", "psm_old"]
