"""The calibrated pass's forward batches (calib/spool.py pass_batch_tokens, calib/activations.py batch_plan,
calib/parallel.py assign_batches): the same batches whatever the world size, never more tokens per call
than the executor allows, and for samples of one length a multiple of MIN_BATCHES batches of equal size
where the sample count allows it, so that 2, 4 and 8 ranks forward the same number of tokens each."""

import pytest

from quantkit.calib.activations import batch_plan
from quantkit.calib.parallel import assign_batches
from quantkit.calib.spool import MIN_BATCHES, pass_batch_tokens


def _old_cap(batch_tokens, lengths):  # the bound before balancing: at least MIN_BATCHES batches
    return max(1, min(batch_tokens, max(max(lengths), -(-sum(lengths) // MIN_BATCHES))))


@pytest.mark.parametrize("n,t,bt", [(64, 256, 1634), (16, 256, 1634), (128, 2048, 16384), (64, 64, 4096),
                                    (256, 512, 3000), (32, 128, 100000), (96, 256, 2560)])
def test_equal_length_samples_make_equal_batches_in_multiples_of_min_batches(n, t, bt):
    lengths = [t] * n
    tokens = pass_batch_tokens(bt, lengths)
    assert t <= tokens <= _old_cap(bt, lengths)
    plan = batch_plan(lengths, tokens)
    assert sorted(i for c in plan for i in c) == list(range(n))
    assert len(plan) % MIN_BATCHES == 0
    assert len({len(c) for c in plan}) == 1  # these counts divide evenly
    for size in (2, 4, 8):
        owner = assign_batches([len(c) * t for c in plan], size)
        load = [sum(len(c) * t for c, o in zip(plan, owner) if o == r) for r in range(size)]
        assert max(load) == min(load), (size, load)


def test_the_case_that_left_one_rank_heavier():
    # 64 x 256 at the executor's 1634 tokens per call: 6 samples per batch gave 10 batches of 6 and one of 4,
    # 34 samples on rank 0 against 30 on rank 1
    lengths = [256] * 64
    plan = batch_plan(lengths, 1634 // 256 * 256)
    owner = assign_batches([len(c) * 256 for c in plan], 2)
    assert [sum(len(c) for c, o in zip(plan, owner) if o == r) for r in range(2)] == [34, 30]
    plan = batch_plan(lengths, pass_batch_tokens(1634, lengths))
    owner = assign_batches([len(c) * 256 for c in plan], 2)
    assert [sum(len(c) for c, o in zip(plan, owner) if o == r) for r in range(2)] == [32, 32]


@pytest.mark.parametrize("n,t,bt", [(10, 32, 4096), (13, 100, 250), (3, 10, 100), (1, 7, 1), (100, 256, 1634)])
def test_counts_that_do_not_divide_stay_within_the_bound(n, t, bt):
    lengths = [t] * n
    tokens = pass_batch_tokens(bt, lengths)
    assert t <= tokens <= max(t, _old_cap(bt, lengths))
    plan = batch_plan(lengths, tokens)
    sizes = [len(c) for c in plan]
    assert sum(sizes) == n and len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0]


def test_mixed_lengths_keep_the_cap():
    lengths = [64, 128, 128, 256, 64, 32]
    assert pass_batch_tokens(4096, lengths) == _old_cap(4096, lengths)
    assert pass_batch_tokens(100, []) == 100
