"""The launch decisions of the pure C++ ReadyTracker: one order on every rank, whatever the ready order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerocore import _C


@st.composite
def tracker_inputs(draw):
    num_buckets = draw(st.integers(1, 8))
    param_bucket = draw(st.lists(st.integers(0, num_buckets - 1), min_size=0, max_size=30))
    launch_order = draw(st.permutations(list(range(num_buckets))))
    ready_order = draw(st.permutations(list(range(len(param_bucket)))))
    used = draw(st.integers(0, len(param_bucket)))  # the rest never get a gradient (unused parameters)
    return param_bucket, num_buckets, launch_order, ready_order[:used]


@given(tracker_inputs())
def test_buckets_launch_in_launch_order_and_finalize_launches_the_rest(inputs):
    param_bucket, num_buckets, launch_order, ready_order = inputs
    tracker = _C.ReadyTracker(param_bucket, num_buckets, launch_order)
    launched = []
    for param in ready_order:
        launched += tracker.mark_ready(param)
        # a bucket launches only once all its parameters are ready
        for bucket in launched:
            members = [i for i, b in enumerate(param_bucket) if b == bucket]
            assert all(i in ready_order[: ready_order.index(param) + 1] for i in members)
    rest, unmarked = tracker.finalize()
    assert launched + rest == list(launch_order)
    assert sorted(unmarked) == sorted(set(range(len(param_bucket))) - set(ready_order))


@given(tracker_inputs(), st.randoms(use_true_random=False))
def test_launch_sequence_does_not_depend_on_ready_order(inputs, rng):
    param_bucket, num_buckets, launch_order, _ = inputs
    sequences = set()
    for _ in range(3):
        order = list(range(len(param_bucket)))
        rng.shuffle(order)
        tracker = _C.ReadyTracker(param_bucket, num_buckets, launch_order)
        launched = [b for p in order for b in tracker.mark_ready(p)]
        rest, _ = tracker.finalize()
        sequences.add(tuple(launched + rest))
    assert len(sequences) == 1


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="permutation"):
        _C.ReadyTracker([0, 1], 2, [0, 0])
    with pytest.raises(ValueError, match="param_bucket\\[1\\]"):
        _C.ReadyTracker([0, 5], 2, [0, 1])
    tracker = _C.ReadyTracker([0, 0, 1], 2, [1, 0])
    tracker.mark_ready(0)
    with pytest.raises(RuntimeError, match="marked ready twice"):
        tracker.mark_ready(0)
    tracker.finalize()
    with pytest.raises(RuntimeError, match="finalized"):
        tracker.mark_ready(1)
    with pytest.raises(RuntimeError, match="twice"):
        tracker.finalize()
    tracker.reset()
    assert tracker.mark_ready(2) == [1]


@given(tracker_inputs())
def test_completion_order_is_where_the_last_gradient_of_each_bucket_arrived(inputs):
    """Note [Bucket launch order]: a bucket is complete when its last parameter is marked, whatever its turn;
    finalize() completes the rest (zero-filled, or without parameters) in launch order."""
    param_bucket, num_buckets, launch_order, ready_order = inputs
    tracker = _C.ReadyTracker(param_bucket, num_buckets, launch_order)
    expected, pending = [], {b: param_bucket.count(b) for b in range(num_buckets)}
    for param in ready_order:
        tracker.mark_ready(param)
        pending[param_bucket[param]] -= 1
        if pending[param_bucket[param]] == 0:
            expected.append(param_bucket[param])
        assert tracker.completion_order() == expected
    tracker.finalize()
    assert tracker.completion_order() == expected + [b for b in launch_order if b not in expected]
    tracker.reset()
    assert tracker.completion_order() == []


@given(tracker_inputs(), st.randoms(use_true_random=False))
def test_a_new_launch_order_takes_effect_at_the_next_backward(inputs, rng):
    param_bucket, num_buckets, launch_order, ready_order = inputs
    tracker = _C.ReadyTracker(param_bucket, num_buckets, launch_order)
    new_order = list(launch_order)
    rng.shuffle(new_order)
    if ready_order:
        tracker.mark_ready(ready_order[0])
        with pytest.raises(RuntimeError, match="during a backward"):
            tracker.set_launch_order(new_order)
    tracker.finalize()
    with pytest.raises(ValueError, match="permutation"):
        tracker.set_launch_order([num_buckets] * num_buckets)  # (out of range)
    assert tracker.launch_order == list(launch_order)  # a refused order changes nothing
    tracker.set_launch_order(new_order)
    tracker.reset()
    launched = []
    for param in ready_order:
        launched += tracker.mark_ready(param)
    launched += tracker.finalize()[0]
    assert launched == new_order
