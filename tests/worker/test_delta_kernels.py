"""The Gated DeltaNet's operators per device (worker/delta_kernels.py), on the CPU.

- the CPU, float32 on CUDA, and CUDA without `fla` / `causal_conv1d` get the torch
  reference;
- CUDA with them gets their adapters, which put our layout into the kernels' documented
  one and back: checked exactly against the torch reference through stand-ins that take
  the kernels' layout (fla's [B, T, H, D] and [N, H, K, V] state, causal_conv1d's
  channel-last (batch, dim, seqlen)), assert what the real kernels require of it, and
  compute with our own reference;
- a tiny hybrid run through those adapters gives the torch operators' logits, over
  chunked prefill, a restored snapshot and batched decodes.

The real kernels run in tests/worker/test_hybrid_cuda.py, on a GPU.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.worker.test_hybrid import runner_for
from tests.worker.test_reference import make_prompt
from wire.step import DecodeBatch, NewSequence, ScheduledChunk, StepPlan
from worker import delta_kernels
from worker.delta_kernels import TORCH_OPS, delta_ops, torch_chunk, torch_step
from worker.gated_delta import (
    L2_EPS,
    causal_conv,
    causal_conv_step,
    chunked_delta_rule,
    recurrent_delta_rule,
)

CUDA = torch.device("cuda")  # only named: choosing operators touches no device


# --- stand-ins for the kernels, in their documented layouts ------------------------------

def _l2(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _fla_inputs(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel):
    """fla's layout checked (q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV];
    initial_state [N, HV, K, V] float32, N = B) and q, k as its kernels see them."""
    b, t, h, dk = q.shape
    hv, dv = v.shape[2:]
    assert k.shape == q.shape and v.shape[:2] == (b, t) and hv % h == 0
    assert g.shape == beta.shape == (b, t, hv) and g.dtype == torch.float32
    assert initial_state.shape == (b, hv, dk, dv) and initial_state.dtype == torch.float32
    q, k = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        q, k = _l2(q), _l2(k)
    q = q * scale
    return q.repeat_interleave(hv // h, dim=2), k.repeat_interleave(hv // h, dim=2)


def fake_chunk_gated_delta_rule(*, q, k, v, g, beta, scale, initial_state, output_final_state,
                                use_qk_l2norm_in_kernel):
    """fla.ops.gated_delta_rule.chunk_gated_delta_rule, keyword arguments as we call it,
    each sequence of the batch through our chunked rule. o [B, T, HV, V] in q's dtype,
    the final state [N, HV, K, V] float32."""
    q, k = _fla_inputs(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel)
    outs = [chunked_delta_rule(q[i], k[i], v[i], g[i], beta[i], initial_state[i])
            for i in range(q.shape[0])]
    assert output_final_state
    return (torch.stack([o for o, _ in outs]).to(v.dtype),
            torch.stack([s for _, s in outs]))


def fake_fused_recurrent_gated_delta_rule(*, q, k, v, g, beta, scale, initial_state,
                                          output_final_state, use_qk_l2norm_in_kernel):
    """fla's fused_recurrent_gated_delta_rule: every sequence a token at a time, through
    our recurrent rule."""
    q, k = _fla_inputs(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel)
    state, outs = initial_state, []
    for t in range(q.shape[1]):
        o, state = recurrent_delta_rule(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o)
    assert output_final_state
    return torch.stack(outs, dim=1).to(v.dtype), state


def fake_causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                          return_final_states=False, final_states_out=None, activation=None):
    """causal_conv1d_fn: x (batch, dim, seqlen), weight (dim, width), initial_states
    (batch, dim, width - 1); with initial states the CUDA kernel takes channel-last x and
    states only (stride 1 along dim), dim a multiple of 8. Out (batch, dim, seqlen)."""
    b, c, _ = x.shape
    assert activation == "silu" and bias is None and seq_idx is None and not return_final_states
    assert initial_states.shape == (b, c, weight.shape[1] - 1) and weight.shape[0] == c
    assert x.stride(1) == 1 and initial_states.stride(1) == 1 and c % 8 == 0
    assert x.dtype == weight.dtype == initial_states.dtype
    return torch.stack([causal_conv(x[i].t(), initial_states[i], weight)[0].t()
                        for i in range(b)])


def fake_causal_conv1d_update(x, conv_state, weight, bias=None, activation=None,
                              cache_seqlens=None, conv_state_indices=None):
    """causal_conv1d_update: x (batch, dim), conv_state (batch, dim, width - 1) shifted in
    place; out (batch, dim)."""
    assert activation == "silu" and bias is None and cache_seqlens is None
    assert x.dim() == 2 and conv_state.shape == (*x.shape, weight.shape[1] - 1)
    out, after = causal_conv_step(x, conv_state, weight)
    conv_state.copy_(after)
    return out


@pytest.fixture
def fresh_choice():
    """`delta_ops` chooses again (its choice is cached per device and dtype)."""
    delta_kernels._choose.cache_clear()
    yield
    delta_kernels._choose.cache_clear()


@pytest.fixture
def kernels_importable(fresh_choice, monkeypatch):
    """`fla.ops.gated_delta_rule` and `causal_conv1d` import, as the stand-ins."""
    rule = types.ModuleType("fla.ops.gated_delta_rule")
    rule.chunk_gated_delta_rule = fake_chunk_gated_delta_rule
    rule.fused_recurrent_gated_delta_rule = fake_fused_recurrent_gated_delta_rule
    conv = types.ModuleType("causal_conv1d")
    conv.causal_conv1d_fn = fake_causal_conv1d_fn
    conv.causal_conv1d_update = fake_causal_conv1d_update
    for name, module in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                         ("fla.ops.gated_delta_rule", rule), ("causal_conv1d", conv)):
        monkeypatch.setitem(sys.modules, name, module)


# --- the choice --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_gets_the_torch_operators(fresh_choice, kernels_importable, dtype):
    assert delta_ops(torch.device("cpu"), dtype) is TORCH_OPS


def test_float32_on_cuda_gets_the_torch_operators(kernels_importable):
    ops = delta_ops(CUDA, torch.float32)
    assert (ops.conv, ops.conv_step, ops.chunk, ops.step) == (
        causal_conv, causal_conv_step, torch_chunk, torch_step)
    assert ops.name.startswith("torch")


def test_cuda_without_the_kernel_packages_gets_the_torch_operators(fresh_choice, monkeypatch):
    for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule", "causal_conv1d"):
        monkeypatch.setitem(sys.modules, name, None)  # `import` raises ImportError
    ops = delta_ops(CUDA, torch.bfloat16)
    assert (ops.conv, ops.conv_step, ops.chunk, ops.step) == (
        causal_conv, causal_conv_step, torch_chunk, torch_step)
    assert "fla does not import" in ops.name and "causal_conv1d does not import" in ops.name


class BrokenModule(types.ModuleType):
    """An installed package that fails as it is imported (built for another Triton)."""

    def __getattr__(self, name):
        raise RuntimeError(f"{self.__name__} was built for another Triton")


def test_cuda_with_broken_kernel_packages_gets_the_torch_operators(kernels_importable,
                                                                   monkeypatch):
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule",
                        BrokenModule("fla.ops.gated_delta_rule"))
    monkeypatch.setitem(sys.modules, "causal_conv1d", BrokenModule("causal_conv1d"))
    ops = delta_ops(CUDA, torch.float16)
    assert (ops.conv, ops.conv_step, ops.chunk, ops.step) == (
        causal_conv, causal_conv_step, torch_chunk, torch_step)


def test_cuda_with_the_kernel_packages_gets_their_adapters(kernels_importable):
    ops = delta_ops(CUDA, torch.bfloat16)
    assert ops.name == "delta rule: fla; conv: causal_conv1d"
    assert torch_chunk not in (ops.chunk, ops.step) and causal_conv not in (ops.conv,
                                                                              ops.conv_step)
    assert delta_ops(CUDA, torch.bfloat16) is ops  # chosen (and logged) once


# --- the adapters, exactly the reference -------------------------------------------------

def _inputs(num: int, hk: int = 2, hv: int = 6, dk: int = 8, dv: int = 5, seed: int = 0):
    """Distinct sizes on every axis, so that an axis taken for another cannot pass."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(num, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(num, hv, dv, generator=gen)
    g, beta = -torch.rand(num, hv, generator=gen), torch.rand(num, hv, generator=gen)
    return q, k, v, g, beta, gen


def test_the_fla_chunk_adapter_is_the_reference(kernels_importable):
    ops = delta_ops(CUDA, torch.bfloat16)
    q, k, v, g, beta, gen = _inputs(11)
    state = torch.randn(6, 8, 5, generator=gen)
    before = state.clone()
    o, after = ops.chunk(q, k, v, g, beta, state)
    o_ref, after_ref = torch_chunk(q, k, v, g, beta, state)
    assert o.shape == (11, 6, 5) and o.dtype == torch.float32
    assert torch.equal(o, o_ref) and torch.equal(after, after_ref)
    assert torch.equal(state, before), "the state read was written"


def test_the_fla_step_adapter_is_the_reference(kernels_importable):
    ops = delta_ops(CUDA, torch.bfloat16)
    q, k, v, g, beta, gen = _inputs(3)  # one token of each of 3 sequences
    states = torch.randn(3, 6, 8, 5, generator=gen)
    before = states.clone()
    o, after = ops.step(q, k, v, g, beta, states)
    o_ref, after_ref = torch_step(q, k, v, g, beta, states)
    assert o.shape == (3, 6, 5)
    assert torch.equal(o, o_ref) and torch.equal(after, after_ref)
    assert torch.equal(states, before), "the states read were written"


@pytest.mark.parametrize("channels", [16, 12])  # 12: not channel-last-able, left to torch
def test_the_conv_adapter_is_the_reference(kernels_importable, channels):
    ops = delta_ops(CUDA, torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    # a chunk as the layer has it: rows of a wider projection's output, a strided view
    x = torch.randn(7, channels + 10, generator=gen)[:, :channels]
    window, weight = torch.randn(channels, 3, generator=gen), torch.randn(channels, 4,
                                                                          generator=gen)
    out, padded = ops.conv(x, window, weight)
    out_ref, padded_ref = causal_conv(x, window, weight)
    assert torch.equal(out, out_ref) and torch.equal(padded, padded_ref)


def test_the_conv_step_adapter_is_the_reference(kernels_importable):
    ops = delta_ops(CUDA, torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    x, windows = torch.randn(3, 16, generator=gen), torch.randn(3, 16, 3, generator=gen)
    weight = torch.randn(16, 4, generator=gen)
    before = windows.clone()
    out, after = ops.conv_step(x, windows, weight)
    out_ref, after_ref = causal_conv_step(x, windows, weight)
    assert torch.equal(out, out_ref) and torch.equal(after, after_ref)
    assert torch.equal(windows, before), "the windows read were written"


# --- a model through the adapters --------------------------------------------------------

def test_a_hybrid_through_the_kernel_adapters_gives_the_torch_logits(hybrid_models,
                                                                     kernels_importable):
    """Qwen3.5-MoE (float32, CPU) with its linear layers on the adapters (over the
    stand-ins) and on the torch operators: the same logits, step by step."""
    model = hybrid_models["qwen3_5_moe"]
    runners = [runner_for(model), runner_for(model)]
    runners[1].model.delta_ops = delta_ops(CUDA, torch.bfloat16)
    assert runners[0].model.delta_ops is TORCH_OPS
    prompt = make_prompt(8192, n=40, seed=5)
    token = 17
    plans = [
        StepPlan(0, new_seqs=[NewSequence(1, [0, 1, 2], state_slot=0)],
                 chunks=[ScheduledChunk(1, prompt[:13], 0, False)]),
        StepPlan(1, chunks=[ScheduledChunk(1, prompt[13:], 13, True,
                                           state_snapshots=[(3, 5)])]),
        StepPlan(2, new_seqs=[NewSequence(2, [0, 3, 4], state_slot=1)], state_copy=[(5, 1)],
                 chunks=[ScheduledChunk(2, prompt[16:], 16, True)]),
        StepPlan(3, decodes=DecodeBatch([1, 2], [len(prompt)] * 2, [token] * 2)),
    ]
    for plan in plans:
        ours, theirs = (r.execute(plan, return_logits=True).logits for r in runners)
        # not bit-equal: the same products over differently strided tensors round apart
        # (measured 1.1e-6 of the scale); a misplaced axis moves logits by the scale itself
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5 * ours.abs().max().item())
