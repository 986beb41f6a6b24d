"""A rank's block tables (worker/block_table.py) against a dict of plain lists."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from worker.block_table import BlockTables

SEQS = st.integers(0, 6)
BLOCKS = st.lists(st.integers(0, 2**31 - 1), max_size=40)
OPS = st.lists(st.one_of(
    st.tuples(st.just("open"), SEQS, BLOCKS),
    st.tuples(st.just("close"), SEQS, st.none()),
    st.tuples(st.just("extend"), SEQS, BLOCKS),
    st.tuples(st.just("trim"), SEQS, st.integers(0, 60)),
    st.tuples(st.just("set"), SEQS, st.integers(0, 60))), max_size=40)


@given(OPS)
def test_block_tables_are_a_dict_of_lists(ops):
    # one row and two columns to start with: the ops grow both (columns by doubling up to
    # 5, and past it only as far as a table needs)
    tables, model = BlockTables(rows=1, cols=2, max_cols=5), {}
    for op, seq, arg in ops:
        if op == "open":
            if seq in model:
                continue
            tables.open(seq, arg)
            model[seq] = list(arg)
        elif seq not in model:
            continue
        elif op == "close":
            tables.close(seq)
            del model[seq]
        elif op == "extend":
            tables[seq].extend(arg) if len(arg) % 2 else tables.extend(seq, arg)
            model[seq].extend(arg)
        elif op == "trim":
            del tables[seq][arg:]
            del model[seq][arg:]
        elif model[seq]:
            i = arg % len(model[seq])
            tables[seq][i] = model[seq][i] = arg
        assert tables == {s: t for s, t in model.items()} and sorted(tables) == sorted(model)
        assert tables.snapshot() == model and tables.copy_of(seq) == model.get(seq)
        for s, want in model.items():
            table = tables[s]
            assert table == want and len(table) == len(want) and list(table) == want
            n = arg if isinstance(arg, int) else len(want)
            assert table[n:] == want[n:]
            if want:
                assert table[-1] == want[-1] and table[0] == want[0]
        # a step's page lists: any prefix of each of the open sequences, in any order
        seqs = sorted(model, key=lambda s: -s)
        rows = tables.rows(seqs)
        assert tables.lengths(rows).tolist() == [len(model[s]) for s in seqs]
        num_pages = np.array([len(model[s]) // 2 + s % 2 * (len(model[s]) % 2)
                              for s in seqs], dtype=np.int64)
        want = [b for s, n in zip(seqs, num_pages) for b in model[s][:n]]
        starts = np.cumsum(num_pages) - num_pages
        assert tables.page_lists(rows, num_pages, starts).tolist() == want
