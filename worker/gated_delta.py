"""The Gated DeltaNet's sequence operators (Qwen3.5, Qwen3-Next), written from the math.

A linear-attention layer keeps, per value head, a state matrix S [Dk, Dv] in place of a
KV cache. Token t, with q_t and k_t L2-normalised (q_t also scaled by Dk^-1/2), a decay
g_t <= 0 in log space and a write strength beta_t in (0, 1), does

    S   <- exp(g_t) S                               (forget)
    S   <- S + k_t (beta_t (v_t - S^T k_t))^T       (the delta rule: k_t's read moves to v_t)
    o_t  = S^T q_t

one token at a time in `recurrent_delta_rule` (decodes, batched over sequences), and a
block of tokens at a time in `chunked_delta_rule` (prefill), which gives the same result
with matrix products: within a block of n tokens with cumulative decays G_i = g_1 + ... + g_i
and the state S0 before it, the writes u_i = beta_i (v_i - S_{i-1}'^T k_i) solve the
unit lower-triangular system

    u_i + sum_{j<i} beta_i exp(G_i - G_j) (k_i . k_j) u_j = beta_i v_i - beta_i exp(G_i) S0^T k_i

so u = U - W S0 with U, W one triangular solve each; then
o_i = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j and the state after the
block is exp(G_n) S0 + sum_j exp(G_n - G_j) k_j u_j^T. Both in float32.

Before the rule, q, k and v pass a causal depthwise convolution over the last `K` inputs
of each channel, then SiLU (`causal_conv`); its state is the K - 1 inputs before the next.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # inside the rsqrt of the L2 norm, as the reference kernels have it


def causal_conv(x: torch.Tensor, window: torch.Tensor,
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk through the causal depthwise convolution and SiLU.

    x [T, C]: the chunk's inputs; window [C, K-1]: the K-1 inputs before it (zeros for a
    sequence's start); weight [C, K]. Returns (SiLU(conv) [T, C], the inputs with the
    window in front [K-1+T, C]): the window after n tokens is rows n .. n+K-2 of it
    (`window_after`)."""
    c = x.shape[1]
    padded = torch.cat([window.t().to(x.dtype), x])  # [K-1+T, C]
    if x.is_cuda and x.dtype == torch.float32:
        # cuDNN rounds a float32 convolution's inputs to TF32 by torch's default (unlike a
        # matmul's), and float32 on CUDA is the exactness check against the CPU: the taps
        # summed here instead, as causal_conv_step does
        return F.silu(sum_taps(padded, weight.to(x.dtype))), padded
    out = F.conv1d(padded.t()[None], weight[:, None, :].to(x.dtype), groups=c)[0]  # [C, T]
    return F.silu(out.t()), padded


def sum_taps(padded: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The causal depthwise conv without SiLU: padded [K-1+T, C], weight [C, K] -> [T, C]."""
    return (padded.unfold(0, weight.shape[1], 1) * weight).sum(-1)  # [T, C, K] summed


def window_after(padded: torch.Tensor, num_tokens: int, width: int) -> torch.Tensor:
    """The conv window [C, K-1] after `num_tokens` of the chunk `padded` came from."""
    return padded[num_tokens : num_tokens + width - 1].t()


def causal_conv_step(x: torch.Tensor, windows: torch.Tensor,
                     weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences: x [B, C], windows [B, C, K-1], weight [C, K].
    Returns (SiLU(conv) [B, C], the windows after [B, C, K-1])."""
    full = torch.cat([windows.to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, K]
    out = (full * weight.to(x.dtype)).sum(-1)
    return F.silu(out), full[:, :, 1:]


def normalize_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, Dk] -> float32 [..., Hv, Dk]: L2-normalised, q scaled by Dk^-1/2,
    each key head repeated for the value heads of its group (value head j reads key
    head j // (Hv / Hk))."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    group = num_v_heads // k.shape[-2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)
    return q, k


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences. q, k [B, H, Dk] (normalize_qk's); v [B, H, Dv];
    g, beta [B, H]; state [B, H, Dk, Dv] float32. Returns (o [B, H, Dv], the new state),
    float32; `state` is not written."""
    v, g, beta = v.float(), g.float(), beta.float()
    state = state * g.exp()[..., None, None]
    read = torch.einsum("bhkv,bhk->bhv", state, k)  # what S holds at k now
    write = beta[..., None] * (v - read)  # [B, H, Dv]
    state = state + k[..., :, None] * write[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, block: int = 64,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's T tokens. q, k [T, H, Dk] (normalize_qk's); v [T, H, Dv]; g, beta
    [T, H]; state [H, Dk, Dv] float32 (the state before the first token). Returns
    (o [T, H, Dv], the state after the last token), float32. The tokens go `block` at a
    time (the module docstring's algebra)."""
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))  # [H, T, D]
    g, beta = g.float().t(), beta.float().t()  # [H, T]
    num_tokens = q.shape[1]
    out = torch.empty_like(v)
    for s in range(0, num_tokens, block):
        e = min(s + block, num_tokens)
        qb, kb, vb, bb = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e]
        cum = g[:, s:e].cumsum(-1)  # [H, n]: G_i
        n = e - s
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # exp(G_i - G_j) on and below the diagonal, 0 above (masked before the exp: above
        # the diagonal the difference is positive and may overflow)
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()
        system = (bb[:, :, None] * (kb @ kb.transpose(-1, -2)) * decay).tril(-1)
        system = system + torch.eye(n, device=q.device)  # I + A, unit lower-triangular
        u = torch.linalg.solve_triangular(system, bb[..., None] * vb, upper=False,
                                          unitriangular=True)
        w = torch.linalg.solve_triangular(system, (bb * cum.exp())[..., None] * kb,
                                          upper=False, unitriangular=True)
        writes = u - w @ state  # [H, n, Dv]
        out[:, s:e] = (qb * cum.exp()[..., None]) @ state \
            + ((qb @ kb.transpose(-1, -2)) * decay) @ writes
        last = cum[:, -1:]  # [H, 1]: G_n
        state = state * last.exp()[..., None] \
            + (kb * (last - cum).exp()[..., None]).transpose(-1, -2) @ writes
    return out.transpose(0, 1), state
