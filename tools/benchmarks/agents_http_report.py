"""The table and the plot of tools/benchmarks/agents_http.py (its results as plain dicts, as in
its JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def ratios(on: dict[str, Any], off: dict[str, Any]) -> dict[str, float]:
    """Both above 1 when the prefix cache helps."""
    return {"read_rate_on_off": on["prompt_tokens_read_per_s"] / off["prompt_tokens_read_per_s"],
            "ttft_p50_off_on": off["ttft_p50_ms"] / on["ttft_p50_ms"]}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def print_report(runs: dict[str, dict[str, Any]], title: str, console: Console) -> None:
    """One row per run, then the on/off ratios if both runs are there."""
    table = Table(title=title)
    columns = ("run", "requests", "prompt tok", "cached", "device", "host", "read tok/s",
               "TTFT p50 ms", "p95 ms", "p99 ms", "out tok/s", "queue mean ms",
               "queue p95 ms", "wall s")
    for col in columns:
        table.add_column(col, justify="right")
    for name, r in runs.items():
        table.add_row(name, str(r["requests"]), str(r["prompt_tokens"]), _pct(r["cached_share"]),
                      _pct(r["device_hit_share"]), _pct(r["host_hit_share"]),
                      _num(r["prompt_tokens_read_per_s"]), _num(r["ttft_p50_ms"]),
                      _num(r["ttft_p95_ms"]), _num(r["ttft_p99_ms"]),
                      _num(r["output_tokens_per_s"], ".1f"), _num(r["queue_mean_ms"]),
                      "-" if r["queue_p95_ms"] is None else f"<= {r['queue_p95_ms']:g}",
                      _num(r["wall_s"], ".1f"))
    console.print(table)
    if "on" in runs and "off" in runs:
        q = ratios(runs["on"], runs["off"])
        console.print(f"read-rate ratio cache on/off: {q['read_rate_on_off']:.2f}x; "
                      f"TTFT p50 ratio off/on: {q['ttft_p50_off_on']:.2f}x")


def plot(runs: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """TTFT and cached share of each request against when it was sent, runs overlaid."""
    import matplotlib  # lazily: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6.5))
    for name, r in runs.items():
        sent = [s["sent_s"] for s in r["steps"]]
        top.plot(sent, [1000 * s["ttft_s"] for s in r["steps"]], "o", ms=4, alpha=0.7,
                 label=f"cache {name}" if name in ("on", "off") else name)
        bottom.plot(sent, [s["cached_tokens"] / max(1, s["prompt_tokens"]) for s in r["steps"]],
                    "o", ms=4, alpha=0.7)
    top.set_yscale("log")
    top.set_ylabel("TTFT (ms)")
    top.legend()
    top.set_title(title, fontsize=9)
    bottom.set_ylabel("cached share of prompt")
    bottom.set_ylim(-0.05, 1.05)
    bottom.set_xlabel("request sent at (s since the run started)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
