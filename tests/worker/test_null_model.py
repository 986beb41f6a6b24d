"""The null model (worker/null_model.py) and a ModelRunner that holds it, in process."""

from __future__ import annotations

import inspect
import time

import numpy as np
import pytest
import torch

from scheduler.guided import token_mask
from wire.config import EngineConfig
from wire.digest import StateDigest
from wire.step import (
    PENDING_TOKEN,
    AppendBlocks,
    DecodeBatch,
    NewSequence,
    ScheduledChunk,
    StepPlan,
)
from worker.distributed import TensorParallelGroup
from worker.forward import ModelForward
from worker.gguf import load_config
from worker.model_runner import ModelRunner
from worker.null_model import NULL_HEAD_DIM, NULL_KV_HEADS, NullModel


def null_model(default_model, forward_ms: float = 0.0, rank: int = 0,
               world_size: int = 1) -> NullModel:
    return NullModel(load_config(default_model), TensorParallelGroup(rank, world_size), forward_ms)


def test_tokens_depend_on_the_last_token_and_position_only_and_are_never_eos(default_model):
    model = null_model(default_model)
    eos = set(load_config(default_model).eos_token_ids)
    tokens = [model.token(ScheduledChunk(1, [t], p, True))
              for t in range(0, 8000, 7) for p in (1, 17, 300)]
    assert not eos & set(tokens)
    assert len(set(tokens)) > len(tokens) // 2, "tokens should spread over the vocabulary"
    # the rest of the chunk, the sequence and the start do not matter, only (last, position)
    a = model.token(ScheduledChunk(5, [11, 12, 13], 10, True))
    assert a == model.token(ScheduledChunk(9, [99, 13], 11, True))
    assert a == null_model(default_model).token(ScheduledChunk(1, [13], 12, True))


def test_a_guided_mask_is_honoured(default_model):
    model = null_model(default_model)
    vocab = load_config(default_model).vocab_size
    for allowed in ([100], [5, 6000], list(range(4000, 4100))):
        mask = token_mask(allowed, vocab)
        for last in range(20):
            assert model.token(ScheduledChunk(1, [last], 40, True, mask)) in allowed
    # a mask that allows nothing: the unmasked token (as the real sampler does)
    empty = np.zeros(-(-vocab // 32), dtype=np.uint32).tobytes()
    chunk = ScheduledChunk(1, [7], 40, True)
    assert model.token(ScheduledChunk(1, [7], 40, True, empty)) == model.token(chunk)


def test_forward_waits_at_least_its_time_and_only_rank_0_samples(default_model):
    plan = StepPlan(0, chunks=[ScheduledChunk(1, [5, 6], 0, True),
                               ScheduledChunk(2, [7], 3, False)])
    rank0, rank1 = null_model(default_model, 30.0), null_model(default_model, 30.0, 1, 2)
    t0 = time.perf_counter()
    sampled = rank0.forward(plan)
    assert time.perf_counter() - t0 >= 0.030  # a lower bound only: sleeps overshoot
    assert sampled == [(1, rank0.token(plan.batch()[0]))]
    assert rank1.forward(plan) == []


def test_world_sizes_the_model_cannot_split_are_refused(default_model):
    with pytest.raises(ValueError, match="does not divide"):
        null_model(default_model, world_size=3)


def test_the_null_model_is_a_forward_pass_like_the_real_models():
    """The runner holds the real model's forward pass or the null model and never asks
    which (worker/forward.py): every method of the one is on the other, with the same
    parameters, so a path only a GPU takes cannot call what the null model lacks."""
    methods = {name: f for name, f in vars(ModelForward).items()
               if callable(f) and not name.startswith("_")}
    assert {"launch", "finish", "busy_s", "done", "profile_num_blocks"} <= set(methods)
    for name, method in methods.items():
        ours = inspect.signature(getattr(NullModel, name)).parameters
        assert list(ours) == list(inspect.signature(method).parameters), name
    assert NullModel.attn is None  # it attends to nothing


def test_runner_applies_plans_through_the_real_paths_without_weights(default_model):
    config = EngineConfig(model=str(default_model), dtype="float32", null_model_forward_ms=0.0,
                          kv_cache_memory=64 * 1024, host_cache_memory=16 * 1024,
                          max_model_len=256)
    runner = ModelRunner(config, TensorParallelGroup(0, 1), torch.device("cpu"))
    assert isinstance(runner.model, NullModel) and runner.attn is None
    layers = load_config(default_model).num_layers
    # tiny pages, the model's layers: 1 KiB a block in float32
    assert runner.kv_bytes_per_block == 2 * layers * 16 * NULL_KV_HEADS * NULL_HEAD_DIM * 4
    assert (runner.num_device_blocks, runner.num_host_blocks) == (64, 16)
    mirror = StateDigest(64, 16)
    plans = [
        StepPlan(0, new_seqs=[NewSequence(1, [0, 1])], register=[(0, 77)],
                 chunks=[ScheduledChunk(1, list(range(10, 30)), 0, True)]),
        StepPlan(1, swap_out=[(0, 3)], append=[AppendBlocks(1, [2])],
                 chunks=[ScheduledChunk(1, [40], 32, True)]),
        StepPlan(2, swap_in=[(3, 5)], close=[1]),
    ]
    runner.kv.k[:, 0] = 1.0  # block 0's (tiny) KV goes out to slot 3 and back into block 5
    for plan in plans:
        out = runner.execute(plan)
        mirror.apply(plan)
        assert out.digest == mirror.value
    assert runner.block_tables == {}
    assert bool((runner.kv.k_host[:, 3] == 1).all()) and bool((runner.kv.k[:, 5] == 1).all())
    first = runner.execute(StepPlan(3, new_seqs=[NewSequence(2, [6])],
                                    chunks=[ScheduledChunk(2, [5], 0, True)]))
    assert first.sampled == [(2, runner.model.token(ScheduledChunk(2, [5], 0, True)))]
    t = first.timing
    assert t.apply_s > 0 and t.digest_s > 0 and t.prepare_s > 0 and t.forward_s > 0
    assert t.gap_s > 0, "the time since step 1's forward"
    # the page table is still checked against the block table, as for the real model
    with pytest.raises(AssertionError, match="blocks"):
        runner.execute(StepPlan(4, chunks=[ScheduledChunk(2, [1] * 20, 1, True)]))


def test_decodes_run_as_the_same_chunks_would(default_model):
    """A plan's columnar decodes (StepPlan.decodes) are the batch's first rows: the same
    inputs, samples and digests as the one-token chunks they stand for, put first; a
    PENDING_TOKEN among them is resolved in the batch and in the plan."""
    config = EngineConfig(model=str(default_model), dtype="float32", null_model_forward_ms=0.0,
                          kv_cache_memory=64 * 1024, max_model_len=256)
    runners = [ModelRunner(config, TensorParallelGroup(0, 1), torch.device("cpu"))
               for _ in range(2)]
    opened = StepPlan(0, new_seqs=[NewSequence(1, [0, 1]), NewSequence(2, [2]),
                                   NewSequence(3, [3, 4])])
    for r in runners:
        r.execute(opened)
        r.last_token[2] = 4321  # what seq 2 sampled in the step before
    prefill = ScheduledChunk(3, list(range(10, 30)), 0, True)
    columnar = StepPlan(1, decodes=DecodeBatch([1, 2], [20, 9], [55, PENDING_TOKEN]),
                        chunks=[prefill])
    chunked = StepPlan(1, chunks=[ScheduledChunk(1, [55], 20, True),
                                  ScheduledChunk(2, [PENDING_TOKEN], 9, True), prefill])
    assert [(c.seq_id, c.token_ids, c.start_pos) for c in columnar.batch()] == [
        (c.seq_id, c.token_ids, c.start_pos) for c in chunked.chunks]
    steps = [r.prepare(p) for r, p in zip(runners, (columnar, chunked))]
    a, b = (s.batch for s in steps)
    assert a.token_ids.tolist() == b.token_ids.tolist()
    assert a.positions.tolist() == b.positions.tolist() == [20, 9, *range(20)]
    assert a.slots.tolist() == b.slots.tolist() and a.sample_rows == b.sample_rows == [0, 1, 21]
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
        assert getattr(a.meta, name).tolist() == getattr(b.meta, name).tolist(), name
    outs = []
    for r, step in zip(runners, steps):
        r.launch(step)
        outs.append(r.finish(step))
    assert columnar.decodes.token_ids == [55, 4321]  # resolved in place, as in a chunk
    assert outs[0].sampled == outs[1].sampled and outs[0].digest == outs[1].digest
    assert [s for s, _ in outs[0].sampled] == [1, 2, 3]
    model = runners[0].model
    assert outs[0].sampled[:2] == [(1, model.token(ScheduledChunk(1, [55], 20, True))),
                                   (2, model.token(ScheduledChunk(2, [4321], 9, True)))]
