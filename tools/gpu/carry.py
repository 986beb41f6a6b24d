"""The real model on the lent GPU, over two device calls: one call carries at most 64 MiB
(the working tree included), and the real model alone is 94 MiB.

    python -m tools.gpu.carry [.gpu-carry]     # here (PyPI reachable, `make install` done)
    python -m tools.gpu.carry --join DIR,DIR   # there: the parts into models/, checked

The first writes two folders and prints the two calls to make:

- main/: the wheels the H200 lacks (CPython 3.12 only: 21 MiB), the GGUF's second part
  and manifest.json. Call 1 is the whole run (tools/gpu/check.py, up to 8 minutes) with
  `--real-model-parts .gpu-carry/main`: finding its part alone, gpu_check keeps it in
  models/.carried (ignored, so it stays while the machine is warm: 30 s after a call),
  and the real model's test skips in that run, saying so.
- rest/: the GGUF's first part (58 MiB) and manifest.json. Call 2, made at once after
  call 1, joins the parts into models/<name>, checks their SHA-256, and runs the CUDA
  engine test on the real model against the CPU (the wheels call 1 installed are still
  there). Should call 2 find a fresh machine, only that test is lost.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

from tools.gpu import wheels as gpu_wheels

REPO = Path(__file__).resolve().parents[2]
REAL_MODEL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
REST_PART_BYTES = 58 << 20  # with the working tree (2.3 MiB) well under a call's 64
CALL_LIMIT_BYTES = 64 << 20
PYTHON = "3.12"  # the H200 image's
CARRIED = "models/.carried"  # where call 1 leaves its part on the device
REAL_MODEL_TEST = ("tests/worker/test_cuda_engine.py"
                   "::test_float32_engine_on_cuda_gives_the_cpu_tokens")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def split(model: Path, dest: Path) -> dict:
    """`model` into dest/rest (its first part) and dest/main (the rest), each with the
    manifest naming both parts in order."""
    data = model.read_bytes()
    parts = {"rest": data[:REST_PART_BYTES], "main": data[REST_PART_BYTES:]}
    manifest = {"name": model.name, "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "parts": [f"{model.name}.part-{i}" for i in (1, 2)]}
    for (folder, part), part_name in zip(parts.items(), manifest["parts"]):
        (dest / folder).mkdir(parents=True, exist_ok=True)
        (dest / folder / part_name).write_bytes(part)
        (dest / folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def assemble(folders: list[Path], models: Path, stash: Path | None = None) -> dict:
    """Join the parts found in `folders` into models/<name>, checked against the
    manifest's SHA-256; a model already there with that hash is kept. Where parts are
    missing, nothing is written to models/, and those found are copied into `stash` (a
    later call joins them from there)."""
    manifests = [f / "manifest.json" for f in folders if (f / "manifest.json").is_file()]
    if not manifests:
        return {"status": "absent", "reason": f"no manifest.json in {[str(f) for f in folders]}"}
    manifest = json.loads(manifests[0].read_text())
    target = models / manifest["name"]
    if target.is_file() and sha256(target) == manifest["sha256"]:
        return {"status": "ok", "path": str(target), "joined": False}
    found = {p: next((f / p for f in folders if (f / p).is_file()), None)
             for p in manifest["parts"]}
    if None in found.values():
        if stash is not None:
            stash.mkdir(parents=True, exist_ok=True)
            shutil.copy2(manifests[0], stash / "manifest.json")
            for path in found.values():
                if path is not None and path.parent != stash:
                    shutil.copy2(path, stash / path.name)
        return {"status": "absent", "stashed": str(stash) if stash else None,
                "reason": "parts not here (the other device call brings them): "
                          + ", ".join(p for p, f in found.items() if f is None)}
    models.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(target.suffix + ".partial")
    with partial.open("wb") as out:
        for path in found.values():
            with path.open("rb") as part:
                shutil.copyfileobj(part, out)
    if sha256(partial) != manifest["sha256"]:
        partial.unlink()
        return {"status": "failed", "reason": "the joined parts do not match the manifest"}
    partial.replace(target)
    return {"status": "ok", "path": str(target), "joined": True}


def _mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def check_destination(dest: Path, model: Path) -> Path:
    """Where `prepare` may write: a git-ignored folder inside the checkout, named relative
    to it, holding nothing but this tool's own folders (it replaces those)."""
    if dest.is_absolute() or ".." in dest.parts:
        raise SystemExit(f"{dest}: name a folder inside the checkout, relative to it")
    # the trailing slash: a pattern for folders ("/.gpu-carry/") matches one not made yet
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{dest}/"], cwd=REPO).returncode
    if ignored != 0:
        raise SystemExit(f"{dest} is not git-ignored: it would travel with every call")
    out = REPO / dest
    if out.resolve() in model.resolve().parents or any(
            p.is_dir() and not (p / "manifest.json").is_file() for p in out.glob("*")):
        raise SystemExit(f"{dest} holds other things: name a folder of its own")
    return out


def prepare(dest: Path, model: Path = REAL_MODEL, log=print) -> dict:
    """Write dest/main and dest/rest and print the two device calls."""
    if not model.is_file():
        raise SystemExit(f"{model} is absent: `make install` extracts it")
    out = check_destination(dest, model)
    for folder in ("main", "rest"):  # this tool's own folders only
        shutil.rmtree(out / folder, ignore_errors=True)
    manifest = split(model, out)
    needed = tuple(w for w in gpu_wheels.WHEELS if w.needed)
    gpu_wheels.pip_download(out / "main" / "wheels", (PYTHON,), needed, log=log)
    # what travels with each call besides: tracked files, and untracked ones not ignored
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=REPO, capture_output=True,
                             check=True).stdout.split(b"\0")
    tree = sum((REPO / f.decode()).stat().st_size for f in tracked
               if f and (REPO / f.decode()).is_file()) / 2**20
    sizes = {k: _mib(out / k) for k in ("main", "rest")}
    log(f"main: {sizes['main']:.1f} MiB, rest: {sizes['rest']:.1f} MiB, the working tree "
        f"{tree:.1f} MiB with each")
    for k, mib in sizes.items():
        if (mib + tree) * 2**20 > CALL_LIMIT_BYTES - (1 << 20):
            raise SystemExit(f"{k}: {mib + tree:.1f} MiB with the tree, over a call's 64")
    log(f"""
device call 1 (the run):
    command    PYTHONUNBUFFERED=1 python3 -m tools.gpu.check "$OUT" \\
                   --wheels {dest}/main/wheels --real-model-parts {dest}/main
    carry      ["{dest}/main"]
    timeout_s  600
device call 2 (at once, while the machine is warm):
    command    python3 -m tools.gpu.carry --join {CARRIED},{dest}/rest && \\
                   PYTHONUNBUFFERED=1 python3 -m pytest -p no:cacheprovider -m cuda -q -rs \\
                   '{REAL_MODEL_TEST}' 2>&1 | tee "$OUT/real_model.log"
    carry      ["{dest}/rest"]
    timeout_s  300""")
    return {"manifest": manifest, "mib": sizes, "tree_mib": tree}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dest", type=Path, nargs="?", default=Path(".gpu-carry"),
                   help="a git-ignored folder in the checkout, named relative to it")
    p.add_argument("--join", metavar="DIR,DIR", help="join the parts in these folders into "
                   "models/ (on the device) and exit")
    args = p.parse_args(argv)
    if args.join:
        result = assemble([Path(d) for d in args.join.split(",") if d], REPO / "models")
        print(json.dumps(result))
        return 0 if result["status"] == "ok" else 1
    prepare(args.dest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
