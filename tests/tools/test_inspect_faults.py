"""`deepinfer-inspect` against a 4-rank engine with test-only faults (one engine per module).

Rank 2 gets a wrong block in the table of the first sequence it runs from step 3 on (a
divergence the state digest, which mirrors the plans, cannot see), and rank 1 sleeps
inside step 40 (its peers then wait for it in a collective), until the test releases it.
"""

from __future__ import annotations

import threading

import pytest

from tests.orchestrator.e2e_helpers import complete
from tests.tools.engine import Engine
from tests.worker.faults import with_faults

pytestmark = pytest.mark.slow
STALL_STEP = 40
FAULTS = with_faults(DEEPINFER_FAULT_CORRUPT_TABLE="2:3",
                     DEEPINFER_FAULT_STALL=f"1:{STALL_STEP}:120")


@pytest.fixture(scope="module")
def engine(default_model, tmp_path_factory):
    eng = Engine(default_model, tmp_path_factory.mktemp("faults") / "run", env=FAULTS)
    yield eng
    (eng.run_dir / "fault-stall-release").touch()
    assert eng.stop() == 0, eng.log()[-3000:]


def stalled(engine: Engine) -> dict | None:
    status, view = engine.inspect_json("ranks")
    rank1 = view["ranks"][1]
    if rank1["step"] == STALL_STEP and rank1["seconds_in_step"] > 0.5:
        return view
    return None


def test_check_names_the_rank_and_block_and_stacks_show_the_stall(engine):
    result: dict = {}
    request = threading.Thread(target=lambda: result.update(complete(
        engine.url, prompt=list(range(100, 140)), max_tokens=80, temperature=0,
        ignore_eos=True)), daemon=True)
    request.start()
    view = engine.wait_for("rank 1 stalled in its step", lambda: stalled(engine), 120)

    # every process answers while rank 1 sleeps and the others wait in a collective
    assert view["scheduler"]["state"] == "stepping"
    assert all(r["state"] == "forward" and r["step"] == STALL_STEP for r in view["ranks"])
    status, text = engine.inspect("ranks")
    assert status == 0 and "forward" in text

    status, stacks = engine.inspect_json("stacks")
    assert status == 0
    main = {r["rank"]: r["threads"]["MainThread"] for r in stacks["ranks"]}
    assert sorted(main) == [0, 1, 2, 3]
    assert "time.sleep" in main[1] or "on_applied" in main[1]
    for rank in (0, 2, 3):
        assert "in launch" in main[rank]  # inside the forward pass, waiting for rank 1
    assert "executor.py" in stacks["scheduler"]["threads"]["MainThread"]

    status, check = engine.inspect_json("check")
    assert status == 1 and not check["agree"] and check["aligned"]
    (diff,) = check["differences"]
    assert diff["kind"] == "block_table" and diff["process"] == "rank 2"
    assert diff["seq_id"] == 1 and diff["index"] == 0
    assert diff["value"] == (diff["expected"] + 1) % 4096
    status, text = engine.inspect("check")
    assert status == 1 and "rank 2" in text and f"block {diff['value']}" in text
    assert max(map(len, text.splitlines())) <= 80

    status, seq = engine.inspect_json("seq", "1")
    assert [r["block_ids"] == seq["scheduler"]["block_ids"] for r in seq["ranks"]] == \
        [True, True, False, True]

    (engine.run_dir / "fault-stall-release").touch()
    request.join(timeout=120)
    assert len(result["choices"][0]["token_ids"]) == 80
    # the corrupted table closed with its sequence: the tables agree again
    engine.wait_for("tables agree", lambda: engine.inspect("check")[0] == 0, 60)
