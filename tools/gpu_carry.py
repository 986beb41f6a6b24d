"""What travels to the lent GPU, in two device calls: one call carries at most 64 MiB
(the working tree included), and the real model alone is 94 MiB.

    python -m tools.gpu_carry [.gpu-carry]    # here (PyPI reachable, `make install` done)

writes two folders and prints the two calls to make, the second within the machine's
30 s warm period after the first:

- first/:  the first part of the real model's GGUF (57 MiB) and manifest.json. Call 1
  copies them into models/.carried, an ignored folder that stays on the machine while it
  is warm.
- second/: wheels/ (what the H200 lacks, CPython 3.12 only: 21 MiB), the rest of the GGUF
  and manifest.json. Call 2 runs tools/gpu_check.py with `--wheels .gpu-carry/second/wheels
  --real-model-parts models/.carried,.gpu-carry/second`: the parts are joined into
  models/<name> and its SHA-256 checked before the tests run. Where call 2 finds a fresh
  machine (call 1's part gone), the real model's tests skip, saying so, and the rest runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

from tools import gpu_wheels

REPO = Path(__file__).resolve().parent.parent
REAL_MODEL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
FIRST_PART_BYTES = 57 << 20  # each call ~57 MiB + the working tree (~2.5 MiB): under 64
PYTHON = "3.12"  # the H200 image's
CARRIED = "models/.carried"  # where call 1 leaves its part on the device


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def split(model: Path, dest: Path) -> dict:
    """`model` into dest/first and dest/second, each with the manifest naming both parts."""
    data = model.read_bytes()
    parts = {"first": data[:FIRST_PART_BYTES], "second": data[FIRST_PART_BYTES:]}
    manifest = {"name": model.name, "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "parts": [f"{model.name}.part-{k}" for k in parts]}
    for (folder, part), part_name in zip(parts.items(), manifest["parts"]):
        (dest / folder).mkdir(parents=True, exist_ok=True)
        (dest / folder / part_name).write_bytes(part)
        (dest / folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def assemble(folders: list[Path], models: Path) -> dict:
    """Join the parts found in `folders` into models/<name>, checked against the
    manifest's SHA-256; a model already there with that hash is kept. The result says
    which parts were missing, if any (the file is then not written)."""
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
        return {"status": "absent", "reason": "parts not on this machine (a fresh one, or "
                "call 1 did not run): " + ", ".join(p for p, f in found.items() if f is None)}
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


def prepare(dest: Path, model: Path = REAL_MODEL, log=print) -> dict:
    if not model.is_file():
        raise SystemExit(f"{model} is absent: `make install` extracts it")
    shutil.rmtree(dest, ignore_errors=True)
    manifest = split(model, dest)
    needed = tuple(w for w in gpu_wheels.WHEELS if w.needed)
    gpu_wheels.pip_download(dest / "second" / "wheels", (PYTHON,), needed, log=log)
    sizes = {k: sum(f.stat().st_size for f in (dest / k).rglob("*") if f.is_file()) / 2**20
             for k in ("first", "second")}
    log(f"first: {sizes['first']:.1f} MiB, second: {sizes['second']:.1f} MiB "
        "(+ the working tree each)")
    log(f"""
device call 1:  command    mkdir -p {CARRIED} && cp {dest}/first/* {CARRIED}/ && ls -l {CARRIED}
                carry      ["{dest}/first"]
                timeout_s  120
device call 2 (within 30 s of call 1's end):
                command    PYTHONUNBUFFERED=1 python3 -m tools.gpu_check "$OUT" \\
                           --wheels {dest}/second/wheels --real-model-parts {CARRIED},{dest}/second
                carry      ["{dest}/second"]
                timeout_s  600""")
    return {"manifest": manifest, "mib": sizes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dest", type=Path, nargs="?", default=Path(".gpu-carry"),
                   help="a git-ignored folder in the checkout (carried paths must be)")
    prepare(p.parse_args(argv).dest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
