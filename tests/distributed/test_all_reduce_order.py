"""The tensor-parallel all-reduce adds every element's parts in rank order whatever the tensor's
size. gloo's ring all-reduce with three or more ranks starts each chunk's sum at another rank,
and the chunks follow the tensor's size, so an element's bits depended on the step's row count
(greedy tokens under tp 3 in bfloat16 and logprobs in float32 differed between speculation on,
k + 1 rows per sequence, and off)."""

from __future__ import annotations

import threading

import pytest
import torch

from pagedllm.distributed.parallel_state import (
    TensorParallelGroup,
    create_store,
    new_process_group,
)

# fp32: (1 + 1e8) - 1e8 == 0 (1 is below half an ulp of 1e8), while (1e8 - 1e8) + 1 == 1.
PARTS = (1.0, 1e8, -1e8)
SIZES = (1, 7, 576, 5000, 40 * 576)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_element_sums_in_rank_order_for_every_size(world_size):
    master = create_store(port=0)
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            store = master if rank == 0 else create_store(port=master.port, is_master=False)
            group = TensorParallelGroup(new_process_group(store, rank, world_size, timeout_s=60),
                                        rank, world_size)
            results[rank] = [group.all_reduce(torch.full((n,), PARTS[rank])) for n in SIZES]
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    want = torch.tensor(PARTS[0])
    for part in PARTS[1:world_size]:
        want = want + part  # rank order, in fp32
    for rank in range(world_size):
        for n, got in zip(SIZES, results[rank], strict=True):
            assert torch.equal(got, torch.full((n,), want.item())), (rank, n)
