"""The stable top-k (``core.kernels.stable_topk``): the reference against a stable descending sort, ties included,
and the Triton passes against the reference, index for index.

The tests marked ``gpu`` run the Triton kernel: on CUDA, or on CPU in Triton's interpreter
(``TRITON_INTERPRET=1 pytest -m gpu tests/test_stable_topk.py`` with Triton installed).
"""

from __future__ import annotations

import pytest
import torch

from icecache.core.kernels import stable_topk as module
from icecache.core.kernels.stable_topk import stable_topk, stable_topk_reference, stable_topk_triton
from tests.conftest import kernel_device


def tied_scores(gen: torch.Generator, n_rows: int, n: int) -> torch.Tensor:
    """Few distinct values (many ties), negatives, zeros, -1 (PQCache's non-candidates) and -inf."""
    scores = torch.randint(-3, 4, (n_rows, n), generator=gen).float() / 4
    scores[:, : n // 8] = -1.0
    scores[:, n // 8 : n // 6] = float("-inf")
    scores[0] = 0.0
    scores[-1, 1::3] = -0.0  # equal to 0.0: ties in index order with it
    return scores


def test_the_reference_is_the_stable_descending_sort_with_its_ties():
    gen = torch.Generator().manual_seed(14)
    scores = tied_scores(gen, 5, 300)
    for k in (1, 17, 300):
        expected = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(stable_topk_reference(scores, k), expected)
    spread = torch.randn(3, 1000, generator=gen)
    expected = spread.sort(dim=-1, descending=True, stable=True).indices[:, :50]
    assert torch.equal(stable_topk_reference(spread, 50), expected)


def test_cpu_tensors_take_the_reference():
    scores = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(stable_topk(scores, 5), stable_topk_reference(scores, 5))


@pytest.mark.gpu
@pytest.mark.parametrize("n_rows,n,k", [(8, 32768, 112), (8, 9000, 112), (1, 256, 32), (4, 100, 100), (3, 5, 1),
                                        (2, 20000, 3), (8, 4096, 128)])
@pytest.mark.parametrize("ties", [True, False])
def test_the_triton_passes_give_the_reference_s_indices(n_rows, n, k, ties):
    """Rows of one block and of several, so one, two or three passes (the block shrunk below); k a power of two or
    not, equal to n; many ties, or none."""
    device = kernel_device()
    gen = torch.Generator().manual_seed(n + k + ties)
    scores = tied_scores(gen, n_rows, n) if ties else torch.randn(n_rows, n, generator=gen)
    scores = scores.to(device)
    assert torch.equal(stable_topk_triton(scores, k), stable_topk_reference(scores, k))


@pytest.mark.gpu
def test_a_long_row_takes_three_passes_and_stays_exact(monkeypatch):
    monkeypatch.setattr(module, "BLOCK", 256)  # 9000 keys -> 36 blocks x 32 -> 5 blocks x 32 -> 1
    device = kernel_device()
    scores = tied_scores(torch.Generator().manual_seed(5), 3, 9000).to(device)
    assert torch.equal(stable_topk_triton(scores, 20), stable_topk_reference(scores, 20))


@pytest.mark.gpu
def test_bad_arguments_get_one_line():
    device = kernel_device()
    with pytest.raises(ValueError, match="k=9"):
        stable_topk_triton(torch.zeros(2, 8, device=device), 9)
    assert stable_topk_triton(torch.zeros(2, 8, device=device), 0).shape == (2, 0)
    with pytest.raises(ValueError, match="float32"):
        stable_topk_triton(torch.zeros(2, 8, device=device, dtype=torch.float64), 2)
