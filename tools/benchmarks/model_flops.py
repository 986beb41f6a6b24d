"""Parameter and FLOP counts of a Llama-shaped model (a worker's ModelConfig), for the
benchmarks' achieved-TFLOP/s figures."""

from __future__ import annotations


def linear_parameters(mc, experts: int | None = None) -> int:
    """Weights of the linear layers of all decoder layers that a token multiplies through:
    in an MoE layer the router and its top-k experts (`experts`: count that many instead,
    e.g. all of them for the weights held)."""
    h, d = mc.hidden_size, mc.head_dim
    attn = h * (mc.num_heads + 2 * mc.num_kv_heads) * d + mc.num_heads * d * h
    moe_layers = len(getattr(mc, "moe_layers", ()))
    dense = (mc.num_layers - moe_layers) * 3 * h * mc.intermediate_size
    if not moe_layers:
        return mc.num_layers * attn + dense
    k = mc.num_experts_per_tok if experts is None else experts
    moe = moe_layers * (h * mc.num_experts + k * 3 * h * mc.moe_intermediate_size)
    return mc.num_layers * attn + dense + moe


def num_parameters(mc) -> int:
    """All weights (norms left out): the linear layers (every expert), the embedding and
    the LM head."""
    embed = mc.vocab_size * mc.hidden_size
    return (linear_parameters(mc, getattr(mc, "num_experts", 0) or None)
            + embed * (1 if mc.tie_word_embeddings else 2))


def prefill_flop(mc, n: int) -> int:
    """Floating-point operations of an n-token causal prefill (any chunking): the linear
    layers, attention (query j reads j + 1 keys: QK and PV are 2 * head_dim each a pair),
    and the LM head on the one sampled row."""
    attention = mc.num_layers * mc.num_heads * 2 * mc.head_dim * n * (n + 1)
    return 2 * linear_parameters(mc) * n + attention + 2 * mc.hidden_size * mc.vocab_size
