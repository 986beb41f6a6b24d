"""`make soak` on small settings: the script runs end to end and finds nothing leaked."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from tools import soak


def test_soak_small(default_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    console = Console(file=io.StringIO(), width=120)
    status = soak.main(["--model", str(default_model), "--world-size", "2", "--requests", "40",
                        "--concurrency", "6", "--max-prompt-words", "60", "--max-tokens", "4",
                        "--guided-share", "0.5", "--json", str(out)], console=console)
    result = json.loads(out.read_text())
    assert status == 0, result
    assert result["requests"] == 40 and result["served"] > 0
    assert result["blocks_leaked"] == 0 and result["digest_mismatches"] == 0
    assert result["ranks_agree"] and result["server_errors"] == 0
    assert any(k.startswith("400") for k in result["by_kind"])  # bad bodies were sent
    assert result["by_kind"].get("served (guided)", 0) > 0  # and checked against the schema
    assert set(result["peak_rss_mib"]) >= {"scheduler", "shim", "rank 0", "rank 1"}


def test_soak_a_hybrid_model_leaks_no_state_slot(hybrid_models: dict[str, Path],
                                                 tmp_path: Path) -> None:
    """The same on a hybrid model (linear-attention state in slots beside the KV blocks):
    at the end no state slot is held, and the ranks' state tables agree with the
    scheduler's (`deepinfer-inspect check`)."""
    out = tmp_path / "soak.json"
    status = soak.main(["--model", str(hybrid_models["qwen3_5"]), "--world-size", "2", "--requests",
                        "30", "--concurrency", "6", "--max-prompt-words", "60",
                        "--max-tokens", "4", "--json", str(out)],
                       console=Console(file=io.StringIO(), width=120))
    result = json.loads(out.read_text())
    assert status == 0, result
    assert result["served"] > 0 and result["state_slots_leaked"] == 0
    assert result["blocks_leaked"] == 0 and result["ranks_agree"]
