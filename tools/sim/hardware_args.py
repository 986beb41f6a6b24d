"""The simulator's model and hardware flags: presets (or a checkpoint's config.json) into
a cost model and tier capacities, printed before the run so the bytes can be checked."""

from __future__ import annotations

import argparse
import dataclasses

from rich.console import Console

from tools.sim.costs import PREFILL_MFU, HardwareCostModel
from tools.sim.presets import HARDWARE, MODELS, TierCapacities, model_from_config, tier_capacities


def add_hardware_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-preset", choices=sorted(MODELS), default=None)
    p.add_argument("--model-config", default=None,
                   help="a checkpoint's config.json (or its directory), read by the engine's "
                        "own loader")
    p.add_argument("--hardware-preset", choices=sorted(HARDWARE), default=None)
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (all GPUs)")
    p.add_argument("--prefill-mfu", type=float, default=PREFILL_MFU)
    p.add_argument("--contiguous-copies", action="store_true",
                   help="tier copies of whole blocks at the link's rate (the engine copies "
                        "per layer: ~5 GB/s)")
    p.add_argument("--no-overlap", action="store_true",
                   help="the engine's overhead adds to the forward instead of hiding behind it")
    p.add_argument("--no-host-tier", action="store_true")
    p.add_argument("--tier-scale", type=float, default=1.0,
                   help="multiply both tiers' capacities (with --agents scaled alike, a "
                        "smaller run keeps the full-scale ratio of live context to cache)")
    p.add_argument("--attention-dp", action="store_true",
                   help="data-parallel attention: each rank holds whole tokens of its own "
                        "sequences (how MLA models are served)")
    p.add_argument("--disk-bytes-per-s", type=float, default=None,
                   help="the node's disk read rate in bytes/s, for the disk tier's cost per "
                        "block (default: the hardware preset's; e.g. a measured figure)")


def hardware_cost(args: dict) -> tuple[HardwareCostModel | None, TierCapacities | None]:
    has_model = args["model_preset"] or args["model_config"]
    if not has_model and not args["hardware_preset"]:
        if args.get("disk_bytes_per_s") is not None:
            raise SystemExit("--disk-bytes-per-s goes with the presets (without them: "
                             "--disk-s-per-block)")
        return None, None
    if not has_model or not args["hardware_preset"]:
        raise SystemExit("--hardware-preset and --model-preset (or --model-config) go together")
    model = MODELS[args["model_preset"]] if args["model_preset"] else \
        model_from_config(args["model_config"])
    hw = HARDWARE[args["hardware_preset"]]
    if args.get("disk_bytes_per_s") is not None:
        if args["disk_bytes_per_s"] <= 0:
            raise SystemExit("--disk-bytes-per-s must be positive")
        hw = dataclasses.replace(hw, disk_bytes_per_s=args["disk_bytes_per_s"])
    caps = tier_capacities(model, hw, args["tp"], attention_dp=args["attention_dp"])
    if args["tier_scale"] != 1.0:
        caps = dataclasses.replace(caps, device_tokens=int(caps.device_tokens * args["tier_scale"]),
                                   host_tokens=int(caps.host_tokens * args["tier_scale"]))
    cost = HardwareCostModel(model, hw, caps.tp, prefill_mfu=args["prefill_mfu"],
                             contiguous_copies=args["contiguous_copies"],
                             overlap=not args["no_overlap"], attention_dp=args["attention_dp"])
    return cost, caps


def print_capacities(console: Console, cost: HardwareCostModel, caps: TierCapacities) -> None:
    m, hw = cost.model, cost.hardware
    console.print(
        f"{m.name} on {hw.name} (TP {caps.tp}{', DP attention' if cost.attention_dp else ''}): "
        f"{caps.kv_bytes_per_token / 1024:.1f} KiB of KV "
        f"per token per rank, weights {caps.weight_bytes_per_gpu / 1e9:.1f} GB per GPU, "
        f"device tier {caps.device_tier_bytes_per_gpu / 1e9:.1f} GB per GPU = "
        f"{caps.device_tokens:,} tokens, host tier {caps.host_tokens:,} tokens")
    console.print(
        f"  decode {1e3 * cost.decode_fixed_s:.2f} ms + "
        f"{1e3 * cost.decode_s_per_context_token:.2e} ms per context token; prefill "
        f"{1 / cost.chunk_seconds(1, 0):,.0f} tok/s at no context, "
        f"{450_000 / cost.chunk_seconds(450_000, 0):,.0f} tok/s for a cold 450K prompt; "
        f"a block to/from host {1e6 * cost.swap_s_per_block:.0f} us "
        f"({cost.block_bytes_per_rank / 1024:.0f} KiB per rank at "
        f"{cost.copy_bytes_per_s / 1e9:.0f} GB/s); to/from disk "
        f"{1e6 * cost.disk_s_per_block:.0f} us ({cost.block_bytes_per_rank * cost.tp / 1024:.0f} "
        f"KiB per node at {hw.disk_bytes_per_s / 1e9:g} GB/s)")
