"""Huge-page advice for the KV cache (pagedllm.worker.huge_pages)."""

import sys

import pytest
import torch

from pagedllm.worker.huge_pages import HUGE_PAGE, advise_huge_pages, zeros_huge


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux-only")
def test_advice_covers_the_aligned_part_only():
    t = torch.empty(5 * HUGE_PAGE // 4, dtype=torch.float32)  # 10 MiB
    start = t.data_ptr()
    end = start + t.numel() * 4
    aligned = (end // HUGE_PAGE - -(-start // HUGE_PAGE)) * HUGE_PAGE
    assert advise_huge_pages(t) == aligned
    assert aligned >= 8 * HUGE_PAGE // 2  # at least 4 whole 2 MiB pages inside 10 MiB
    assert advise_huge_pages(torch.empty(HUGE_PAGE // 8)) == 0  # 1 MiB holds no whole page
    assert advise_huge_pages(t.view(-1, 2)[:, 0]) == 0  # not contiguous


def test_zeros_huge_is_zeros():
    t = zeros_huge((3, 700, 16, 64), torch.float32, "cpu")
    assert t.shape == (3, 700, 16, 64) and t.dtype == torch.float32
    assert t.is_contiguous() and not t.any()
