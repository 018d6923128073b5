"""The KVManager protocol: both managers satisfy it, the factory picks them by name, and the
admission errors (``check_request_fits``) keep their exact messages."""

import inspect

import pytest

from pagedllm.config import EngineConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.contiguous_kv_manager import ContiguousKVManager
from pagedllm.core.kv_manager import ContextLengthExceededError, KVManager, create_kv_manager


def protocol_members() -> set[str]:
    return {
        name
        for name in dir(KVManager)
        if not name.startswith("_") and name not in dir(object)
    } | set(KVManager.__annotations__)


@pytest.mark.parametrize(
    "mgr",
    [
        BlockManager(8, 4, num_swap_blocks=4),
        BlockManager(8, 4, enable_prefix_caching=False),
        ContiguousKVManager(16, 4, "orca-oracle", max_model_len=32),
    ],
    ids=["paged+swap", "paged", "orca"],
)
def test_both_managers_satisfy_the_protocol(mgr):
    assert isinstance(mgr, KVManager)
    # Structural check of every member, with the protocol's signatures.
    for name in protocol_members():
        assert hasattr(mgr, name), name
        proto = inspect.getattr_static(KVManager, name, None)
        if inspect.isfunction(proto):
            got = inspect.signature(getattr(mgr, name))
            want = inspect.signature(proto.__get__(mgr))
            assert list(got.parameters) == list(want.parameters), name


def test_contiguous_manager_is_not_a_block_manager():
    assert not issubclass(ContiguousKVManager, BlockManager)
    m = ContiguousKVManager(16, 4, "orca-max", max_model_len=32)
    assert m.prefix_cache is None and m.num_swap_blocks == 0 and m.swap_ref_counts() is None
    assert not m.can_swap_out([]) and m.reset_prefix_cache() == 0


@pytest.mark.parametrize(
    "name, cls", [("paged", BlockManager)] + [(p, ContiguousKVManager) for p in
                                               ("orca-max", "orca-pow2", "orca-oracle")]
)
def test_factory_picks_by_name(name, cls):
    cfg = EngineConfig(kv_manager=name, block_size=4, enable_prefix_caching=True)
    m = create_kv_manager(cfg, num_blocks=32, num_swap_blocks=8, max_model_len=64)
    assert type(m) is cls
    assert (m.num_blocks, m.block_size) == (32, 4)
    if cls is BlockManager:
        assert m.num_swap_blocks == 8 and m.prefix_cache is not None
    else:
        assert m.policy == name
        assert m.num_swap_blocks == 0 and m.prefix_cache is None  # no swapping, no caching


def test_paged_pool_limit_message():
    bm = BlockManager(8, 4)
    bm.check_request_fits(10, 22, 1, False)  # 32 tokens = 8 blocks: fits exactly
    with pytest.raises(ContextLengthExceededError) as e:
        bm.check_request_fits(10, 30, 1, False)
    assert e.value.param == "max_tokens"
    assert str(e.value) == (
        "max_tokens: a sample of up to 40 tokens needs more KV blocks than the whole pool "
        "(8 blocks of 4 tokens)"
    )
    # A prompt that does not fit with its first output token is the prompt's fault; a pooling
    # request (max_tokens 0) generates nothing and may fill the pool exactly.
    with pytest.raises(ContextLengthExceededError) as e:
        bm.check_request_fits(32, 1, 1, False)
    assert (e.value.param, str(e.value)) == (
        "prompt",
        "prompt: a prompt of 32 tokens and a first output token needs more KV blocks than the "
        "whole pool (8 blocks of 4 tokens)",
    )
    bm.check_request_fits(32, 0, 1, False)
    with pytest.raises(ContextLengthExceededError, match=r"^prompt: a prompt of 33 tokens needs"):
        bm.check_request_fits(33, 0, 1, False)
    # Samples share the prompt's 2 full blocks; each needs room for one output token:
    # 3 + 2 * (3 - 2) = 5 blocks for 3 samples (more output may not fit at once: admitted).
    bm.check_request_fits(8, 4, 3, False)
    bm.check_request_fits(8, 20, 3, False)
    with pytest.raises(ContextLengthExceededError, match="3 samples") as e:
        BlockManager(4, 4).check_request_fits(8, 4, 3, False, "best_of")
    assert e.value.param == "best_of"


def test_orca_admission_errors_unchanged():
    m = ContiguousKVManager(24, 4, "orca-oracle", max_model_len=128)
    for n, beam in ((2, False), (1, True)):
        with pytest.raises(ValueError) as e:
            m.check_request_fits(2, 4, n, beam)
        assert not isinstance(e.value, ContextLengthExceededError)
        assert str(e.value) == (
            "n: kv_manager='orca-oracle' reserves one contiguous run per request and cannot "
            "share it; parallel sampling and beam search need 'paged'"
        )
    # 90 tokens -> 23 blocks -> a chunk of 32 > the pool's largest root (16 of 24 blocks).
    with pytest.raises(ContextLengthExceededError) as e:
        m.check_request_fits(2, 88, 1, False)
    assert e.value.param == "max_tokens"
    assert str(e.value) == (
        "max_tokens: the orca-oracle reservation of 90 tokens needs a chunk of 32 blocks, more "
        "than the pool's largest (16 blocks of 4 tokens)"
    )
    m.check_request_fits(2, 62, 1, False)  # 64 tokens -> 16 blocks: the largest chunk
    pow2 = ContiguousKVManager(24, 4, "orca-pow2", max_model_len=128)
    with pytest.raises(ContextLengthExceededError, match="orca-pow2 reservation of 128 tokens"):
        pow2.check_request_fits(2, 63, 1, False)  # 65 -> 128 tokens -> 32 blocks
