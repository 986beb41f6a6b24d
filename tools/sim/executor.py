"""The simulator's ranks: `CostModelExecutor` mirrors every plan as a rank does and charges
virtual time for it from a cost model (`CostModel`, calibrated on the deployment's read
rate, or `tools.sim.costs.HardwareCostModel`, from bytes and FLOPs)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tools.sim.costs import HardwareCostModel
from wire.digest import StateDigest
from wire.lifecycle import EngineLimits, WorkerReady
from wire.step import RankTiming, StepPlan, StepResult


@dataclass
class CostModel:
    """Seconds per unit of work, for the whole node.

    A computed prompt token costs a fixed part (its matmuls) plus a part per token of
    context it attends to. Calibrated on the deployment: reading a 450K-token prompt
    from scratch at its raw ~200,000 tokens/s takes 2.25 s = 450K * 1e-6 +
    (450K^2 / 2) * 1.78e-11. The context term is why a hit does not make the new
    tokens of a long conversation free: they still attend to 450K cached tokens.
    """

    prefill_s_per_token: float = 1e-6
    prefill_s_per_token_context: float = 1.78e-11
    decode_s_per_step: float = 0.020  # a decode step's fixed cost (weights read once)
    decode_s_per_seq: float = 0.0002  # plus per running sequence (its KV read)
    swap_s_per_block: float = 2e-6  # a 16-token block over PCIe, per direction
    # A block read from the disk tier, beside the steps (tools/benchmarks/disk.py measured
    # 11.4 GB/s from the page cache on the CPU machine; a cold NVMe read is ~3 GB/s):
    # the ~100 KB a 16-token block moves at PCIe's ~50 GB/s in swap_s_per_block, at 3 GB/s.
    # Writes run in the background and are not charged. (The presets' cost model takes it
    # from the hardware's disk bandwidth: tools/sim/costs.py.)
    disk_s_per_block: float = 3.3e-5

    def chunk_seconds(self, num_tokens: int, start_pos: int) -> float:
        context = num_tokens * start_pos + num_tokens * (num_tokens + 1) // 2
        return num_tokens * self.prefill_s_per_token + context * self.prefill_s_per_token_context

    def decode_seconds(self, num_seqs: int, context_tokens: int = 0) -> float:
        return self.decode_s_per_step + num_seqs * self.decode_s_per_seq if num_seqs else 0.0

    def step_seconds(self, forward_s: float, num_seqs: int) -> float:
        return forward_s  # no engine overhead in the token-calibrated model


class CostModelExecutor:
    """The executor interface, answered by a cost model instead of ranks."""

    def __init__(self, cost: CostModel | HardwareCostModel, num_device_blocks: int,
                 num_host_blocks: int, vocab_size: int = 128_000,
                 max_model_len: int = 1_048_576, num_disk_blocks: int = 0) -> None:
        self.cost = cost
        self.ready = WorkerReady(0, "simulated", EngineLimits(
            vocab_size=vocab_size, max_model_len=max_model_len, eos_token_ids=(),
            num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks,
            num_disk_blocks=num_disk_blocks))
        self.mirror = StateDigest(num_device_blocks, num_host_blocks, num_disk_blocks)
        self._submitted: deque[StepPlan] = deque()  # run in order, each at its collect
        self.clock = 0.0  # virtual seconds
        self.prompt_seconds: dict[int, float] = {}  # seq id -> time computing its prompt
        self.swap_seconds = 0.0
        self.disk_read_seconds = 0.0  # the disk's busy time reading (beside the steps)
        self._disk_free_at = 0.0
        self._reads: list[tuple[float, int]] = []  # (virtual end, read id), in order

    def start(self) -> list[WorkerReady]:
        return [self.ready]

    def submit(self, plan: StepPlan) -> None:
        self._submitted.append(plan)

    def collect(self) -> list[StepResult]:
        return self.step(self._submitted.popleft())

    def step(self, plan: StepPlan) -> list[StepResult]:
        self.mirror.apply(plan)  # exactly what a rank applies
        seconds = (len(plan.swap_out) + len(plan.swap_in)) * self.cost.swap_s_per_block
        self.swap_seconds += seconds
        # Disk reads run beside the steps, one after another at the disk's rate; a read
        # is reported in the first result at or after its (virtual) end.
        for op in plan.disk_read:
            start = max(self._disk_free_at, self.clock)
            self._disk_free_at = start + self.cost.disk_s_per_block
            self._reads.append((self._disk_free_at, op[0]))
            self.disk_read_seconds += self.cost.disk_s_per_block
        decodes = context = 0
        batch = plan.batch()
        for c in batch:
            if len(c.token_ids) == 1 and c.start_pos > 0 and c.sample:
                decodes += 1
                context += c.start_pos + 1
                continue
            t = self.cost.chunk_seconds(len(c.token_ids), c.start_pos)
            self.prompt_seconds[c.seq_id] = self.prompt_seconds.get(c.seq_id, 0.0) + t
            seconds += t
        seconds += self.cost.decode_seconds(decodes, context)
        seconds = self.cost.step_seconds(seconds, len(batch))
        if not batch and self._reads:  # nothing to run: wait for the reads, as an
            # idle rank does (at most worker/disk_tier.py's IDLE_WAIT_S, 20 ms)
            seconds = max(seconds, min(self._reads[-1][0] - self.clock, 0.02))
        self.clock += seconds
        read_done = [rid for t, rid in self._reads if t <= self.clock]
        self._reads = self._reads[len(read_done):]
        sampled = [(c.seq_id, 1000 + c.seq_id % 5000) for c in batch if c.sample]
        # a disk write lands in the background: done by this result
        return [StepResult(plan.step, 0, self.mirror.value, sampled,
                           RankTiming(forward_s=seconds),
                           disk_done=[op[0] for op in plan.disk_write],
                           disk_read_done=read_done)]

    def shutdown(self) -> None:
        pass
