"""A rank's block table (worker/block_table.py) against a plain list."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from worker.block_table import BlockTable

OPS = st.lists(st.one_of(
    st.tuples(st.just("extend"), st.lists(st.integers(0, 2**31 - 1), max_size=40)),
    st.tuples(st.just("trim"), st.integers(0, 60)),
    st.tuples(st.just("set"), st.integers(0, 60))), max_size=30)


@given(st.lists(st.integers(0, 2**31 - 1), max_size=20), OPS)
def test_block_table_is_a_list(first, ops):
    table, model = BlockTable(first), list(first)
    for op, arg in ops:
        if op == "extend":
            table.extend(arg)
            model.extend(arg)
        elif op == "trim":
            del table[arg:]
            del model[arg:]
        elif model:
            i = arg % len(model)
            table[i] = model[i] = arg
        assert table == model and len(table) == len(model) and list(table) == model
        n = arg if isinstance(arg, int) else len(model)
        assert table.pages(min(n, len(model))).tolist() == model[:n]
        assert table[n:] == model[n:]
        if model:
            assert table[-1] == model[-1] and table[0] == model[0]
