"""tools/benchmarks/transport.py on tiny settings: every transport exchanges the right steps."""

from __future__ import annotations

import io

from rich.console import Console

from tools.benchmarks import transport as bench_transport


def test_every_transport_runs_overlapped_steps_in_order():
    out = io.StringIO()
    status = bench_transport.main(
        ["--ranks", "2", "--batch", "8", "--steps", "30", "--warmup", "5", "--rank-us", "0,50",
         "--sched-us", "20", "--repeats", "1", "--no-machine-rates"],
        console=Console(file=out, width=200, color_system=None))
    printed = out.getvalue()
    assert status == 0
    assert "machine:" in printed and "zmq" in printed and "shm" in printed
    rows = [line for line in printed.splitlines() if line.startswith("│")]
    assert len(rows) == 2  # rank us 0 and 50, sched us 20
    for row in rows:
        times = [float(x) for x in row.strip("│ ").replace("│", " ").split()[2:]]
        assert len(times) == 3 and all(t > 0 for t in times)


def test_a_cell_checks_each_result_is_the_step_collected():
    import argparse
    args = argparse.Namespace(ranks=3, batch=4, steps=20, warmup=2)
    for transport in bench_transport.TRANSPORTS:
        cell = bench_transport.run_cell(transport, args, rank_us=0.0, sched_us=0.0)
        assert cell.transport == transport and cell.ms_per_step > 0
