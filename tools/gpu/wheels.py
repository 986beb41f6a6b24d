"""The wheels a CUDA machine without network needs: fetched here, installed there.

    python -m tools.gpu.check --download wheels/      # here (PyPI reachable)
    python -m tools.gpu.check RESULTS --wheels wheels  # there: installs what is missing

The lent H200 has CUDA, nvcc, PyTorch, Triton and most pure-Python packages, but no
network and at most 64 MiB of files per run, so only small wheels travel:

- FlashInfer's JIT package (`flashinfer-python`, pure Python: its kernels are compiled
  with nvcc on first use) and the one dependency that `import flashinfer` and its JIT
  need beyond what the machine has: `apache-tvm-ffi`. Its other declared needs stay
  behind: `nvidia-cudnn-frontend` (~12 MB a Python version), `nvidia-cutlass-dsl`
  (a meta package over much larger libraries) and `cuda-tile` serve kernels we do not
  use (cuDNN and CuTe-DSL attention, Blackwell GEMMs), and `import flashinfer` imports
  none of them. Never the prebuilt `flashinfer-jit-cache` or `flashinfer-cubin` (GBs).
- This project's runtime needs that the machine lacks (pyzmq, structlog, starlette,
  uvicorn), plus, in case the image changes, the small ones it has today.
- `fla-core` (flash-linear-attention's kernels, pure Python over Triton, 1 MB): a hybrid
  model's delta rule on CUDA (worker/delta_kernels.py). Not needed: without it the torch
  rule runs. `causal-conv1d` is a source package (nvcc, minutes) and is not carried.

Never torch: the machine's own CUDA build is the one to use. Every wheel is fetched
with `--no-deps` for CPython 3.10-3.12 on manylinux x86_64, so the same folder serves
whichever Python the machine has; installing takes only what is missing, `--no-deps`,
from the folder alone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

FLASHINFER = "flashinfer-python==0.6.13"  # 14 MB; 0.7.x is 62 MB, over the carry limit
FLA = "fla-core==0.6.0"  # the signatures worker/delta_kernels.py was written against
PYTHON_VERSIONS = ("3.10", "3.11", "3.12")
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_26_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux1_x86_64")


@dataclass(frozen=True)
class Wheel:
    requirement: str  # what pip is asked for
    module: str  # imported to tell whether the machine already has it
    compiled: bool = False  # one wheel per Python version (else py3-none-any)
    needed: bool = False  # missing on the H200 image (else there today; carried in case)

    @property
    def dist(self) -> str:
        return self.requirement.split("=")[0].split("<")[0].split(">")[0].split("!")[0]


WHEELS: tuple[Wheel, ...] = (
    Wheel(FLASHINFER, "flashinfer", needed=True),
    Wheel("apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0", "tvm_ffi", compiled=True,
          needed=True),
    Wheel("pyzmq", "zmq", compiled=True, needed=True),
    Wheel("structlog", "structlog", needed=True),
    Wheel("starlette", "starlette", needed=True),
    Wheel("uvicorn", "uvicorn", needed=True),
    Wheel("llguidance", "llguidance", compiled=True, needed=True),  # one abi3 wheel
    Wheel(FLA, "fla"),  # a hybrid's delta rule; missing on the image, but optional
    # On the image today (KINDS.md); small enough to carry in case it changes.
    Wheel("msgpack", "msgpack", compiled=True),
    Wheel("safetensors", "safetensors", compiled=True),
    Wheel("tokenizers", "tokenizers", compiled=True),
    Wheel("jinja2", "jinja2"),
    Wheel("markupsafe", "markupsafe", compiled=True),
    Wheel("rich", "rich"),
    Wheel("markdown-it-py", "markdown_it"),
    Wheel("mdurl", "mdurl"),
    Wheel("pygments", "pygments"),
    Wheel("prometheus-client", "prometheus_client"),
    Wheel("httpx", "httpx"),
    Wheel("httpcore", "httpcore"),
    Wheel("h11", "h11"),
    Wheel("anyio", "anyio"),
    Wheel("idna", "idna"),
    Wheel("certifi", "certifi"),
    Wheel("click", "click"),
    Wheel("tqdm", "tqdm"),
    Wheel("typing-extensions", "typing_extensions"),
    Wheel("pytest", "pytest"),
    Wheel("pluggy", "pluggy"),
    Wheel("iniconfig", "iniconfig"),
    Wheel("packaging", "packaging"),
    Wheel("exceptiongroup", "exceptiongroup"),  # pytest and anyio on Python 3.10
    Wheel("tomli", "tomli"),
    Wheel("hypothesis", "hypothesis", compiled=True),
    Wheel("attrs", "attr"),
    Wheel("sortedcontainers", "sortedcontainers"),
    # flashinfer imports these (the image has them)
    Wheel("einops", "einops"),
    Wheel("ninja", "ninja"),
    Wheel("requests", "requests"),
    Wheel("urllib3", "urllib3"),
    Wheel("charset-normalizer", "charset_normalizer", compiled=True),
    Wheel("tabulate", "tabulate"),
    Wheel("nvidia-ml-py", "pynvml"),
)


def pip_download(dest: Path, python_versions: tuple[str, ...] = PYTHON_VERSIONS,
                 wheels: tuple[Wheel, ...] = WHEELS, log=print) -> int:
    """Fetch `wheels` into `dest` (no dependencies); returns the folder's size in bytes."""
    dest.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
            "--only-binary=:all:", "--implementation", "cp", "-d", str(dest)]
    for flag in PLATFORMS:
        base += ["--platform", flag]
    pure = [w.requirement for w in wheels if not w.compiled]
    compiled = [w.requirement for w in wheels if w.compiled]
    jobs = [([*base, "--python-version", python_versions[0]], pure)]
    for v in python_versions:
        jobs.append(([*base, "--python-version", v, "--abi", "cp" + v.replace(".", ""),
                      "--abi", "abi3"], compiled))
    for cmd, reqs in jobs:
        log("+ " + " ".join(cmd[2:] + reqs))
        subprocess.run(cmd + reqs, check=True)
    size = sum(f.stat().st_size for f in dest.glob("*.whl"))
    for f in sorted(dest.glob("*.whl")):
        log(f"{f.stat().st_size / 2**20:7.2f} MiB  {f.name}")
    log(f"{size / 2**20:7.2f} MiB  in all ({len(list(dest.glob('*.whl')))} wheels)")
    return size


def missing(wheels: tuple[Wheel, ...] = WHEELS) -> list[Wheel]:
    """The wheels whose module this interpreter cannot import."""
    importlib.invalidate_caches()
    return [w for w in wheels if importlib.util.find_spec(w.module) is None]


def in_folder(folder: Path, wheels: list[Wheel]) -> list[Wheel]:
    """The `wheels` that `folder` holds a file of (a folder may carry only the needed ones:
    tools/gpu/carry.py)."""
    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "_", name).lower()

    present = {norm(f.name.split("-")[0]) for f in folder.glob("*.whl")}
    return [w for w in wheels if norm(w.dist) in present]


def pip_install(folder: Path, wheels: list[Wheel], dry_run: bool, log=print) -> dict:
    """Install the wheels from `folder` alone, `--no-deps`: in one pip call, and if that
    fails, one call each, so the bad ones are named and the rest still go in. `dry_run`:
    pip only says what it would install (for every wheel, installed here or not: it
    checks that the folder serves this Python)."""
    if not wheels:
        return {"installed": [], "failed": {}}

    def pip(reqs: list[str]) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
               "--no-cache-dir", "--disable-pip-version-check", "--find-links", str(folder),
               *reqs]
        if dry_run:
            cmd += ["--dry-run", "--ignore-installed"]
        return subprocess.run(cmd, capture_output=True, text=True)

    verb = "would install" if dry_run else "installed"
    r = pip([w.requirement for w in wheels])
    if r.returncode == 0:
        log(f"{verb}: " + (r.stdout.strip().splitlines() or [""])[-1])
        return {"installed": [w.dist for w in wheels], "failed": {}}
    done, failed = [], {}
    for w in wheels:
        r = pip([w.requirement])
        last = (r.stdout + r.stderr).strip().splitlines()
        log(f"{w.dist}: {'ok' if r.returncode == 0 else 'FAILED'}: {last[-1] if last else ''}")
        if r.returncode == 0:
            done.append(w.dist)
        else:
            failed[w.dist] = "\n".join(last[-5:])
    return {"installed": done, "failed": failed}


# --- FlashInfer's kernels, built ahead with this machine's nvcc -------------------------

AOT_DIR = "flashinfer-aot"  # inside the wheels folder: <module name>/<module name>.so
# (FlashInfer, then this machine's interpreter lacks) what `import flashinfer` needs
FLASHINFER_IMPORT = ("flashinfer-python", "apache-tvm-ffi", "einops", "requests", "urllib3",
                     "charset-normalizer", "idna", "certifi", "tabulate", "nvidia-ml-py",
                     "ninja", "packaging", "click", "tqdm")
# The modules the engine's kernels come from on an H200 (FlashInfer's own names): paged
# prefill with the Hopper (FA3) kernels and decode, bf16, head_dim 128, int32 indices.
BUILD_SCRIPT = """
import json, sys, torch
from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
bf16, i32 = torch.bfloat16, torch.int32
specs = [gen_batch_decode_module(bf16, bf16, bf16, i32, 128, 128, 0, False, False),
         gen_batch_prefill_module("fa3", bf16, bf16, bf16, i32, 128, 128, 0, False, False,
                                  False)]
for spec in specs:
    spec.build(verbose=False)
    print("BUILT " + json.dumps([spec.name, str(spec.jit_library_path)]), flush=True)
"""


def build_kernels(wheels: Path, log=print) -> list[Path]:
    """Build the engine's FlashInfer modules for sm_90a into wheels/flashinfer-aot, with
    this machine's nvcc and the FlashInfer wheel from `wheels` (no GPU needed). The H200
    then loads them as FlashInfer's own prebuilt (AOT) modules instead of compiling for
    minutes on first use. Needs nvcc and cuRAND's headers (CPATH may point at them).
    DEEPINFER_KERNEL_BUILD names a folder to build in and keep, so a second run only
    relinks (the default is a fresh temporary folder, removed after)."""
    import shutil
    import tempfile

    from tools.gpu.probe import cuda_home, find_curand_include

    home = cuda_home()
    if home is None:
        raise SystemExit("build-kernels: no CUDA toolkit (nvcc on PATH, or CUDA_HOME)")
    cpath = os.environ.get("CPATH", "").split(os.pathsep)
    if not find_curand_include(home) and not any(Path(p, "curand_kernel.h").is_file()
                                                 for p in cpath if p):
        raise SystemExit("build-kernels: no curand_kernel.h in the toolkit; unpack the "
                         "nvidia-curand wheel's nvidia/cu13/include and point CPATH at it")
    keep = os.environ.get("DEEPINFER_KERNEL_BUILD")
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="deepinfer-kernels-"))
    site, stub = work / "site", work / "stub"
    if not (site / "flashinfer").is_dir():
        imports = [w for w in WHEELS if w.dist in FLASHINFER_IMPORT]
        absent = missing(tuple(imports))
        need = [w for w in imports if w in absent or w.dist in FLASHINFER_IMPORT[:2]]
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                        "--no-deps", "--target", str(site), "--find-links", str(wheels),
                        *(w.requirement for w in need)], check=True)
    # The modules link -lcuda; a machine without a driver has no libcuda.so, and an
    # empty library with its soname is all the linker needs (the H200 has the real one).
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "empty.c").write_text("")
    subprocess.run(["cc", "-shared", "-o", str(stub / "libcuda.so"),
                    "-Wl,-soname,libcuda.so.1", str(stub / "empty.c")], check=True)
    env = dict(os.environ, PYTHONPATH=str(site), FLASHINFER_CUDA_ARCH_LIST="9.0a",
               FLASHINFER_WORKSPACE_BASE=str(work), CUDA_HOME=home,
               LIBRARY_PATH=os.pathsep.join(p for p in (str(stub),
                                                        os.environ.get("LIBRARY_PATH")) if p))
    log(f"building FlashInfer's modules in {work} (nvcc, sm_90a: many minutes)")
    out = subprocess.run([sys.executable, "-c", BUILD_SCRIPT], env=env, text=True,
                         capture_output=True)
    if out.returncode:
        raise SystemExit(f"build-kernels failed:\n{(out.stdout + out.stderr)[-5000:]}")
    dest = wheels / AOT_DIR
    built = []
    for line in out.stdout.splitlines():
        if line.startswith("BUILT "):
            name, so = json.loads(line[len("BUILT "):])
            (dest / name).mkdir(parents=True, exist_ok=True)
            shutil.copy2(so, dest / name / f"{name}.so")
            built.append(dest / name / f"{name}.so")
            log(f"{built[-1].stat().st_size / 2**20:7.2f} MiB  {name}")
    (dest / "VERSION").write_text(FLASHINFER.split("==")[1] + "\n")
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return built


def install_kernels(wheels: Path, log=print) -> dict[str, str]:
    """Put the carried modules where FlashInfer looks for prebuilt ones (its package's
    data/aot), each checked by loading it in a child; one that does not load is removed,
    and FlashInfer compiles that module itself on first use."""
    import shutil

    src = wheels / AOT_DIR
    if not src.is_dir():
        return {}
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return {"*": "flashinfer is not installed"}
    from importlib import metadata

    version = metadata.version("flashinfer-python")
    if (src / "VERSION").read_text().strip() != version:
        return {"*": f"built for {(src / 'VERSION').read_text().strip()}, not {version}"}
    aot = Path(spec.submodule_search_locations[0]) / "data" / "aot"
    status = {}
    for module in sorted(p for p in src.iterdir() if p.is_dir()):
        target = aot / module.name
        shutil.copytree(module, target, dirs_exist_ok=True)
        so = target / f"{module.name}.so"
        r = subprocess.run([sys.executable, "-c", "import sys, torch, tvm_ffi; "
                            "tvm_ffi.load_module(sys.argv[1])", str(so)],
                           capture_output=True, text=True)
        if r.returncode:
            shutil.rmtree(target)
            status[module.name] = "failed to load: " + (r.stderr.strip().splitlines()
                                                        or ["?"])[-1]
        else:
            status[module.name] = "ok"
        log(f"prebuilt kernel {module.name}: {status[module.name]}")
    return status
