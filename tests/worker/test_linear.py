"""The few-row linear kernel (worker/csrc/small_linear.cpp) against torch's F.linear,
and the choice between them (worker/linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker import cpu_kernels
from worker.linear import SMALL_ROWS, Linear


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


# rows of x: every register block (1-8) and two blocks with a remainder; weight rows not
# a multiple of any block; K with and without a tail past the vector width
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16])
@pytest.mark.parametrize("n,k", [(96, 64), (257, 576), (35, 100), (3, 7)])
def test_float32_equals_torch(kernels, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    got = kernels.small_linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # float32 sums of K products in another order: rounding, relative to the output's scale
    assert relative_error(got, F.linear(x, w)) < 2e-6


@pytest.mark.parametrize("m", [1, 5, 6, 8, 11, 16])
def test_bfloat16_weights_accumulate_in_float32(kernels, m):
    """bf16 in, bf16 out, summed in float32: within bf16 rounding of float32 math."""
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 576, generator=g), torch.randn(300, 576, generator=g)
    xb, wb = x.bfloat16(), w.bfloat16()
    got = kernels.small_linear(xb, wb)
    assert got.dtype == torch.bfloat16
    exact = F.linear(xb.float(), wb.float())  # the same inputs, float32 throughout
    assert relative_error(got, exact) < 4e-3
    assert relative_error(got, F.linear(xb, wb)) < 1e-2


def test_strided_rows_of_x(kernels):
    """x may be a view (the attention output reshaped, a slice of rows)."""
    x = torch.randn(6, 2, 128)[:, 1, :]
    w = torch.randn(64, 128)
    torch.testing.assert_close(kernels.small_linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_refuses_what_it_cannot_compute(kernels):
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.small_linear(torch.randn(2, 8), torch.randn(4, 8).bfloat16())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.small_linear(torch.randn(2, 8).half(), torch.randn(4, 8).half())
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        kernels.small_linear(torch.randn(2, 8), torch.randn(4, 9))


def test_linear_takes_the_kernel_for_few_rows_and_torch_beyond(kernels, monkeypatch):
    calls = []
    linear = Linear(torch.device("cpu"))
    assert linear.kernels is kernels
    real = kernels.small_linear

    class Spy:
        def small_linear(self, x, w):
            calls.append(x.shape[0])
            return real(x, w)

    linear.kernels = Spy()
    w, bias = torch.randn(40, 32), torch.randn(40)
    for m in (1, SMALL_ROWS, SMALL_ROWS + 1, 64):
        x = torch.randn(m, 32)
        torch.testing.assert_close(linear(x, w, bias), F.linear(x, w, bias),
                                   atol=1e-5, rtol=1e-5)
    half = torch.randn(2, 32).half()
    linear(half, w.half())  # float16: torch's GEMM
    assert calls == [1, SMALL_ROWS]


def test_linear_without_the_kernels_is_torch(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    assert Linear(torch.device("cpu")).kernels is None


def test_linear_takes_the_kernel_only_at_the_chosen_rows(kernels):
    """The rank's kernel choice (worker/kernel_choice.py) names the row counts where the
    kernel beat torch's GEMM on this machine; the others, and every count with none
    chosen, run in torch, with the same results."""
    calls = []
    real = kernels.small_linear

    class Spy:
        def small_linear(self, x, w):
            calls.append(x.shape[0])
            return real(x, w)

    w = torch.randn(40, 32)
    for rows, expected in (({1, *range(5, SMALL_ROWS + 1)}, [1, 5, SMALL_ROWS]), (set(), [])):
        calls.clear()
        linear = Linear(torch.device("cpu"), kernel_rows=rows)
        linear.kernels = Spy()
        for m in (1, 4, 5, SMALL_ROWS, SMALL_ROWS + 1):
            x = torch.randn(m, 32)
            torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
        assert calls == expected
