"""Times each compiled CPU kernel against the torch path the engine runs without it, for
the rank's kernel choice (worker/kernel_choice.py): the engine's own code both ways -- the
torch attention backend with and without each kernel, `Linear` with and without the
few-row kernel over the model's own weights, `Elementwise` with and without its kernels --
on the model's shapes, at the thread count the rank runs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from types import ModuleType

import torch

from worker import cpu_kernels
from worker.attention.base import AttentionMetadata
from worker.attention.torch_backend import TorchAttentionBackend
from worker.elementwise import Elementwise
from worker.kernel_choice import Measure, ModelShapes
from worker.kv_cache import KVCache
from worker.kv_quant import is_fp8, quantize
from worker.linear import Linear

PAGE = 16
PREFILL_LENS = [(256, 4096 + 256)]  # (query tokens, keys): a chunk behind a cached prefix
DECODE_LENS = [(1, 2048)] * 4  # the agents' decode batch
# Decode attention and the linear layers are memory-bound: they are timed over this many
# bytes of KV pages or weights (whole layers, at least one), so they come from memory as
# in a step over every layer, not from a cache one layer fits in.
STREAM_BYTES = 64 << 20
ELEMENTWISE_ROWS = (16, 256)  # a decode step's and a prefill chunk's tokens
RACE_ROUNDS = 9
RACE_SECONDS = 0.15  # per verdict, after the warm-up; at least two rounds

Piece = Callable[[], object]


def race(kernel: list[Piece], plain: list[Piece]) -> tuple[float, float]:
    """Seconds of each side's pieces (a layer's attention, one linear layer, one norm):
    each piece's best over a few rounds, summed. A piece is short, so some round of it
    runs undisturbed even on a busy machine (on 2 shared cores whole passes of 10-30 ms
    varied 3-6x from run to run; a parallel region waits for its slowest thread). A
    round runs every kernel piece, then every torch piece: each streams its weights or
    pages from memory, as a step over every layer does, not from the other's cache.
    One warm-up round first (threads woken, pages touched, oneDNN's primitives made)."""
    for piece in kernel + plain:
        piece()
    best = [[math.inf] * len(kernel), [math.inf] * len(plain)]
    start = time.perf_counter()
    for i in range(RACE_ROUNDS):
        for side, pieces in enumerate((kernel, plain)):
            for j, piece in enumerate(pieces):
                t = time.perf_counter()
                piece()
                best[side][j] = min(best[side][j], time.perf_counter() - t)
        if i >= 1 and time.perf_counter() - start > RACE_SECONDS:
            break
    return sum(best[0]), sum(best[1])


def measure_model(shapes: ModelShapes, layers: list[list[torch.Tensor]], eps: float) -> Measure:
    """(kernel, torch) seconds of a verdict (kernel_choice.VERDICTS); `layers`: each
    layer's linear weights, `eps` its norms'."""

    def measure(name: str) -> tuple[float, float]:
        kernels = cpu_kernels.load()
        assert kernels is not None, "nothing to measure without the kernels"
        with torch.inference_mode():
            if name in ("prefill", "decode"):
                return _race_attention(kernels, shapes, name)
            if name.startswith("small_linear"):
                return _race_linear(layers, int(name.rsplit("_", 1)[1]))
            return _race_elementwise(shapes, eps)

    return measure


def _race_attention(kernels: ModuleType, shapes: ModelShapes, path: str) -> tuple[float, float]:
    lens = PREFILL_LENS if path == "prefill" else DECODE_LENS
    h, hkv, d, dtype = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim, shapes.dtype
    num_pages = sum(-(-kv // PAGE) for _, kv in lens)
    layer_bytes = KVCache.bytes_per_block(1, num_pages * PAGE, hkv, d, shapes.kv)
    layers = 1 if path == "prefill" else max(1, min(8, STREAM_BYTES // layer_bytes))
    g = torch.Generator().manual_seed(0)
    # one random page of K and one of V everywhere: filling the pools costs a copy, not a
    # random draw per value (neither path's cost depends on the values)
    page = torch.randn(2, 1, PAGE, hkv, d, generator=g)
    pools = [_pool(page, num_pages, dtype, shapes.kv) for _ in range(layers)]
    meta = _scattered_pages(lens, num_pages, g)
    q = torch.randn(sum(n for n, _ in lens), h, d, generator=g).to(dtype)
    sides: list[list[Piece]] = []
    for use in (True, False):
        backend = TorchAttentionBackend(h, hkv, d, kernels=kernels, prefill_kernel=use,
                                        decode_kernel=use)
        backend.plan(meta)  # once a step; forward once a layer
        sides.append([partial(backend.forward, q, *kv) for kv in pools])
    return race(*sides)


def _pool(page: torch.Tensor, num_pages: int, dtype: torch.dtype,
          kv_dtype: torch.dtype) -> list[torch.Tensor]:
    """A layer's K and V pages of `kv_dtype` (and their scales, FP8), every page `page`."""
    shape = (2, num_pages, *page.shape[2:])
    if not is_fp8(kv_dtype):
        return list(page.to(dtype).expand(shape).contiguous())
    values, scales = quantize(page, kv_dtype)
    k, v = values.view(torch.uint8).expand(shape).contiguous().view(kv_dtype)
    k_scale, v_scale = scales.expand(shape[:-1]).contiguous()
    return [k, v, k_scale, v_scale]


def _scattered_pages(lens: list[tuple[int, int]], num_pages: int,
                     g: torch.Generator) -> AttentionMetadata:
    perm = torch.randperm(num_pages, generator=g).tolist()  # as a long-lived pool's are
    qo, kvp, last = [0], [0], []
    for q_len, kv_len in lens:
        n = -(-kv_len // PAGE)
        qo.append(qo[-1] + q_len)
        kvp.append(kvp[-1] + n)
        last.append(kv_len - (n - 1) * PAGE)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return AttentionMetadata(i32(qo), i32(kvp), i32(perm), i32(last), PAGE)


def _race_linear(layers: list[list[torch.Tensor]], rows: int) -> tuple[float, float]:
    streamed: list[torch.Tensor] = []
    for weights in layers:  # whole layers, the first always
        if streamed and sum(w.nbytes for w in streamed) >= STREAM_BYTES:
            break
        streamed += weights
    g = torch.Generator().manual_seed(rows)
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=g).to(w.dtype) for w in streamed}
    cpu = torch.device("cpu")
    sides = [[partial(linear, xs[w.shape[1]], w) for w in streamed]
             for linear in (Linear(cpu), Linear(cpu, kernel_rows=()))]
    return race(*sides)


def _race_elementwise(shapes: ModelShapes, eps: float) -> tuple[float, float]:
    """A layer's passes (two residual adds with their norms, SiLU * up) at a decode
    step's and a prefill chunk's rows, and the final norm."""
    cpu, dtype = torch.device("cpu"), shapes.dtype
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(shapes.hidden, generator=g).to(dtype)
    sides: list[list[Piece]] = []
    for ops in (Elementwise(cpu, dtype), Elementwise(cpu, dtype, use_kernels=False)):
        pieces: list[Piece] = []
        for t in ELEMENTWISE_ROWS:
            h = torch.randn(t, shapes.hidden, generator=g).to(dtype)
            delta = (torch.randn(t, shapes.hidden, generator=g) * 1e-3).to(dtype)
            pieces += [partial(ops.add_rms_norm, h, delta, weight, eps)] * 2
            pieces.append(partial(ops.rms_norm, h, weight, eps))
            if shapes.intermediate:
                gate_up = torch.randn(t, 2 * shapes.intermediate, generator=g).to(dtype)
                pieces.append(partial(ops.silu_mul, gate_up))
        sides.append(pieces)
    return race(*sides)
