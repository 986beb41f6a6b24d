"""One run on a CUDA machine: install what is missing, prove FlashInfer equal to the
torch backend, and measure, writing RESULTS/gpu_check.json and RESULTS/gpu_check.log.

    python -m tools.gpu.check RESULTS [--wheels wheels] [--quick] [--cpu] [--steps a,b]
    python -m tools.gpu.check --download wheels        # here, where PyPI is reachable
    python -m tools.gpu.check --build-kernels wheels   # optional: FlashInfer kernels, nvcc

Steps, in order, each timed, guarded (a failure is logged, the next step runs):

  env         Python, torch, CUDA, the GPU, nvcc, cuRAND headers (tools/gpu/probe.py)
  install     the wheels whose modules are missing, --no-deps, from --wheels alone
              (tools/gpu/wheels.py); prebuilt FlashInfer kernels if carried; the project
              itself editable; then `import flashinfer` in a child
  models      the default tiny model, and the benchmark model: a random ~1B Llama
              (hidden 2048, 16 layers, 16 query / 8 KV heads of 128, MLP 8192); the
              real model joined from the parts carried (--real-model-parts)
  flashinfer  build (nvcc) and check the kernels the tests and benchmarks use
  tests       pytest -m cuda over the test files that have CUDA tests
  matmul      the measured bf16 matmul rate, 8192^3 (the roofline for prefill)
  memory      the measured HBM copy rate (the roofline for decode)
  bench       tools/benchmarks/worker.py at world size 1: prefill tok/s and TFLOP/s, decode
              tok/s at batch 1/16/64, with and without a 4096-token shared cached prefix
  swap        host-tier bandwidth, GB/s: n blocks of the 1B model to pinned host memory
              and back through worker/kv_cache.py, beside the same copies block by block
  overhead    tools/benchmarks/overhead.py at world size 1 on the GPU (the null model), with
              overlap scheduling and without
  http        tools/benchmarks/agents_http.py: the coding-agent benchmark over HTTP, cache
              on and off

No step starts after --cutoff-s, and every child is killed by --deadline-s (both from
the start), so the run ends inside the device tool's 10 minutes. Without CUDA (or with
--cpu) the same steps run on the CPU with tiny shapes, the install is a pip dry run,
and the CUDA-only step is skipped with its reason: that is how this tool is tested.

On the lent H200 (no network, 64 MiB carried a call), with the wheels and the real model
split over two calls here first (`make gpu-carry`: tools/gpu/carry.py prints both calls):
call 1 carries `.gpu-carry/main` (the wheels the H200 lacks and the model's second part)
and is this run, `python3 -m tools.gpu.check "$OUT" --wheels .gpu-carry/main/wheels
--real-model-parts .gpu-carry/main`; call 2, at once after it, carries the first part,
joins the model and runs the real model's CUDA test.

Without the real model, one call does it all: `--download wheels` (43 MiB; with
prebuilt kernels, --build-kernels, 46 MiB) and `python3 -m tools.gpu.check "$OUT"
--wheels wheels`, carrying ["wheels"].
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from orchestrator.config import repo_env
from tools.gpu import carry as gpu_carry
from tools.gpu import wheels as gpu_wheels
from tools.gpu.probe import MARKER as PROBE_MARKER

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "models" / "tiny-llama"
LOG_CAP = 1 << 20  # bytes of one child's output kept in the log (files back are <= 16 MiB)
# 16K positions: the HTTP benchmark's longest prompts (~7.5K tokens) stay clear of the end
BENCH_1B = dict(num_layers=16, hidden_size=2048, num_heads=16, num_kv_heads=8, head_dim=128,
                intermediate_size=8192, max_position_embeddings=16384)
BENCH_CPU = dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                 intermediate_size=256)


class StepFailed(Exception):
    def __init__(self, message: str, result: dict | None = None) -> None:
        super().__init__(message)
        self.result = result  # what the step found before it failed


class StepSkipped(Exception):
    pass


@dataclass
class Check:
    results: Path
    wheels: Path | None
    cuda: bool
    quick: bool
    models: Path
    t0: float
    cutoff_s: float
    deadline_s: float
    log_file: TextIO
    real_model_parts: list[Path] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def log(self, msg: str, echo: bool = True) -> None:
        line = f"[{self.elapsed():6.1f}s] {msg}"
        self.log_file.write(line + "\n")
        self.log_file.flush()
        if echo:
            print(line, flush=True)

    def sh(self, cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
        """Run a child in its own process group, its output streamed into the log; kill
        the group at `timeout` or at the deadline. Returns the output; raises StepFailed
        on a non-zero exit."""
        timeout = min(timeout, self.deadline_s - self.elapsed())
        if timeout < 1:
            raise StepFailed("no time left before the deadline")
        self.log("$ " + " ".join(cmd), echo=False)
        child_env = repo_env({"PYTHONUNBUFFERED": "1", **(env or {})})
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True)
        lines: list[str] = []

        def pump() -> None:
            written = 0
            for line in proc.stdout:
                lines.append(line)
                if written < LOG_CAP:
                    self.log_file.write(line)
                    written += len(line)
            self.log_file.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(5)
            raise StepFailed(f"timed out after {timeout:.0f}s; last output:\n"
                             + "".join(lines[-20:])) from None
        reader.join(5)
        out = "".join(lines)
        if proc.returncode:
            raise StepFailed(f"exit {proc.returncode}; last output:\n" + "".join(lines[-30:]))
        return out

    def probe(self, name: str, timeout: float) -> dict:
        out = self.sh([sys.executable, "-m", "tools.gpu.probe", name], timeout)
        for line in out.splitlines():
            if line.startswith(PROBE_MARKER):
                return json.loads(line[len(PROBE_MARKER):])
        raise StepFailed(f"probe {name} printed no result")

    def save(self) -> None:
        path = self.results / "gpu_check.json"
        path.write_text(json.dumps(self.record, indent=2, default=str))


# --- the steps ---------------------------------------------------------------------


def step_env(c: Check) -> dict:
    facts = c.probe("env", 60)
    # FlashInfer finds the toolkit from nvcc's folder, which a wrapper script on PATH
    # hides; and its Hopper prefill includes cuRAND's headers (through CUTLASS), which a
    # slim toolkit lacks but the nvidia-curand wheel next to torch ships.
    home, curand = facts.get("cuda_home"), facts.get("curand_include")
    if home and not os.environ.get("CUDA_HOME"):
        os.environ["CUDA_HOME"] = facts["cuda_home_set"] = home
    if curand and home and Path(curand) != Path(home) / "include":
        os.environ["CPATH"] = os.pathsep.join(p for p in (curand, os.environ.get("CPATH")) if p)
        facts["cpath_set"] = os.environ["CPATH"]
    return facts


def step_install(c: Check) -> dict:
    if c.wheels is None or not c.wheels.is_dir():
        # on the GPU machine a missing folder fails the step; a CPU run has nothing to do
        raise (StepFailed if c.cuda else StepSkipped)(f"no wheels folder {c.wheels}")
    dry = not c.cuda  # never change this machine's environment from a CPU run
    wanted = list(gpu_wheels.WHEELS) if dry else gpu_wheels.missing()
    carried = gpu_wheels.in_folder(c.wheels, wanted)
    result: dict[str, Any] = {"missing_before": [w.dist for w in gpu_wheels.missing()],
                              "not_carried": [w.dist for w in wanted if w not in carried]}
    wanted = carried
    result.update(gpu_wheels.pip_install(c.wheels, wanted, dry_run=dry,
                                         log=lambda m: c.log(m, echo=False)))
    if not dry:
        result["aot_kernels"] = gpu_wheels.install_kernels(c.wheels, lambda m: c.log(m))
        try:
            c.sh([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                  "--no-build-isolation", "-e", str(REPO)], 120)
            result["editable"] = "ok"
        except StepFailed as e:  # PYTHONPATH serves the children anyway
            result["editable"] = f"failed: {str(e)[:300]}"
    result["missing_after"] = [w.dist for w in gpu_wheels.missing()]
    problems = [f"pip failed for {sorted(result['failed'])}"] if result["failed"] else []
    lacking = [w.dist for w in gpu_wheels.WHEELS if w.needed and w.dist in result["missing_after"]]
    if c.cuda and lacking:  # the engine cannot run without these
        problems.append(f"still missing: {lacking}")
    if c.cuda:
        try:
            out = c.sh([sys.executable, "-c",
                        "import flashinfer; print(flashinfer.__version__)"], 120)
            result["flashinfer"] = out.strip().splitlines()[-1]
        except StepFailed as e:
            problems.append(f"import flashinfer failed: {e}")
    if problems:
        raise StepFailed("; ".join(problems), result)
    return result


def bench_model_path(c: Check) -> Path:
    return c.models / ("bench-1b" if c.cuda else "bench-cpu")


def step_models(c: Check) -> dict:
    result = {}
    if c.real_model_parts:  # carried over two device calls (tools/gpu/carry.py)
        result["real_model"] = gpu_carry.assemble(c.real_model_parts, REPO / "models",
                                                  stash=REPO / gpu_carry.CARRIED)
        c.log(f"real model: {result['real_model']}")
    make = [sys.executable, "-m", "tools.tiny_models.make"]
    c.sh([*make, "--out", str(TINY_MODEL)], 120)
    shape = BENCH_1B if c.cuda else BENCH_CPU
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
    out = c.sh([*make, "--out", str(bench_model_path(c)), "--tokenizer-from", str(TINY_MODEL),
                *flags], 240)
    stamp = json.loads((bench_model_path(c) / "deepinfer_tiny.json").read_text())
    result.update(tiny=str(TINY_MODEL), bench=str(bench_model_path(c)), shape=shape,
                  bench_parameters=stamp["num_parameters"], output=out.strip()[-500:])
    return result


def step_flashinfer(c: Check) -> dict:
    return c.probe("flashinfer", 420)


def cuda_test_files() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                  if "mark.cuda" in p.read_text())


def step_tests(c: Check) -> dict:
    xml = c.results / "pytest_cuda.xml"
    files = cuda_test_files()
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
           "--durations=10", "--junitxml", str(xml), *files]
    failed: StepFailed | None = None
    try:
        out = c.sh(cmd, 420)
    except StepFailed as e:
        failed, out = e, str(e)
    counts = {"files": files}
    if xml.is_file():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors",
                                                          "skipped")})
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] \
            - counts["skipped"]
    summary = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|skipped)", ln)]
    counts["summary"] = summary[-1].strip("= ") if summary else None
    if failed is not None:
        raise StepFailed(str(failed), counts)
    return counts


def step_matmul(c: Check) -> dict:
    return c.probe("matmul", 120)


def step_memory(c: Check) -> dict:
    return c.probe("memory", 60)


def step_swap(c: Check) -> dict:
    return c.probe("swap", 120)


def step_overhead(c: Check) -> dict:
    """The engine's own cost a step at world size 1 on this device (the null model: no
    weights, the batch inputs and the KV tiers on the GPU), with overlap scheduling and
    without: engine ms a step at a zero forward, and the rank's idle share beside a 5 ms
    forward."""
    runs = {}
    for name, flags in (("overlap", []), ("no_overlap", ["--no-async-scheduling"])):
        out_json = c.results / f"bench_overhead_{name}.json"
        c.sh([sys.executable, "-m", "tools.benchmarks.overhead", "--model", str(TINY_MODEL),
              "--device", "cuda" if c.cuda else "cpu", "--world-sizes", "1",
              "--batches", "16,64" if c.cuda else "1,4", "--modes", "decode,mixed",
              "--idle-world-sizes", "1", "--steps", "100" if c.cuda else "20",
              "--no-machine-rates", "--json", str(out_json), *flags], 150)
        cells = json.loads(out_json.read_text())["results"]
        runs[name] = [{"batch": r["batch"], "mode": r["mode"], "forward_ms": r["forward_ms"],
                       "engine_ms": r["breakdown_ms"]["engine"],
                       "rank_idle_share": r["idle_share"],
                       "sched_cpu_ms": r["breakdown_ms"]["sched_cpu"],
                       "rank_cpu_ms": r["breakdown_ms"]["rank_cpu"]} for r in cells]
    return runs


def attention_backend(c: Check) -> str:
    """FlashInfer where its check passed; else the torch backend, so the figures still come."""
    fi = c.record["steps"].get("flashinfer", {})
    return "auto" if not c.cuda or fi.get("status") == "ok" else "torch"


def step_bench(c: Check) -> dict:
    out_json = c.results / "bench_worker.json"
    if c.cuda:
        sizes = dict(prompt=4096, chunk=1024, prefix=4096, steps=32, repeats=3,
                     batches="1,16,64")
        if c.quick:
            sizes.update(prompt=2048, prefix=2048, steps=16, repeats=2)
        device = ["--device", "cuda", "--dtype", "bfloat16"]
    else:
        sizes = dict(prompt=64, chunk=32, prefix=32, steps=2, repeats=1, batches="1,2")
        device = ["--device", "cpu", "--dtype", "float32"]
    backend = attention_backend(c)
    c.sh([sys.executable, "-m", "tools.benchmarks.worker", "--model", str(bench_model_path(c)),
          "--world-sizes", "1", *device, "--attention-backend", backend,
          "--prompt-len", str(sizes["prompt"]), "--chunk", str(sizes["chunk"]),
          "--decode-prompt-len", "128" if c.cuda else "16",
          "--decode-steps", str(sizes["steps"]), "--batch-sizes", sizes["batches"],
          "--shared-prefix-len", str(sizes["prefix"]), "--repeats", str(sizes["repeats"]),
          "--timeout", "300", "--json", str(out_json)], 330)
    run = json.loads(out_json.read_text())["runs"][0]
    result = {k: run[k] for k in ("device", "dtype", "attention_backend", "num_parameters",
                                  "prefill_tok_s", "prefill_tflop_s", "decode_tok_s",
                                  "decode_prefix_tok_s")}
    result["prompt_len"], result["shared_prefix_len"] = sizes["prompt"], sizes["prefix"]
    peak = c.record["steps"].get("matmul", {}).get("result", {}).get("tflop_s")
    if peak:
        result["prefill_share_of_matmul"] = {k: v / peak
                                             for k, v in run["prefill_tflop_s"].items()}
    return result


def step_http(c: Check) -> dict:
    out_json = c.results / "bench_http.json"
    if c.cuda:
        work = ["--agents", "16", "--turns", "6", "--system-tokens", "4096",
                "--tool-result-tokens", "512", "--max-tokens", "16", "--think-s", "0.1"]
        if c.quick:
            work = ["--agents", "8", "--turns", "4", "--system-tokens", "2048",
                    "--tool-result-tokens", "256", "--max-tokens", "16", "--think-s", "0.1"]
        serve = ["--dtype", "bfloat16", "--kv-cache-memory", str(16 << 30),
                 f"--serve-args=--device cuda --attention-backend {attention_backend(c)}"]
    else:
        work = ["--agents", "2", "--turns", "2", "--system-tokens", "256",
                "--tool-result-tokens", "32", "--max-tokens", "4", "--think-s", "0"]
        serve = ["--dtype", "float32", "--serve-args=--device cpu"]
    c.sh([sys.executable, "-m", "tools.benchmarks.agents_http", "--model", str(bench_model_path(c)),
          "--nproc-per-node", "1", *serve, *work, "--json", str(out_json),
          "--plot", str(c.results / "bench_http.png")], 400)
    r = json.loads(out_json.read_text())
    keep = ("requests", "prompt_tokens", "cached_share", "device_hit_share", "host_hit_share",
            "prompt_tokens_read_per_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p95_ms",
            "wall_s")
    return {"runs": {name: {k: run[k] for k in keep} for name, run in r["runs"].items()},
            "ratios": r["ratios"], "args": " ".join(work)}


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[Check], dict]
    min_left_s: float  # not started with less time than this before the deadline
    cuda_only: bool = False


STEPS = (
    Step("env", step_env, 10),
    Step("install", step_install, 20),
    Step("models", step_models, 30),
    Step("flashinfer", step_flashinfer, 60, cuda_only=True),
    Step("tests", step_tests, 60),
    Step("matmul", step_matmul, 15),
    Step("memory", step_memory, 15),
    Step("bench", step_bench, 60),
    Step("swap", step_swap, 30),
    Step("overhead", step_overhead, 60),
    Step("http", step_http, 90),
)


def run_step(c: Check, step: Step) -> None:
    rec: dict[str, Any] = {"started_s": round(c.elapsed(), 1)}
    c.record["steps"][step.name] = rec
    left = c.deadline_s - c.elapsed()
    if step.cuda_only and not c.cuda:
        rec.update(status="skipped", reason="no CUDA device (CPU run)")
    elif c.elapsed() > c.cutoff_s or left < step.min_left_s:
        rec.update(status="skipped", reason=f"out of time: {c.elapsed():.0f}s elapsed, "
                                            f"{left:.0f}s before the deadline")
    else:
        c.log(f"--- {step.name}")
        t0 = time.monotonic()
        try:
            rec.update(status="ok", result=step.run(c))
        except StepFailed as e:
            rec.update(status="failed", error=str(e)[-4000:])
            if e.result is not None:
                rec["result"] = e.result
        except StepSkipped as e:
            rec.update(status="skipped", reason=str(e))
        except Exception:  # a bug in a step must not cost the steps after it
            rec.update(status="failed", error=traceback.format_exc()[-4000:])
        rec["seconds"] = round(time.monotonic() - t0, 1)
    c.log(f"{step.name}: {rec['status']}" + (f" ({rec['seconds']}s)" if "seconds" in rec else "")
          + (f": {rec.get('reason') or rec.get('error', '')[:800]}"
             if rec["status"] != "ok" else ""))
    c.save()


def headline(record: dict) -> dict:
    """The run's headline figures, pulled out of the steps."""
    s = {k: v.get("result", {}) for k, v in record["steps"].items()}
    env, bench, http = s.get("env", {}), s.get("bench", {}), s.get("http", {})
    return {
        "gpu": env.get("gpu"), "torch": env.get("torch"), "cuda": env.get("torch_cuda"),
        "flashinfer": s.get("install", {}).get("flashinfer") or s.get("flashinfer", {}).get(
            "version"),
        "flashinfer_rel_err": {k: s.get("flashinfer", {}).get(f"{k}_rel_err")
                               for k in ("prefill", "decode")},
        "tests": s.get("tests", {}).get("summary"),
        "real_model": s.get("models", {}).get("real_model", {}).get("status"),
        "matmul_tflop_s": s.get("matmul", {}).get("tflop_s"),
        "memory_copy_gb_s": s.get("memory", {}).get("copy_gb_s"),
        "swap_gb_s": {f"{r['way']} {r['blocks']} {r['slots']}": (round(r["out_gb_s"], 1),
                                                                 round(r["in_gb_s"], 1))
                      for r in s.get("swap", {}).get("rows", [])},
        "overhead_engine_ms": {name: {f"{r['mode']} b{r['batch']}": round(r["engine_ms"], 3)
                                      for r in cells if r["forward_ms"] == 0}
                               for name, cells in s.get("overhead", {}).items()},
        "overhead_idle_share_5ms": {name: {r["mode"]: round(r["rank_idle_share"], 4)
                                           for r in cells if r["forward_ms"] > 0}
                                    for name, cells in s.get("overhead", {}).items()},
        "prefill_tok_s": bench.get("prefill_tok_s"),
        "prefill_tflop_s": bench.get("prefill_tflop_s"),
        "prefill_share_of_matmul": bench.get("prefill_share_of_matmul"),
        "decode_tok_s": bench.get("decode_tok_s"),
        "decode_after_shared_prefix_tok_s": bench.get("decode_prefix_tok_s"),
        "http_hit_share_on": http.get("runs", {}).get("on", {}).get("cached_share"),
        "http_ratios": http.get("ratios"),
        "steps": {k: v["status"] for k, v in record["steps"].items()},
    }


def run_check(args: argparse.Namespace) -> dict:
    args.results.mkdir(parents=True, exist_ok=True)
    import torch  # after the results folder: its import is the slowest thing here

    cuda = torch.cuda.is_available() and not args.cpu
    selected = args.steps.split(",") if args.steps else [s.name for s in STEPS]
    unknown = set(selected) - {s.name for s in STEPS}
    if unknown:
        raise SystemExit(f"unknown steps {sorted(unknown)}")
    with open(args.results / "gpu_check.log", "a") as log_file:
        models = args.models or (REPO / "models" if cuda else args.results / "models")
        c = Check(results=args.results, wheels=args.wheels, cuda=cuda, quick=args.quick,
                  models=models, t0=time.monotonic(), cutoff_s=args.cutoff_s,
                  deadline_s=args.deadline_s, log_file=log_file,
                  real_model_parts=[Path(p) for p in args.real_model_parts.split(",") if p])
        c.record.update(started=time.strftime("%Y-%m-%d %H:%M:%S"), mode="cuda" if cuda
                        else "cpu", quick=args.quick, argv=sys.argv[1:], steps={})
        c.log(f"gpu_check: {c.record['mode']} run, steps {','.join(selected)}, cut-off "
              f"{args.cutoff_s:.0f}s, deadline {args.deadline_s:.0f}s")
        for step in STEPS:
            if step.name in selected:
                run_step(c, step)
        c.record["headline"] = headline(c.record)
        c.record["total_s"] = round(c.elapsed(), 1)
        c.save()
        c.log("headline: " + json.dumps(c.record["headline"], indent=1, default=str))
    return c.record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, nargs="?", help="folder for the JSON and the log")
    p.add_argument("--wheels", type=Path, default=REPO / "wheels")
    p.add_argument("--models", type=Path, default=None,
                   help="where the benchmark model is made (default: models/ on CUDA, "
                        "RESULTS/models in a CPU run)")
    p.add_argument("--real-model-parts", default="", metavar="DIR,DIR",
                   help="folders holding the real model's parts (tools/gpu/carry.py): "
                        "joined into models/ before the tests")
    p.add_argument("--quick", action="store_true", help="smaller benchmarks")
    p.add_argument("--cpu", action="store_true", help="the CPU run even where CUDA is")
    p.add_argument("--steps", default=None, help="a comma-separated subset of the steps")
    # under 8 minutes in all: the rest of a 15-minute GPU session for its start and a rerun
    p.add_argument("--cutoff-s", type=float, default=420, help="no step starts after this")
    p.add_argument("--deadline-s", type=float, default=475, help="every child ends by this")
    p.add_argument("--download", type=Path, metavar="DIR",
                   help="fetch the wheels into DIR (here, with PyPI) and exit")
    p.add_argument("--build-kernels", type=Path, metavar="DIR",
                   help="build FlashInfer's kernels for sm_90a into DIR/flashinfer-aot with "
                        "this machine's nvcc (after --download) and exit")
    args = p.parse_args(argv)
    if args.download:
        gpu_wheels.pip_download(args.download)
        return 0
    if args.build_kernels:
        gpu_wheels.build_kernels(args.build_kernels)
        return 0
    if args.results is None:
        p.error("RESULTS is required (or --download DIR)")
    record = run_check(args)
    return 0 if all(s["status"] != "failed" for s in record["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
