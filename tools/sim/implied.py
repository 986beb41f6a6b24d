"""What the deployment's own figures imply about its model, on the hardware it names.

    python -m tools.sim.implied            # the 4x B200 deployment (DESIGN.md's figures)

The deployment reports ~57M device-tier and ~617M host-tier tokens on 4x B200, and a raw
(no cache) read rate of ~200,000 prompt tokens/s with ~450K-token contexts. Bytes and
FLOPs say which models those figures can belong to: the KV bytes per token the HBM
allows, the RAM the host tier would take for each real model, and the prefill rate a
450K-token prompt could reach even at the GPUs' full dense BF16 peak.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from tools.sim.presets import (
    ACTIVATION_RESERVE_SHARE,
    HARDWARE,
    MODELS,
    HardwarePreset,
    ModelPreset,
    kv_bytes_per_token_per_rank,
    tier_capacities,
)

DEPLOYMENT = {"hardware": "4xb200", "device_tokens": 57_000_000, "host_tokens": 617_000_000,
              "raw_read_tokens_per_s": 200_000, "context_tokens": 450_000}


def max_kv_bytes_per_token(hw: HardwarePreset, device_tokens: int,
                           weight_bytes_per_gpu: int = 0,
                           reserve_share: float = 0.0) -> float:
    """The most KV bytes per token (the node's, all ranks together) that lets the node's
    HBM hold `device_tokens` after the weights and the reserve."""
    per_gpu = hw.hbm_bytes_per_gpu * (1 - reserve_share) - weight_bytes_per_gpu
    return hw.num_gpus * per_gpu / device_tokens


def max_attention_flops_per_pair(hw: HardwarePreset, tokens_per_s: float, context: int,
                                 mfu: float = 1.0, linear_flops_per_token: float = 0.0) -> float:
    """The most attention FLOPs per (query, key) pair that lets a `context`-token prompt be
    read from scratch at `tokens_per_s` on the node at `mfu` of its peak."""
    flops_per_token = hw.num_gpus * hw.bf16_flops_per_s * mfu / tokens_per_s
    mean_pairs_per_token = (context + 1) / 2
    return (flops_per_token - linear_flops_per_token) / mean_pairs_per_token


def node_kv_bytes_per_token(model: ModelPreset, tp: int, attention_dp: bool = False) -> int:
    """KV bytes per token summed over the ranks (MLA under TP: one copy per rank)."""
    return int(kv_bytes_per_token_per_rank(model, tp, attention_dp) * tp)


def cold_prompt_tokens_per_s(model: ModelPreset, hw: HardwarePreset, context: int,
                             mfu: float = 1.0) -> float:
    """A `context`-token prompt computed from scratch at `mfu` of the node's BF16 peak."""
    pairs = context * (context + 1) // 2
    flops = 2 * model.active_linear_params() * context + model.attention_flops_per_pair() * pairs
    return context / (flops / (hw.num_gpus * hw.bf16_flops_per_s * mfu))


def analyse(dep: dict = DEPLOYMENT) -> dict:
    hw = HARDWARE[dep["hardware"]]
    out = {
        "max_kv_bytes_per_token_hbm_only": max_kv_bytes_per_token(hw, dep["device_tokens"]),
        "max_kv_bytes_per_token_with_reserve": max_kv_bytes_per_token(
            hw, dep["device_tokens"], reserve_share=ACTIVATION_RESERVE_SHARE),
        "max_attention_flops_per_pair_at_peak": max_attention_flops_per_pair(
            hw, dep["raw_read_tokens_per_s"], dep["context_tokens"]),
        "models": {},
    }
    layouts = [(name, m, False) for name, m in MODELS.items()]
    layouts += [(f"{name} DP-attn", m, True) for name, m in MODELS.items() if m.is_mla]
    for name, m, dp in layouts:
        caps = tier_capacities(m, hw, attention_dp=dp)
        kv = node_kv_bytes_per_token(m, caps.tp, dp)
        out["models"][name] = {
            "node_kv_bytes_per_token": kv,
            "hbm_for_device_tokens_gb": kv * dep["device_tokens"] / 1e9,
            "ram_for_host_tokens_tb": kv * dep["host_tokens"] / 1e12,
            "device_tokens": caps.device_tokens, "host_tokens": caps.host_tokens,
            "max_kv_after_weights": max_kv_bytes_per_token(
                hw, dep["device_tokens"], caps.weight_bytes_per_gpu, ACTIVATION_RESERVE_SHARE),
            "cold_450k_tok_s_at_peak": cold_prompt_tokens_per_s(m, hw, dep["context_tokens"]),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    a, dep = analyse(), DEPLOYMENT
    hw = HARDWARE[dep["hardware"]]
    console = Console(width=160)
    console.print(
        f"deployment: {dep['device_tokens'] / 1e6:.0f}M device-tier and "
        f"{dep['host_tokens'] / 1e6:.0f}M host-tier tokens on {hw.name} "
        f"({hw.num_gpus} x {hw.hbm_bytes_per_gpu / 1e9:.0f} GB HBM, "
        f"{hw.host_ram_bytes / 1e12:.1f} TB RAM assumed)")
    console.print(
        f"  the HBM allows at most {a['max_kv_bytes_per_token_hbm_only']:,.0f} B of KV per "
        f"token (whole node, no weights, no reserve); "
        f"{a['max_kv_bytes_per_token_with_reserve']:,.0f} B with vLLM's 10% reserve")
    table = Table(title="the deployment's figures against real models on 4x B200 (TP 4; "
                        "DP-attn: MLA with data-parallel attention)")
    for col in ("model", "KV B/token (node)", "max KV B/token after weights",
                "HBM for 57M tokens GB", "RAM for 617M tokens TB", "device tier tokens",
                "host tier tokens", "cold 450K prompt tok/s at 100% peak"):
        table.add_column(col, justify="right")
    for name, r in a["models"].items():
        table.add_row(name, f"{r['node_kv_bytes_per_token']:,}",
                      f"{r['max_kv_after_weights']:,.0f}",
                      f"{r['hbm_for_device_tokens_gb']:,.0f}",
                      f"{r['ram_for_host_tokens_tb']:,.1f}", f"{r['device_tokens']:,}",
                      f"{r['host_tokens']:,}", f"{r['cold_450k_tok_s_at_peak']:,.0f}")
    console.print(table)
    console.print(
        f"  raw read rate reported: {dep['raw_read_tokens_per_s']:,} tok/s at "
        f"~{dep['context_tokens']:,}-token contexts: at 100% of the node's BF16 peak that "
        f"allows at most {a['max_attention_flops_per_pair_at_peak']:,.0f} attention FLOPs per "
        f"(query, key) pair, before any linear layer (Llama-3.1-8B: "
        f"{MODELS['llama-3.1-8b'].attention_flops_per_pair():,})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
