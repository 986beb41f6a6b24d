"""Probes that `tools.gpu.check` runs in child processes, one JSON line each.

    python -m tools.gpu.probe env | matmul | memory | swap | flashinfer

A child per probe keeps the checker's own process free of CUDA state, and a crash in
a probe (a bad driver, a failing kernel build) costs that probe only.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from functools import partial
from importlib import metadata
from pathlib import Path

MARKER = "DEEPINFER_GPU_PROBE "


def _run(cmd: list[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable: {e}"
    return (r.stdout + r.stderr).strip()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cuda_home() -> str | None:
    """The CUDA toolkit nvcc belongs to: CUDA_HOME if set, else the folder above nvcc's
    bin/ (through links), else /usr/local/cuda; the first holding cuda_runtime.h."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    candidates = [Path(os.path.realpath(nvcc)).parent.parent] if nvcc else []
    for home in [*candidates, Path("/usr/local/cuda")]:
        if (home / "include" / "cuda_runtime.h").is_file():
            return str(home)
    return None


def find_curand_include(home: str | None) -> str | None:
    """A folder holding curand_kernel.h: the toolkit's include/, else the headers that the
    nvidia-curand wheel installs next to torch (nvidia/*/include)."""
    candidates = [Path(home) / "include"] if home else []
    for site in map(Path, sys.path):
        if site.is_dir():
            candidates += sorted(site.glob("nvidia/*/include"))
    return next((str(p) for p in candidates if (p / "curand_kernel.h").is_file()), None)


def env() -> dict:
    """Facts about the machine: Python, torch, CUDA, the GPU, nvcc, memory, disk."""
    import torch

    facts: dict = {
        "python": sys.version.split()[0], "executable": sys.executable,
        "python_h": (Path(sysconfig.get_path("include")) / "Python.h").is_file(),
        "platform": platform.platform(), "cpus": os.cpu_count(),
        "mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        "disk_free_gib": shutil.disk_usage(Path.cwd()).free / 2**30,
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "versions": {d: _version(d) for d in ("flashinfer-python", "apache-tvm-ffi", "triton",
                                              "numpy", "pyzmq", "tokenizers", "pytest")},
        "nvcc": shutil.which("nvcc"), "cuda_home": cuda_home(),
        "curand_include": find_curand_include(cuda_home()),
        "nvcc_version": _run(["nvcc", "--version"]).splitlines()[-2:],
        "nvidia_smi": _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                            "clocks.max.sm,power.limit", "--format=csv,noheader"]),
    }
    if facts["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        facts.update(gpu=p.name, capability=f"{p.major}.{p.minor}",
                     gpu_mem_gib=p.total_memory / 2**30, sms=p.multi_processor_count)
    return facts


def matmul() -> dict:
    """Measured matmul rate: bf16 8192^3 on CUDA (CUDA events, after warm-ups); a small
    float32 product on CPU, only so the CPU path runs."""
    import torch

    cuda = torch.cuda.is_available()
    n, dtype, iters = (8192, torch.bfloat16, 20) if cuda else (512, torch.float32, 5)
    dev = "cuda" if cuda else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    for _ in range(3):
        a @ b
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            a @ b
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        seconds = time.perf_counter() - t0
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "device": dev,
            "iters": iters, "ms_per_matmul": 1e3 * seconds / iters,
            "tflop_s": 2 * n**3 * iters / seconds / 1e12}


def _seconds(fn, cuda: bool, iters: int) -> float:
    """Mean wall seconds of `fn` after two warm-ups, the device's queue drained before
    the clock stops (launch costs count: the engine pays them too)."""
    import torch

    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def memory() -> dict:
    """The device memory's copy rate (HBM on the GPU: read + write, 4 GiB), the roof for
    decode, which reads every weight and the KV once a step; RAM on CPU (256 MiB)."""
    import torch

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    src = torch.ones((4 << 30) // 2 if cuda else (256 << 20) // 2, dtype=torch.bfloat16,
                     device=dev)
    dst = torch.empty_like(src)
    seconds = _seconds(lambda: dst.copy_(src), cuda, 10 if cuda else 3)
    return {"device": dev, "bytes": src.nbytes, "copy_gb_s": 2 * src.nbytes / seconds / 1e9}


# The GPU benchmark's model (tools/gpu/check.py BENCH_1B): 16 layers, 8 KV heads of 128,
# bf16, 16-token blocks: 1 MiB a block, K and V. On CPU a small shape, so the path runs.
SWAP_SHAPE_CUDA = dict(num_layers=16, block_size=16, num_kv_heads=8, head_dim=128)
SWAP_SHAPE_CPU = dict(num_layers=2, block_size=16, num_kv_heads=2, head_dim=32)


def _copy_block_by_block(cache, swap_out: list[tuple[int, int]],
                         swap_in: list[tuple[int, int]]) -> None:
    """The tier copies as they were before they were batched: two copies a block a layer
    each way, on the cache's side stream (the baseline the swap probe sets beside them)."""
    import torch

    with torch.cuda.stream(cache._stream):
        for layer in range(cache.k.shape[0]):
            for block, slot in swap_out:
                cache.k_host[layer, slot].copy_(cache.k[layer, block], non_blocking=True)
                cache.v_host[layer, slot].copy_(cache.v[layer, block], non_blocking=True)
            for slot, block in swap_in:
                cache.k[layer, block].copy_(cache.k_host[layer, slot], non_blocking=True)
                cache.v[layer, block].copy_(cache.v_host[layer, slot], non_blocking=True)
    cache.sync_copies()


def swap() -> dict:
    """Host-tier bandwidth, GB/s, of a step's tier copies through worker/kv_cache.py
    (pinned host memory, the side stream, batched per layer), n blocks out to the host
    and n back, to consecutive host slots and to scattered ones; on CUDA beside the same
    copies block by block. Wall time from the call to the copies' end."""
    import random

    import torch

    from worker.kv_cache import KVCache

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    shape, dtype = (SWAP_SHAPE_CUDA, torch.bfloat16) if cuda else (SWAP_SHAPE_CPU, torch.float32)
    counts = (1, 16, 64, 256) if cuda else (1, 16, 64)
    blocks = 2 * max(counts)
    cache = KVCache(shape["num_layers"], blocks, blocks, shape["block_size"],
                    shape["num_kv_heads"], shape["head_dim"], dtype, dev)
    cache.k.normal_()
    cache.v.normal_()
    block_bytes = KVCache.bytes_per_block(**shape, dtype=dtype)
    rng = random.Random(0)
    rows = []
    for n in counts:
        src = rng.sample(range(blocks), n)
        for layout in ("consecutive", "scattered"):
            slots = list(range(n)) if layout == "consecutive" else rng.sample(range(blocks), n)
            out, back = list(zip(src, slots)), list(zip(slots, src))
            ways = {"batched": lambda o, i: (cache.swap(o, i), cache.sync_copies())}
            if cuda:
                ways["block_by_block"] = lambda o, i: _copy_block_by_block(cache, o, i)
            for way, run in ways.items():
                out_s, in_s = (_seconds(partial(run, o, i), cuda, 20 if n < 64 else 5)
                               for o, i in ((out, []), ([], back)))
                rows.append({"blocks": n, "slots": layout, "way": way,
                             "out_gb_s": n * block_bytes / out_s / 1e9,
                             "in_gb_s": n * block_bytes / in_s / 1e9,
                             "out_ms": 1e3 * out_s, "in_ms": 1e3 * in_s})
    return {"device": str(dev), "dtype": str(dtype).removeprefix("torch."), **shape,
            "block_bytes": block_bytes, "rows": rows}


def flashinfer() -> dict:
    """Import FlashInfer and build (JIT, nvcc) the kernels the tests and the benchmark use:
    paged prefill (causal, a cached prefix) and decode, bf16, head_dim 128, 16 query /
    8 KV heads. Reports each first call's seconds (mostly compilation) and the relative
    error against the torch backend on the same pages."""
    import torch

    from worker.attention import AttentionMetadata, create_backend

    t0 = time.perf_counter()
    import flashinfer as fi
    from flashinfer.jit import env as jit_env

    out: dict = {"version": fi.__version__, "import_s": time.perf_counter() - t0}
    aot = jit_env.FLASHINFER_AOT_DIR
    out["prebuilt_modules"] = sorted(p.name for p in aot.iterdir()) if aot.is_dir() else []
    heads, kv_heads, d, page, dev = 16, 8, 128, 16, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    k_cache = torch.randn(64, page, kv_heads, d, device=dev, generator=g).bfloat16()
    v_cache = torch.randn(64, page, kv_heads, d, device=dev, generator=g).bfloat16()
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    # prefill: 40 new tokens after a 60-token cached prefix, and a 20-token prompt
    prefill = AttentionMetadata(i32([0, 40, 60]), i32([0, 7, 9]), i32(list(range(9))),
                                i32([4, 4]), page)
    decode = AttentionMetadata(i32([0, 1, 2]), i32([0, 7, 9]), i32(list(range(9))),
                               i32([4, 4]), page)
    for name, meta in (("prefill", prefill), ("decode", decode)):
        q = torch.randn(int(meta.qo_indptr[-1]), heads, d, device=dev, generator=g).bfloat16()
        results = {}
        for backend in ("flashinfer", "torch"):
            t0 = time.perf_counter()
            b = create_backend(backend, heads, kv_heads, d, page, torch.bfloat16, dev)
            b.plan(meta)
            results[backend] = b.forward(q, k_cache, v_cache).float()
            torch.cuda.synchronize()
            if backend == "flashinfer":
                out[f"{name}_first_call_s"] = time.perf_counter() - t0
        diff = (results["flashinfer"] - results["torch"]).norm() / results["torch"].norm()
        out[f"{name}_rel_err"] = diff.item()
    return out


PROBES = {"env": env, "matmul": matmul, "memory": memory, "swap": swap,
          "flashinfer": flashinfer}


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in PROBES:
        sys.exit(f"usage: python -m tools.gpu.probe {{{'|'.join(PROBES)}}}")
    print(MARKER + json.dumps(PROBES[sys.argv[1]]()), flush=True)


if __name__ == "__main__":
    main()
