"""Parameter and FLOP counts of a Llama-shaped model (a worker's ModelConfig), for the
benchmarks' achieved-TFLOP/s figures."""

from __future__ import annotations


def linear_parameters(mc) -> int:
    """Weights of the linear layers of all decoder layers (what a token multiplies through)."""
    h, d = mc.hidden_size, mc.head_dim
    attn = h * (mc.num_heads + 2 * mc.num_kv_heads) * d + mc.num_heads * d * h
    return mc.num_layers * (attn + 3 * h * mc.intermediate_size)


def num_parameters(mc) -> int:
    """All weights (norms left out): the linear layers, the embedding and the LM head."""
    embed = mc.vocab_size * mc.hidden_size
    return linear_parameters(mc) + embed * (1 if mc.tie_word_embeddings else 2)


def prefill_flop(mc, n: int) -> int:
    """Floating-point operations of an n-token causal prefill (any chunking): the linear
    layers, attention (query j reads j + 1 keys: QK and PV are 2 * head_dim each a pair),
    and the LM head on the one sampled row."""
    attention = mc.num_layers * mc.num_heads * 2 * mc.head_dim * n * (n + 1)
    return 2 * linear_parameters(mc) * n + attention + 2 * mc.hidden_size * mc.vocab_size
