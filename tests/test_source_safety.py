"""No input is ever turned into code or objects: the source tree holds no pickle (or its
cousins), no eval/exec, no torch.load without weights_only=True, no yaml.load, no
pyzmq *_pyobj, no torch.distributed *_object collectives (they pickle), no shell=True.

An AST scan, so comments and docstrings that name these are fine."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve",
                  "joblib"}
BANNED_BUILTINS = {"eval", "exec", "compile", "__import__"}
BANNED_METHODS = {"recv_pyobj", "send_pyobj", "recv_serialized", "broadcast_object_list",
                  "all_gather_object", "gather_object", "scatter_object_list",
                  "send_object_list", "recv_object_list"}


def _keyword_is(call: ast.Call, name: str, value: object) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value == value
               for k in call.keywords)


def _call_problem(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name) and func.id in BANNED_BUILTINS:
        return f"{func.id}()"
    if not isinstance(func, ast.Attribute):
        return None
    owner = func.value.id if isinstance(func.value, ast.Name) else ""
    if func.attr in BANNED_METHODS:
        return f".{func.attr}() (pickles)"
    if owner == "torch" and func.attr == "load" and not _keyword_is(call, "weights_only", True):
        return "torch.load without weights_only=True"
    if owner == "yaml" and func.attr in ("load", "load_all", "unsafe_load", "full_load"):
        return f"yaml.{func.attr} (use yaml.safe_load)"
    if owner in ("np", "numpy") and func.attr == "load" and _keyword_is(call, "allow_pickle",
                                                                         True):
        return "np.load(allow_pickle=True)"
    if owner == "os" and func.attr in ("system", "popen"):
        return f"os.{func.attr}"
    if _keyword_is(call, "shell", True):
        return "shell=True"
    return None


def problems(source: str, filename: str = "<src>") -> list[str]:
    """'FILE:LINE: what' for each banned construct in `source`."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        found = None
        if isinstance(node, ast.Import):
            found = next((a.name for a in node.names
                          if a.name.split(".")[0] in BANNED_MODULES), None)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found = node.module if node.module.split(".")[0] in BANNED_MODULES else None
        elif isinstance(node, ast.Call):
            found = _call_problem(node)
        if found:
            out.append(f"{filename}:{node.lineno}: {found}")
    return out


def test_the_scanner_finds_each_kind() -> None:
    bad = """
import pickle
from dill import loads
import yaml, torch, numpy as np, subprocess, os
eval(data)
exec(code)
torch.load(path)
yaml.load(text)
np.load(path, allow_pickle=True)
sock.recv_pyobj()
dist.broadcast_object_list(objs)
subprocess.run(cmd, shell=True)
os.system(cmd)
"""
    found_lines = {int(p.split(":")[1]) for p in problems(bad)}
    assert found_lines == set(range(2, 14)) - {4}, problems(bad)  # all but the plain imports
    ok = """
import json, re
torch.load(path, weights_only=True)
yaml.safe_load(text)
re.compile("x")
model.eval()
"""
    assert problems(ok) == []


def packages() -> list[Path]:
    """Every package of the repository, found now (a top-level folder with an
    __init__.py), so a new one is scanned without being listed here."""
    return sorted(init.parent for init in REPO.glob("*/__init__.py"))


def test_every_package_is_scanned() -> None:
    """wire/ decodes other processes' bytes: exactly where a pickle must never be; and no
    top-level folder of Python files escapes the scan by lacking an __init__.py."""
    scanned = {p.name for p in packages()}
    assert {"wire", "orchestrator", "scheduler", "worker", "cache", "tools"} <= scanned
    with_python = {d.name for d in REPO.iterdir() if d.is_dir() and not d.is_symlink()
                   and not d.name.startswith(".") and any(d.glob("*.py"))}
    assert with_python <= scanned, with_python - scanned


def test_the_source_tree_has_none() -> None:
    files = [p for pkg in packages() for p in sorted(pkg.rglob("*.py"))]
    assert len(files) > 50
    found = [x for p in files for x in problems(p.read_text(), str(p.relative_to(REPO)))]
    assert found == [], "\n".join(found)
