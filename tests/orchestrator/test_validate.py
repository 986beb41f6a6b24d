"""The shim's value checks: the fast path over a token-id list agrees with the one-by-one
check on every kind of element JSON gives."""

from __future__ import annotations

import pytest

from orchestrator.shim.validate import all_int64, is_int64


@pytest.mark.parametrize("values", [
    [], [0, 1, 2**63 - 1], [-(2**63)], [2**63], [-(2**63) - 1], [1, True], [False],
    [1, 1.0], [1, None], [1, "2"], [1, [2]], list(range(3000)) + [2**64],
])
def test_all_int64_is_is_int64_of_every_element(values) -> None:
    assert all_int64(values) == all(is_int64(v) for v in values)
