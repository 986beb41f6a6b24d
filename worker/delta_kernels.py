"""The Gated DeltaNet's sequence operators behind one interface, chosen per device.

`delta_ops(device, dtype)` gives a linear-attention layer (worker/linear_attention.py) its
four operators. On CUDA, in 16 bits, the delta rule runs on the `fla` package's Triton
kernels (flash-linear-attention: `chunk_gated_delta_rule` for prefill pieces,
`fused_recurrent_gated_delta_rule` for decodes) and the convolution on `causal_conv1d`'s
CUDA kernels, each where its package imports; everywhere else (the CPU, float32 on CUDA
-- the exactness checks against the CPU, as for the attention backend -- or a package
missing) the torch reference of worker/gated_delta.py, which runs on CUDA tensors too.
Neither package is a dependency: each is imported here, for a CUDA device only, and the
choice is logged once per device and dtype.

The interface, in our layout (sequence-first; a prefill piece is one sequence's T tokens,
a decode batch one token of each of B sequences):

- conv(x [T, C], window [C, K-1], weight [C, K]) -> (SiLU(conv) [T, C], the inputs with
  the window in front [K-1+T, C]: gated_delta.window_after reads a window off it);
- conv_step(x [B, C], windows [B, C, K-1], weight) -> (SiLU(conv) [B, C], windows after);
- chunk(q, k [T, Hk, Dk] as the conv left them, v [T, Hv, Dv], g, beta [T, Hv] float32,
  state [Hv, Dk, Dv] float32) -> (o [T, Hv, Dv], the state after, float32);
- step(q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv], states [B, Hv, Dk, Dv]) ->
  (o [B, Hv, Dv], the states after, float32).

q and k are L2-normalised inside (q then scaled by Dk^-1/2), each key head read by the
value heads of its group. No operator writes its inputs.

The mapping onto fla (its docstrings as of fla-core 0.6, and transformers' Qwen3.5 layer,
which calls the same two functions with use_qk_l2norm_in_kernel=True):

- fla is sequence-first too, [B, T, H, D] (`head_first` is gone): a prefill piece is a
  batch of one (x[None]), a decode batch B sequences of T = 1 (x[:, None]), each with
  its own initial state (N = B);
- q and k are repeated to the Hv value heads first (repeat_interleave: value head j reads
  key head j // (Hv / Hk), as in normalize_qk), so the call does not depend on a
  version's grouped-value support;
- the L2 norm is fla's (use_qk_l2norm_in_kernel: x / sqrt(sum x^2 + 1e-6), L2_EPS), and
  the scale Dk^-1/2 is passed explicitly (fla multiplies the normalised q by it);
- the state: fla's initial and final states [N, H, K, V] float32 are our recurrent slots
  [Hv, Dk, Dv] as they are -- both keep S with a row per key dim (o = S^T q) -- so no
  transpose (fla's `state_v_first=True`, [V, K], is never passed);
- g goes as ours, float32 log decays; beta in v's dtype, as transformers passes it;
  every argument by keyword (fla 0.6 put gk and gv between g and beta).

And onto causal_conv1d (its Python interface's docstrings: x (batch, dim, seqlen), weight
(dim, width), initial_states (batch, dim, width - 1)): with initial states its CUDA kernel
takes, as we read its checks, only the channel-last layout (x.stride(1) == 1,
initial_states.stride(1) == 1) with dim a multiple of 8 -- which is our [T, C] row-major
chunk seen as x.t()[None]; a chunk whose C is not a multiple of 8 is left to torch.
causal_conv1d_update(x (batch, dim), conv_state (batch, dim, K-1), weight) writes the
state in place: it gets a copy of the windows (`conv_step`'s contract).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from worker.gated_delta import (
    causal_conv,
    causal_conv_step,
    chunked_delta_rule,
    normalize_qk,
    recurrent_delta_rule,
)

log = structlog.get_logger("deepinfer.worker")

KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # what the CUDA kernels are run in here
CHANNEL_LAST_ALIGN = 8  # causal_conv1d's channel-last kernel: dim a multiple of 8

Tensors = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class DeltaOps:
    """A layer's sequence operators (the module docstring's interface); `name` says which
    implementation each is."""

    name: str
    conv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Tensors]
    conv_step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Tensors]
    chunk: Callable[..., Tensors]
    step: Callable[..., Tensors]


def torch_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor) -> Tensors:
    q, k = normalize_qk(q, k, v.shape[-2])
    return chunked_delta_rule(q, k, v, g, beta, state)


def torch_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, states: torch.Tensor) -> Tensors:
    q, k = normalize_qk(q, k, v.shape[-2])
    return recurrent_delta_rule(q, k, v, g, beta, states)


TORCH_OPS = DeltaOps("torch", causal_conv, causal_conv_step, torch_chunk, torch_step)


# --- fla: the delta rule ---------------------------------------------------------------

def _repeat_heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> Tensors:
    """q, k [..., Hk, D] -> [..., Hv, D]: each key head for the value heads of its group."""
    group = num_v_heads // q.shape[-2]
    if group == 1:
        return q, k
    return q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)


def fla_chunk(chunk_fn: Callable[..., Tensors]) -> Callable[..., Tensors]:
    """Our `chunk` over fla's `chunk_gated_delta_rule` (the module docstring's mapping)."""

    def chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, state: torch.Tensor) -> Tensors:
        q, k = _repeat_heads(q, k, v.shape[-2])
        o, after = chunk_fn(q=q[None], k=k[None], v=v[None], g=g.float()[None],
                            beta=beta.to(v.dtype)[None], scale=q.shape[-1] ** -0.5,
                            initial_state=state.float()[None].contiguous(),
                            output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o[0].float(), after[0]  # [T, Hv, Dv], [Hv, Dk, Dv]

    return chunk


def fla_step(recurrent_fn: Callable[..., Tensors]) -> Callable[..., Tensors]:
    """Our `step` over fla's `fused_recurrent_gated_delta_rule`: B sequences of one token."""

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, states: torch.Tensor) -> Tensors:
        q, k = _repeat_heads(q, k, v.shape[-2])
        o, after = recurrent_fn(q=q[:, None], k=k[:, None], v=v[:, None], g=g.float()[:, None],
                                beta=beta.to(v.dtype)[:, None], scale=q.shape[-1] ** -0.5,
                                initial_state=states.float().contiguous(),
                                output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o[:, 0].float(), after  # [B, Hv, Dv], [B, Hv, Dk, Dv]

    return step


# --- causal_conv1d: the convolution ----------------------------------------------------

def cuda_conv(conv_fn: Callable[..., torch.Tensor]) -> Callable[..., Tensors]:
    """Our `conv` over causal_conv1d's `causal_conv1d_fn`, channel-last."""

    def conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> Tensors:
        if x.shape[1] % CHANNEL_LAST_ALIGN:
            return causal_conv(x, window, weight)
        x = x.contiguous()  # [T, C] row-major: as (1, C, T), channel-last
        initial = window.to(x.dtype).t().contiguous().t()[None]  # (1, C, K-1), channel-last
        out = conv_fn(x.t()[None], weight.to(x.dtype), bias=None, initial_states=initial,
                      activation="silu")  # (1, C, T)
        return out[0].t(), torch.cat([initial[0].t(), x])

    return conv


def cuda_conv_step(update_fn: Callable[..., torch.Tensor]) -> Callable[..., Tensors]:
    """Our `conv_step` over causal_conv1d's `causal_conv1d_update` (on a copy of the
    windows, which it shifts in place)."""

    def conv_step(x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor) -> Tensors:
        after = windows.to(x.dtype).clone()  # [B, C, K-1]
        out = update_fn(x.contiguous(), after, weight.to(x.dtype), bias=None,
                        activation="silu")  # [B, C]
        return out, after

    return conv_step


# --- the choice ------------------------------------------------------------------------

# An installed package that fails to import (a Triton or torch it was not built for) is
# logged and passed over, as a missing one is: the torch operators serve the model.

def _import_fla() -> tuple[Callable[..., Tensors], Callable[..., Tensors]] | None:
    try:
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except Exception as e:  # noqa: BLE001
        _not_imported("fla", e)
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _import_causal_conv1d() -> tuple[Callable[..., torch.Tensor],
                                     Callable[..., torch.Tensor]] | None:
    try:
        from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    except Exception as e:  # noqa: BLE001
        _not_imported("causal_conv1d", e)
        return None
    return causal_conv1d_fn, causal_conv1d_update


def _not_imported(package: str, error: Exception) -> None:
    if not isinstance(error, ModuleNotFoundError):  # installed, and broken: say how
        log.warning("delta_rule_kernel_import_failed", package=package,
                    error=f"{type(error).__name__}: {error}")


def delta_ops(device: torch.device, dtype: torch.dtype) -> DeltaOps:
    """The operators for a model on `device` in `dtype` (the module docstring's choice)."""
    return _choose(device.type, dtype)


@functools.cache
def _choose(device_type: str, dtype: torch.dtype) -> DeltaOps:
    ops = TORCH_OPS
    if device_type == "cuda" and dtype not in KERNEL_DTYPES:
        ops = DeltaOps(f"torch ({str(dtype).removeprefix('torch.')}: the CUDA kernels run "
                       "in 16 bits here)", *_operators(TORCH_OPS))
    elif device_type == "cuda":
        fla, conv = _import_fla(), _import_causal_conv1d()
        rule = "fla" if fla is not None else "torch (fla does not import)"
        conv_name = "causal_conv1d" if conv is not None else "torch (causal_conv1d does not import)"
        ops = DeltaOps(f"delta rule: {rule}; conv: {conv_name}",
                       cuda_conv(conv[0]) if conv is not None else causal_conv,
                       cuda_conv_step(conv[1]) if conv is not None else causal_conv_step,
                       fla_chunk(fla[0]) if fla is not None else torch_chunk,
                       fla_step(fla[1]) if fla is not None else torch_step)
    log.info("delta_rule_kernels", device=device_type, dtype=str(dtype).removeprefix("torch."),
             ops=ops.name)
    return ops


def _operators(ops: DeltaOps) -> tuple[Callable[..., Tensors], ...]:
    return ops.conv, ops.conv_step, ops.chunk, ops.step
