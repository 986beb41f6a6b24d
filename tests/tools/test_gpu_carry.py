"""tools/gpu/carry.py: the real model split over two device calls and joined there."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tools.gpu import carry as gpu_carry


def make_model(tmp_path: Path) -> Path:
    model = tmp_path / "real.gguf"
    model.write_bytes(os.urandom(3000))
    return model


def test_the_parts_join_into_the_model_where_both_calls_landed(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_carry, "REST_PART_BYTES", 1000)
    model = make_model(tmp_path)
    manifest = gpu_carry.split(model, tmp_path / "carry")
    assert (tmp_path / "carry" / "rest" / manifest["parts"][0]).stat().st_size == 1000
    assert (tmp_path / "carry" / "main" / manifest["parts"][1]).stat().st_size == 2000
    models = tmp_path / "models"
    folders = [tmp_path / "carry" / "main", tmp_path / "carry" / "rest"]
    joined = gpu_carry.assemble(folders, models)
    assert joined == {"status": "ok", "path": str(models / "real.gguf"), "joined": True}
    assert (models / "real.gguf").read_bytes() == model.read_bytes()
    assert gpu_carry.assemble(folders, models)["joined"] is False  # there already: kept


def test_call_1_stashes_its_part_and_call_2_joins_it(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_carry, "REST_PART_BYTES", 1000)
    model = make_model(tmp_path)
    manifest = gpu_carry.split(model, tmp_path / "carry")
    models, stash = tmp_path / "models", tmp_path / "models" / ".carried"
    # call 1, the run: the second part alone; kept where the machine keeps it
    alone = gpu_carry.assemble([tmp_path / "carry" / "main"], models, stash=stash)
    assert alone["status"] == "absent" and manifest["parts"][0] in alone["reason"]
    assert sorted(p.name for p in stash.iterdir()) == ["manifest.json", manifest["parts"][1]]
    assert not (models / "real.gguf").exists()
    # call 2: the first part, joined with the stashed one
    joined = gpu_carry.assemble([stash, tmp_path / "carry" / "rest"], models)
    assert joined["status"] == "ok" and (models / "real.gguf").read_bytes() == model.read_bytes()


def test_a_fresh_machine_or_a_bad_part_leaves_no_model(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_carry, "REST_PART_BYTES", 1000)
    model = make_model(tmp_path)
    manifest = gpu_carry.split(model, tmp_path / "carry")
    models = tmp_path / "models"
    # call 2 on a fresh machine: call 1's part is not there
    alone = gpu_carry.assemble([tmp_path / "nowhere", tmp_path / "carry" / "rest"], models)
    assert alone["status"] == "absent" and manifest["parts"][1] in alone["reason"]
    assert gpu_carry.assemble([tmp_path / "nowhere"], models)["status"] == "absent"
    first = tmp_path / "carry" / "rest" / manifest["parts"][0]
    first.write_bytes(b"x" * 1000)  # damaged on the way
    bad = gpu_carry.assemble([tmp_path / "carry" / "main", tmp_path / "carry" / "rest"],
                             models)
    assert bad["status"] == "failed"
    assert not list(models.iterdir())  # neither the model nor a partial file is left


def test_the_destination_is_an_ignored_folder_of_its_own(tmp_path, monkeypatch):
    import subprocess

    import pytest

    repo = tmp_path / "repo"
    (repo / "models" / "tiny").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/.gpu-carry/\n/models\n")
    model = repo / "models" / "real.gguf"
    model.write_bytes(b"x")
    monkeypatch.setattr(gpu_carry, "REPO", repo)
    # not made yet (a fresh clone): a folder pattern must match it all the same
    assert gpu_carry.check_destination(Path(".gpu-carry"), model) == repo / ".gpu-carry"
    for dest in (Path("tools"), tmp_path / "carry", Path("../elsewhere"),
                 Path("models")):  # not ignored, absolute, outside, the model's own
        with pytest.raises(SystemExit):
            gpu_carry.check_destination(dest, model)


def test_both_folders_name_the_same_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_carry, "REST_PART_BYTES", 1000)
    gpu_carry.split(make_model(tmp_path), tmp_path / "carry")
    first, second = (json.loads((tmp_path / "carry" / k / "manifest.json").read_text())
                     for k in ("main", "rest"))
    assert first == second and first["bytes"] == 3000
