"""Stage 3 prefetch decisions and the reducer's bucket geometry, decided by the pure C++ core
(Note [Stage 3 prefetch plan] in prefetch_plan.hpp, Note [Reducer bucket geometry] in bucket_geometry.hpp).

Each rule is compared with a reference written here from the rule's description, modelled on the
runtime it replaces (Stage3Runtime._prefetch_next / _prefetch_for_backward in python/zerocore/_stage3.py:
units carry a state, and starting a gather makes a unit GATHERING, so it is no longer SHARDED), and
checked against properties that do not depend on either implementation.
"""

from __future__ import annotations

import enum
import itertools

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from zerocore import _C

INT64_MAX = 2**63 - 1


# ---- references -----------------------------------------------------------------------------------------
class State(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class FakeUnit:
    def __init__(self, numel: int, sharded: bool, persistent: bool = False) -> None:
        self.numel = numel
        self.state = State.SHARDED if sharded else State.GATHERED
        self.persistent = persistent


class ReferenceRuntime:
    """The decision part of a stage 3 runtime: gathering starts a unit and adds its elements to the live count."""

    def __init__(self, numel, sharded, persistent=None, live_elements=0, max_live=0, prefetch_elements=0):
        persistent = persistent if persistent is not None else [False] * len(numel)
        self.units = [FakeUnit(n, s, p) for n, s, p in zip(numel, sharded, persistent)]
        self.live_elements = live_elements
        self.max_live = max_live
        self.prefetch_elements = prefetch_elements
        self.gathered: list[int] = []

    def gather(self, index: int) -> None:
        self.units[index].state = State.GATHERING
        self.live_elements += self.units[index].numel
        self.gathered.append(index)

    def prefetch_next(self, recorded_order: list[int], position: int) -> list[int]:
        """Forward: walk on from `position` while budget is left; a unit gathered ahead already spends the
        budget (once) unless it is persistent; stop at the first unit at rest that would exceed max_live."""
        budget = self.prefetch_elements
        ahead: set[int] = set()
        while position < len(recorded_order) and budget > 0:
            index = recorded_order[position]
            position += 1
            unit = self.units[index]
            if unit.state is not State.SHARDED:
                if not unit.persistent and index not in ahead:
                    ahead.add(index)
                    budget -= unit.numel
                continue
            if self.live_elements + unit.numel > self.max_live:
                break
            self.gather(index)
            ahead.add(index)
            budget -= unit.numel
        return self.gathered

    def prefetch_for_backward(self, recorded_order: list[int], unit: int, visit: int = 0) -> int | None:
        """Backward: from just before the `visit`-th occurrence of `unit` counted from the end, look back for the
        first unit at rest and not persistent; gather it if it fits, and stop there either way."""
        occurrences = [i for i, u in enumerate(recorded_order) if u == unit]
        if visit >= len(occurrences):
            return None
        for index in reversed(recorded_order[:occurrences[-1 - visit]]):
            previous = self.units[index]
            if previous.state is State.SHARDED and not previous.persistent:
                if self.live_elements + previous.numel <= self.max_live:
                    self.gather(index)
                    return index
                return None
        return None


def reference_geometry_is_valid(bucket_padded_size, param_bucket, param_offset, param_numel, world_size) -> bool:
    if world_size < 1:
        return False
    if any(p < 0 or p % world_size for p in bucket_padded_size):
        return False
    if not len(param_bucket) == len(param_offset) == len(param_numel):
        return False
    for b, o, n in zip(param_bucket, param_offset, param_numel):
        if not 0 <= b < len(bucket_padded_size) or o < 0 or n < 0 or o + n > bucket_padded_size[b]:
            return False
    # pairwise: two non-empty ranges of one bucket intersect
    for i, j in itertools.combinations(range(len(param_bucket)), 2):
        if param_bucket[i] != param_bucket[j] or param_numel[i] == 0 or param_numel[j] == 0:
            continue
        ends = (param_offset[i] + param_numel[i], param_offset[j] + param_numel[j])
        if max(param_offset[i], param_offset[j]) < min(ends):
            return False
    return True


# ---- strategies -----------------------------------------------------------------------------------------
small = st.integers(0, 60)
edge = st.sampled_from([0, 1, 2**62, INT64_MAX])
sizes = st.one_of(small, small, small, edge)


@st.composite
def schedules(draw, backward: bool = False):
    n = draw(st.integers(0 if not backward else 1, 8))
    numel = draw(st.lists(sizes, min_size=n, max_size=n))
    sharded = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    persistent = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    # repeats are the rule with n small: a block called twice appears twice
    order = draw(st.lists(st.integers(0, n - 1), max_size=20)) if n else []
    live = draw(sizes)
    max_live = draw(st.one_of(sizes, st.integers(0, 300)))
    budget = draw(st.one_of(sizes, st.integers(0, 300)))
    return numel, sharded, persistent, order, live, max_live, budget


def forward(numel, sharded, order, position, live, max_live, budget, persistent=None):
    persistent = persistent if persistent is not None else [False] * len(numel)
    return _C.plan_forward_prefetch(
        recorded_order=order, position=position, unit_numel=numel, unit_sharded=sharded,
        unit_persistent=persistent, live_elements=live, max_live=max_live, prefetch_budget=budget)


def backward(numel, sharded, persistent, order, unit, live, max_live, visit=0):
    return _C.plan_backward_prefetch(
        recorded_order=order, unit=unit, visit=visit, unit_numel=numel, unit_sharded=sharded,
        unit_persistent=persistent, live_elements=live, max_live=max_live)


# ---- forward --------------------------------------------------------------------------------------------
@given(schedules(), st.data())
def test_forward_plan_matches_reference(schedule, data):
    numel, sharded, persistent, order, live, max_live, budget = schedule
    position = data.draw(st.integers(0, len(order)))
    reference = ReferenceRuntime(numel, sharded, persistent, live_elements=live, max_live=max_live,
                                 prefetch_elements=budget)
    assert (forward(numel, sharded, order, position, live, max_live, budget, persistent)
            == reference.prefetch_next(order, position))


def _ahead_before(order, position, sharded, persistent, unit):
    """The units gathered ahead already (not persistent) that the walk meets before reaching ``unit``."""
    before = order[position:order.index(unit, position)]
    return list(dict.fromkeys(u for u in before if not sharded[u] and not persistent[u]))


@given(schedules(), st.data())
def test_forward_plan_properties(schedule, data):
    numel, sharded, persistent, order, live, max_live, budget = schedule
    position = data.draw(st.integers(0, len(order)))
    plan = forward(numel, sharded, order, position, live, max_live, budget, persistent)
    started = sum(numel[u] for u in plan)
    # only units at rest, each once, never beyond max_live, nothing without a budget
    assert all(sharded[u] for u in plan)
    assert len(set(plan)) == len(plan)
    assert not plan or live + started <= max_live
    assert budget > 0 or not plan
    # a prefix of the units at rest in recorded order from `position` (first occurrences): never skips one
    candidates = list(dict.fromkeys(u for u in order[position:] if sharded[u]))
    assert plan == candidates[: len(plan)]
    # what is ahead when a unit starts (gathered already or started before it, persistent units aside) is
    # under the budget: the budget bounds the lookahead, so only the last unit started may overrun it
    for i, unit in enumerate(plan):
        ahead = sum(numel[u] for u in _ahead_before(order, position, sharded, persistent, unit)) + sum(
            numel[u] for u in plan[:i])
        assert ahead < budget
    # and it stops early only for the budget or for max_live
    if len(plan) < len(candidates):
        nxt = candidates[len(plan)]
        ahead = sum(numel[u] for u in _ahead_before(order, position, sharded, persistent, nxt)) + started
        assert budget - ahead <= 0 or live + started + numel[nxt] > max_live


def test_forward_lookahead_stays_one_unit_after_the_step_started_gathers():
    """The default budget (one element: one unit ahead), units gathered by the step before the forward: the
    forward holds the computing unit and the next one. Counting only what each call starts, the unit the
    step gathered ahead made every later call start one more: three units at a time."""
    numel, order = [4] * 6, list(range(6))
    sharded = [False, False] + [True] * 4  # the step started unit 0 and the one after it
    held = []
    for position in range(1, 7):
        computing = order[position - 1]
        sharded[computing] = False  # (gathered for its forward)
        for unit in forward(numel, sharded, order, position, 0, 100, 1):
            sharded[unit] = False
        held.append(sharded.count(False))
        sharded[computing] = True  # released after its forward
    assert held == [2, 2, 2, 2, 2, 1]


def test_forward_plan_examples():
    # a block called twice: its second occurrence is already gathering
    assert forward([10, 10, 10], [True] * 3, [0, 1, 0, 2], 0, 0, 100, 100) == [0, 1, 2]
    # the first unit that does not fit stops the walk, even if a later one would fit
    assert forward([10, 50, 1], [True] * 3, [0, 1, 2], 0, 0, 30, 100) == [0]
    # a unit larger than the budget left is still started; then the budget is spent
    assert forward([5, 50, 1], [True] * 3, [0, 1, 2], 0, 0, 100, 6) == [0, 1]
    # a unit gathered ahead already spends the budget; a persistent one does not
    assert forward([5, 50, 1], [True, False, True], [0, 1, 2], 1, 0, 100, 1) == []
    assert forward([5, 50, 1], [True, False, True], [0, 1, 2], 1, 0, 100, 51) == [2]
    assert forward([5, 50, 1], [True, False, True], [0, 1, 2], 1, 0, 100, 1, [False, True, False]) == [2]
    # counted once, however often it repeats
    assert forward([5, 3, 1], [True, False, True], [1, 1, 1, 2], 0, 0, 100, 4) == [2]
    assert forward([5], [True], [0], 0, 0, 100, 0) == []
    assert forward([5], [True], [0], 1, 0, 100, 10) == []
    assert forward([0], [True], [0], 0, 0, 0, 1) == [0]  # an empty unit fits under max_live 0
    assert forward([1], [True], [0], 0, 5, 3, 1) == []  # already above max_live
    assert forward([], [], [], 0, 0, 0, 0) == []
    assert forward([INT64_MAX, 1], [True, True], [0, 1], 0, 0, INT64_MAX, INT64_MAX) == [0]


# ---- backward -------------------------------------------------------------------------------------------
@given(schedules(backward=True), st.data())
def test_backward_plan_matches_reference(schedule, data):
    numel, sharded, persistent, order, live, max_live, _ = schedule
    unit = data.draw(st.sampled_from(order) if order and data.draw(st.booleans()) else st.integers(0, len(numel) - 1))
    visit = data.draw(st.integers(0, 3))
    reference = ReferenceRuntime(numel, sharded, persistent, live_elements=live, max_live=max_live)
    expected = reference.prefetch_for_backward(order, unit, visit)
    assert backward(numel, sharded, persistent, order, unit, live, max_live, visit) == expected


@given(schedules(backward=True), st.data())
def test_backward_plan_properties(schedule, data):
    numel, sharded, persistent, order, live, max_live, _ = schedule
    assume(order)
    unit = data.draw(st.sampled_from(order))
    calls = [i for i, u in enumerate(order) if u == unit]
    visit = data.draw(st.integers(0, len(calls) - 1))
    chosen = backward(numel, sharded, persistent, order, unit, live, max_live, visit)
    call = calls[-1 - visit]  # the backward meets the calls last first
    eligible = [i for i in range(call) if sharded[order[i]] and not persistent[order[i]]]
    if not eligible:
        assert chosen is None
        return
    # the nearest eligible unit before the visited call of `unit` is the only candidate; it goes if it fits
    candidate = order[eligible[-1]]
    assert chosen == (candidate if live + numel[candidate] <= max_live else None)


def test_backward_plan_examples():
    flags = [True] * 4
    rest = [False] * 4
    # the unit before the LAST occurrence of the unit, on its first backward; on its second, the one before
    # the occurrence before (the units in between, done already, are never candidates); no third
    assert backward([1] * 4, flags, rest, [0, 1, 2, 1, 3], 1, 0, 100) == 2
    assert backward([1] * 4, flags, rest, [0, 1, 2, 1, 3], 1, 0, 100, visit=1) == 0
    assert backward([1] * 4, flags, rest, [0, 1, 2, 1, 3], 1, 0, 100, visit=2) is None
    # not sharded or persistent units are skipped
    assert backward([1] * 4, [True, False, True, True], [False, False, True, False], [0, 1, 2, 3], 3, 0, 100) == 0
    # the first candidate that does not fit ends the search
    assert backward([1, 50, 1, 1], flags, rest, [0, 1, 2], 2, 0, 10) is None
    assert backward([1] * 4, flags, rest, [0, 1], 3, 0, 100) is None  # not recorded
    assert backward([1] * 4, flags, rest, [0, 1], 0, 0, 100) is None  # first unit
    assert backward([0] * 4, flags, rest, [0, 1], 1, 0, 0) == 0
    assert backward([1] * 4, flags, rest, [], 1, 0, 100) is None


# ---- bad inputs -----------------------------------------------------------------------------------------
FORWARD_OK = {"recorded_order": [0, 1], "position": 0, "unit_numel": [1, 2], "unit_sharded": [True, True],
              "unit_persistent": [False, False], "live_elements": 0, "max_live": 10, "prefetch_budget": 10}
BACKWARD_OK = {"recorded_order": [0, 1], "unit": 1, "visit": 0, "unit_numel": [1, 2], "unit_sharded": [True, True],
               "unit_persistent": [False, False], "live_elements": 0, "max_live": 10}


@pytest.mark.parametrize("change, name", [
    ({"recorded_order": [0, 2]}, "recorded_order"),
    ({"recorded_order": [-1]}, "recorded_order"),
    ({"position": -1}, "position"),
    ({"position": 3}, "position"),
    ({"unit_numel": [1, -2]}, "unit_numel"),
    ({"unit_sharded": [True]}, "unit_sharded"),
    ({"unit_sharded": [True, 2]}, "unit_sharded"),
    ({"unit_persistent": [False]}, "unit_persistent"),
    ({"unit_persistent": [False, 2]}, "unit_persistent"),
    ({"live_elements": -1}, "live_elements"),
    ({"max_live": -1}, "max_live"),
    ({"prefetch_budget": -1}, "prefetch_budget"),
])
def test_forward_plan_rejects_bad_input(change, name):
    assert _C.plan_forward_prefetch(**FORWARD_OK) == [0, 1]
    with pytest.raises(ValueError, match=name):
        _C.plan_forward_prefetch(**{**FORWARD_OK, **change})


@pytest.mark.parametrize("change, name", [
    ({"recorded_order": [0, 5]}, "recorded_order"),
    ({"unit": 2}, "unit"),
    ({"unit": -1}, "unit"),
    ({"visit": -1}, "visit"),
    ({"unit_numel": [-1, 2]}, "unit_numel"),
    ({"unit_sharded": [True, True, True]}, "unit_sharded"),
    ({"unit_persistent": [False]}, "unit_persistent"),
    ({"unit_persistent": [False, 3]}, "unit_persistent"),
    ({"live_elements": -5}, "live_elements"),
    ({"max_live": -5}, "max_live"),
])
def test_backward_plan_rejects_bad_input(change, name):
    assert _C.plan_backward_prefetch(**BACKWARD_OK) == 0
    with pytest.raises(ValueError, match=name):
        _C.plan_backward_prefetch(**{**BACKWARD_OK, **change})


# ---- the planner object the runtime asks ----------------------------------------------------------------
@given(schedules(), st.data())
def test_the_planner_answers_as_the_functions(schedule, data):
    """One PrefetchPlanner (the order, sizes and persistence taken once, the states read in place from a
    bytearray, as the runtime keeps them) asked question after question, the states changed in place between,
    answers as the functions do (each a fresh planner, compared with the references above)."""
    numel, sharded, persistent, order, live, max_live, budget = schedule
    planner = _C.PrefetchPlanner(order, numel, persistent)
    flags = bytearray(sharded)
    for _ in range(4):
        position = data.draw(st.integers(0, len(order)))
        assert planner.forward(position=position, unit_sharded=flags, live_elements=live, max_live=max_live,
                               prefetch_budget=budget) == forward(numel, sharded, order, position, live, max_live,
                                                                  budget, persistent)
        if numel:
            unit, visit = data.draw(st.integers(0, len(numel) - 1)), data.draw(st.integers(0, 3))
            assert planner.backward(unit=unit, visit=visit, unit_sharded=flags, live_elements=live,
                                    max_live=max_live) == backward(numel, sharded, persistent, order, unit, live,
                                                                   max_live, visit)
        # the states change between questions, in place, as the units move
        sharded = data.draw(st.lists(st.booleans(), min_size=len(numel), max_size=len(numel)))
        flags[:] = bytes(sharded)


@pytest.mark.parametrize("build, name", [
    (lambda: _C.PrefetchPlanner([0, 5], [1, 2], [0, 0]), "recorded_order"),
    (lambda: _C.PrefetchPlanner([0], [-1, 2], [0, 0]), "unit_numel"),
    (lambda: _C.PrefetchPlanner([0], [1, 2], [0]), "unit_persistent"),
    (lambda: _C.PrefetchPlanner([0], [1, 2], [0, 2]), "unit_persistent"),
])
def test_the_planner_refuses_what_the_functions_refuse(build, name):
    with pytest.raises(ValueError, match=name):
        build()


@pytest.mark.parametrize("ask, name", [
    (lambda p: p.forward(position=3, unit_sharded=bytearray(2), live_elements=0, max_live=9, prefetch_budget=9),
     "position"),
    (lambda p: p.forward(position=0, unit_sharded=bytearray(3), live_elements=0, max_live=9, prefetch_budget=9),
     "unit_sharded"),
    (lambda p: p.forward(position=0, unit_sharded=bytearray(2), live_elements=0, max_live=9, prefetch_budget=-1),
     "prefetch_budget"),
    (lambda p: p.backward(unit=2, visit=0, unit_sharded=bytearray(2), live_elements=0, max_live=9), "unit"),
    (lambda p: p.backward(unit=0, visit=-1, unit_sharded=bytearray(2), live_elements=0, max_live=9), "visit"),
    (lambda p: p.backward(unit=0, visit=0, unit_sharded=bytearray(1), live_elements=-1, max_live=9),
     "unit_sharded"),
    (lambda p: p.backward(unit=0, visit=0, unit_sharded=bytearray(2), live_elements=-1, max_live=9),
     "live_elements"),
])
def test_the_planner_refuses_bad_questions(ask, name):
    planner = _C.PrefetchPlanner([0, 1], [1, 2], [0, 0])
    with pytest.raises(ValueError, match=name):
        ask(planner)


# ---- reducer geometry -----------------------------------------------------------------------------------
@st.composite
def geometries(draw):
    """A valid geometry: parameters placed in each bucket at increasing offsets with gaps, then shuffled."""
    world = draw(st.integers(1, 8))
    num_buckets = draw(st.integers(0, 6))
    padded, params = [], []
    for b in range(num_buckets):
        offset = 0
        for _ in range(draw(st.integers(0, 5))):
            offset += draw(st.integers(0, 3))  # gap (alignment)
            numel = draw(st.integers(0, 20))
            params.append((b, offset, numel))
            offset += numel
        padded.append(-(-(offset + draw(st.integers(0, 5))) // world) * world)
    params = draw(st.permutations(params))
    return padded, [p[0] for p in params], [p[1] for p in params], [p[2] for p in params], world


@given(geometries())
def test_reducer_geometry_accepts_valid_layouts_and_launches_in_reverse(geometry):
    padded, bucket, offset, numel, world = geometry
    assert reference_geometry_is_valid(padded, bucket, offset, numel, world)
    assert _C.reducer_geometry(padded, bucket, offset, numel, world) == list(reversed(range(len(padded))))


@given(geometries(), st.data())
def test_reducer_geometry_agrees_with_reference_on_perturbed_layouts(geometry, data):
    padded, bucket, offset, numel, world = (list(x) if isinstance(x, list) else x for x in geometry)
    for _ in range(data.draw(st.integers(1, 3))):
        field = data.draw(st.sampled_from(["padded", "bucket", "offset", "numel", "world"]))
        delta = data.draw(st.sampled_from([-3, -1, 1, 2, 7]))
        target = {"padded": padded, "bucket": bucket, "offset": offset, "numel": numel}.get(field)
        if field == "world":
            world += delta
        elif target:
            target[data.draw(st.integers(0, len(target) - 1))] += delta
    valid = reference_geometry_is_valid(padded, bucket, offset, numel, world)
    if valid:
        assert _C.reducer_geometry(padded, bucket, offset, numel, world) == list(reversed(range(len(padded))))
    else:
        with pytest.raises(ValueError):
            _C.reducer_geometry(padded, bucket, offset, numel, world)


@given(geometries())
def test_bucket_cuts_are_each_buckets_parameter_boundaries(geometry):
    padded, bucket, offset, numel, _ = geometry
    cuts = _C.bucket_cuts(len(padded), bucket, offset, numel)
    assert len(cuts) == len(padded)
    for b in range(len(padded)):
        spans = [(o, o + n) for pb, o, n in zip(bucket, offset, numel) if pb == b and n > 0]
        assert cuts[b] == sorted({c for span in spans for c in span})
        for begin, end in spans:
            assert not [c for c in cuts[b] if begin < c < end]


@pytest.mark.parametrize("args, name", [
    ((-1, [], [], []), "num_buckets"),
    ((1, [0, 0], [0], [1, 1]), "param_offset and param_numel"),
    ((1, [0, 1], [0, 4], [2, 2]), r"param_bucket\[1\]"),
    ((2, [0, -1], [0, 4], [2, 2]), r"param_bucket\[1\]"),
])
def test_bucket_cuts_rejects_bad_input(args, name):
    with pytest.raises(ValueError, match=name):
        _C.bucket_cuts(*args)


GEOMETRY_OK = {"bucket_padded_size": [8, 4], "param_bucket": [0, 0, 1], "param_offset": [0, 4, 0],
               "param_numel": [4, 3, 4], "world_size": 2}


@pytest.mark.parametrize("change, name", [
    ({"world_size": 0}, "world_size"),
    ({"bucket_padded_size": [7, 4]}, "bucket_padded_size"),
    ({"bucket_padded_size": [-2, 4]}, "bucket_padded_size"),
    ({"param_bucket": [0, 0, 2]}, "param_bucket"),
    ({"param_bucket": [0, -1, 1]}, "param_bucket"),
    ({"param_offset": [0, 4]}, "param_offset"),
    ({"param_numel": [4, 3]}, "param_numel"),
    ({"param_offset": [0, -1, 0]}, "param_offset"),
    ({"param_numel": [4, -3, 4]}, "param_numel"),
    ({"param_numel": [4, 5, 4]}, "does not fit"),  # runs past the bucket's end
    ({"param_offset": [0, 3, 0]}, "overlap"),
])
def test_reducer_geometry_rejects_bad_input(change, name):
    assert _C.reducer_geometry(**GEOMETRY_OK) == [1, 0]
    with pytest.raises(ValueError, match=name):
        _C.reducer_geometry(**{**GEOMETRY_OK, **change})


def test_reducer_geometry_names_both_overlapping_parameters():
    with pytest.raises(ValueError, match=r"parameter 2 \[2, 6\) and parameter 0 \[3, 5\)"):
        _C.reducer_geometry([8], [0, 0, 0], [3, 6, 2], [2, 1, 4], 1)
    # empty parameters occupy nothing, wherever they sit
    assert _C.reducer_geometry([8], [0, 0, 0], [3, 3, 8], [2, 0, 0], 1) == [0]
