"""`deepinfer-verify`: the prefix-cache quality gate, against a running endpoint.

    deepinfer-verify [--url http://127.0.0.1:8000] [--api-key KEY] [--api anthropic|openai]
                     [--doc-tokens 2048] [--max-tokens 24] [--max-ttft-ratio 0.5] [--json]

A long document with a question at temperature 0, the identical request again, then
the same document with another question (orchestrator/cache_gate.py says what passes).
Exit status 0 when every check passes, 1 otherwise, with the reason (an endpoint
that cannot be reached or answers with an error fails too).
`deepinfer-run serve --self-check` runs this gate against itself before it accepts
traffic.
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx
from rich.console import Console
from rich.table import Table

from orchestrator.cache_gate import EndpointError, GateConfig, GateReport, run_gate


def render(report: GateReport, console: Console) -> None:
    table = Table(title=f"prefix-cache gate: {report.url} ({report.api} API, model "
                        f"{report.model}, block {report.block_size})")
    for col in ("request", "prompt", "cached", "output", "TTFT ms", "total ms"):
        table.add_column(col, justify="right" if col != "request" else "left")
    for name, ans in report.answers.items():
        table.add_row(name, str(ans.prompt_tokens), str(ans.cached_tokens),
                      str(ans.output_tokens), f"{1000 * ans.ttft_s:.0f}",
                      f"{1000 * ans.total_s:.0f}")
    console.print(table)
    for c in report.checks:
        mark = "[green]PASS[/green]" if c.passed else "[red]FAIL[/red]"
        console.print(f"{mark} {c.name}: {c.detail}")
    console.print("[bold green]gate passed[/bold green]" if report.passed
                  else "[bold red]gate FAILED[/bold red]")


def parse_args(argv: list[str] | None) -> tuple[GateConfig, bool]:
    p = argparse.ArgumentParser(prog="deepinfer-verify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = GateConfig()
    p.add_argument("--url", default=d.url)
    p.add_argument("--api-key", default=None)
    p.add_argument("--api", default=d.api, choices=["anthropic", "openai"])
    p.add_argument("--model", default=None, help="default: the first model the server lists")
    p.add_argument("--doc-tokens", type=int, default=d.doc_tokens,
                   help="approximate length of the document")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--max-ttft-ratio", type=float, default=d.max_ttft_ratio,
                   help="the warm TTFT must be at most this share of the cold one")
    p.add_argument("--block-size", type=int, default=None,
                   help="the engine's KV block size (default: from GET /v1/models, else 16)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    cfg = GateConfig(url=args.url.rstrip("/"), api=args.api, api_key=args.api_key,
                     model=args.model, doc_tokens=args.doc_tokens, max_tokens=args.max_tokens,
                     max_ttft_ratio=args.max_ttft_ratio, block_size=args.block_size,
                     timeout_s=args.timeout)
    return cfg, args.json


def main(argv: list[str] | None = None) -> int:
    cfg, as_json = parse_args(argv)
    try:
        report = run_gate(cfg)
    except (EndpointError, httpx.HTTPError) as exc:
        if as_json:
            print(json.dumps({"passed": False, "url": cfg.url, "reasons": [str(exc)]}))
        else:
            Console(stderr=True).print(f"[bold red]gate FAILED[/bold red]: {exc}")
        return 1
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        render(report, Console())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
