"""Read this rank's slices of a safetensors checkpoint, and nothing more.

`safe_open(...).get_slice(name)[rows]` reads only the requested rows from the
memory-mapped file, so a rank of a 4-way split touches a quarter of the bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm


class CheckpointReader:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype, show_progress: bool) -> None:
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self._files = self._weight_map()
        self._handles: dict[str, object] = {}
        self._progress = tqdm(
            total=len(self._files), desc="loading weights", unit="tensor", disable=not show_progress
        )

    def _weight_map(self) -> dict[str, str]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            return dict(json.loads(index.read_text())["weight_map"])
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {self.model_dir}")
        names: dict[str, str] = {}
        for f in files:
            with safe_open(f, framework="pt") as h:
                names.update(dict.fromkeys(h.keys(), f.name))
        return names

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def _slice(self, name: str):
        if name not in self._files:
            raise KeyError(f"tensor {name!r} missing from checkpoint {self.model_dir}")
        fname = self._files[name]
        if fname not in self._handles:
            self._handles[fname] = safe_open(self.model_dir / fname, framework="pt")
        self._progress.update(1)
        return self._handles[fname].get_slice(name)

    def full(self, name: str) -> torch.Tensor:
        return self._slice(name)[:].to(self.dtype)

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of a 1-D or 2-D tensor (column-parallel shard)."""
        return self._slice(name)[start:end].to(self.dtype)

    def cols(self, name: str, start: int, end: int) -> torch.Tensor:
        """Columns [start, end) of a 2-D tensor (row-parallel shard)."""
        return self._slice(name)[:, start:end].to(self.dtype)

    def expert_rows(self, name: str, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """Of a stacked [experts, rows, cols] tensor, the rows of each range in `ranges`,
        concatenated in that order, for every expert (a rank's gate and up rows of fused
        experts: worker/moe.py fused_names)."""
        part = self._slice(name)
        return torch.cat([part[:, start:end] for start, end in ranges], dim=1).to(self.dtype)

    def expert_cols(self, name: str, start: int, end: int) -> torch.Tensor:
        """Columns [start, end) of every expert's matrix in a stacked [experts, rows, cols]
        tensor (row-parallel shard)."""
        return self._slice(name)[:, :, start:end].to(self.dtype)

    def close(self) -> None:
        self._handles.clear()
        self._progress.close()


class TextModelReader:
    """A checkpoint read under the text model's names ("model.layers.0..."), whatever
    prefix it stores them under: a multimodal wrapper's (Qwen3.5's
    Qwen3_5ForConditionalGeneration) are "model.language_model.layers.0...", beside its
    vision tower's, which nothing reads."""

    PREFIXES = ("model.", "model.language_model.")

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self.prefix = next((p for p in self.PREFIXES if p + "embed_tokens.weight" in reader),
                           None)
        if self.prefix is None:
            raise KeyError(f"no embed_tokens.weight under {self.PREFIXES} in "
                           f"{reader.model_dir}")

    def name(self, name: str) -> str:
        return self.prefix + name.removeprefix("model.") if name.startswith("model.") else name

    def __contains__(self, name: str) -> bool:
        return self.name(name) in self.reader

    def full(self, name: str) -> torch.Tensor:
        return self.reader.full(self.name(name))

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.reader.rows(self.name(name), start, end)

    def cols(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.reader.cols(self.name(name), start, end)

    def expert_rows(self, name: str, ranges: list[tuple[int, int]]) -> torch.Tensor:
        return self.reader.expert_rows(self.name(name), ranges)

    def expert_cols(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.reader.expert_cols(self.name(name), start, end)

    def close(self) -> None:
        self.reader.close()
