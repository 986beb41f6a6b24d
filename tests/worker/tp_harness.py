"""One rank of a tensor-parallel reference run, started as a torchrun-style process.

Each rank loads its shard, prefills a prompt in chunks, then decodes greedily,
all through `ModelRunner.execute` with the same plans on every rank. Rank 0
writes the prompt logits and tokens to a safetensors file (no pickle crosses
the process boundary); every rank writes its digest, and a hash of the experts and
weights its MoE router chose for every token (empty for a dense model). With a list of
`runs` (each its own model, prompt and output), the ranks do them one after another in
one launch: the process group and the imports are paid for once.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable

import torch
from safetensors.torch import save_file

from tests.conftest import fitting_max_model_len
from wire.config import EngineConfig
from wire.step import NewSequence, ScheduledChunk, StepPlan
from worker.distributed import (
    RankInfo,
    init_tensor_parallel,
    set_torch_threads,
    shutdown_tensor_parallel,
)
from worker.model_runner import ModelRunner


def record_routing() -> Callable[[], str]:
    """Hash every routing decision of this rank (expert ids and their weights, bit for
    bit): the ranks must agree, or their partial expert outputs do not sum to one MoE."""
    from worker import moe

    seen, route = hashlib.sha256(), moe.route

    def recording(x: torch.Tensor, w: moe.MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = route(x, w)
        seen.update(experts.numpy().tobytes() + weights.float().numpy().tobytes())
        return weights, experts

    moe.route = recording  # moe_forward looks it up at each call
    return seen.hexdigest


def main() -> None:
    args = json.loads(sys.argv[1])
    info = RankInfo.from_env()
    set_torch_threads(info.local_world_size)
    tp = init_tensor_parallel(info, torch.device("cpu"))
    for run_args in args.get("runs") or [args]:
        run_one(run_args, info, tp)
    if info.world_size > 1:
        torch.distributed.barrier()  # every rank is past its last collective
    shutdown_tensor_parallel()


def run_one(args: dict, info: RankInfo, tp) -> None:
    kv_cache_memory = args.get("kv_cache_memory", 64 << 20)
    config = EngineConfig(model=args["model"], dtype=args["dtype"], world_size=info.world_size,
                          kv_cache_memory=kv_cache_memory,
                          kv_cache_dtype=args.get("kv_cache_dtype", "auto"),
                          max_model_len=fitting_max_model_len(args["model"], kv_cache_memory,
                                                              info.world_size))
    runner = ModelRunner(config, tp, torch.device("cpu"))
    routing = record_routing() if runner.model_config.is_moe else None
    prompt, chunk = args["prompt"], args["chunk"]
    bs = config.block_size
    total = len(prompt) + args["new_tokens"]
    plans = [StepPlan(step=0, new_seqs=[NewSequence(1, list(range(-(-total // bs))))])]
    for start in range(0, len(prompt), chunk):
        part = prompt[start : start + chunk]
        plans.append(StepPlan(step=len(plans), chunks=[
            ScheduledChunk(1, part, start, start + chunk >= len(prompt))]))
    logits = []
    tokens: list[int] = []

    def run(plan: StepPlan) -> None:
        out = runner.execute(plan, return_logits=True)
        if out.logits is not None:
            logits.append(out.logits)
        if any(c.sample for c in plan.batch()):
            # every rank needs the sampled token: rank 0 sends it, as the scheduler would
            t = torch.tensor([out.sampled[0][1] if out.sampled else 0])
            if info.world_size > 1:
                torch.distributed.broadcast(t, src=0)
            tokens.append(int(t.item()))

    for plan in plans:
        run(plan)
    while len(tokens) < args["new_tokens"]:
        pos = len(prompt) + len(tokens) - 1
        run(StepPlan(step=len(plans) + len(tokens), chunks=[
            ScheduledChunk(1, [tokens[-1]], pos, True)]))
    prompt_logits = torch.cat(logits)[: len(prompt)] if logits else torch.empty(0)
    if info.rank == 0:
        save_file({"logits": prompt_logits.float().contiguous(),
                   "tokens": torch.tensor(tokens)}, args["out"])
    with open(f"{args['out']}.digest{info.rank}", "w") as f:
        f.write(str(runner.digest.value))
    with open(f"{args['out']}.routing{info.rank}", "w") as f:
        f.write(routing() if routing else "")


if __name__ == "__main__":
    main()
