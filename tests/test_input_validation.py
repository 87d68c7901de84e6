"""Bad input ends in a Python exception that names what is wrong (never a segfault, a hang, a torch internal
assert, a pybind TypeError or a silently wrong result), and in-place updates are visible to autograd.

Issue 9, items 9 (version counters), 21 (GradReducer validates before copying), 25 (param groups) and 26.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import zerocore
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from zerocore import _C, _construction, _model_checks, ops
from zerocore.optim import CPUAdam

pytestmark = pytest.mark.timeout(300)

_CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1}}


def _adam_args(n: int = 8):
    return torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)


def _linear(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


# ---- item 9: version counters ------------------------------------------------------------------------------

def test_adam_step_bumps_the_version_of_every_tensor_it_writes_and_only_those():
    param, grad, exp_avg, exp_avg_sq = _adam_args()
    out = torch.empty(8, dtype=torch.bfloat16)
    ops.adam_step(param, grad, exp_avg, exp_avg_sq, step=1, lr=0.1, param_out=out)
    assert [t._version for t in (param, exp_avg, exp_avg_sq, out)] == [1, 1, 1, 1]
    assert grad._version == 0  # only read
    with torch.no_grad():  # how optimizers call it
        ops.adam_step(param, grad, exp_avg, exp_avg_sq, step=2, lr=0.1)
    assert [t._version for t in (param, exp_avg, exp_avg_sq, out)] == [2, 2, 2, 1]


def test_multi_tensor_adam_step_bumps_versions_once_per_call():
    lists = [_adam_args(n) for n in (3, 0, 17)]
    params, grads, exp_avgs, exp_avg_sqs = (list(column) for column in zip(*lists))
    outs = [torch.empty(3, dtype=torch.float16), None, torch.empty(17, dtype=torch.bfloat16)]
    ops.multi_tensor_adam_step(params, grads, exp_avgs, exp_avg_sqs, step=1, lr=0.1, param_outs=outs)
    for written in (params, exp_avgs, exp_avg_sqs, [outs[0], outs[2]]):
        assert [t._version for t in written] == [1] * len(written)
    assert [g._version for g in grads] == [0, 0, 0]
    with pytest.raises(ValueError, match="lr"):  # rejected before anything is written: no bump either
        ops.multi_tensor_adam_step(params, grads, exp_avgs, exp_avg_sqs, step=1, lr=math.nan)
    assert [p._version for p in params] == [1, 1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_backward_through_a_graph_that_saved_the_old_param_raises_after_cpu_adam_step(dtype, layout):
    # torch.optim.AdamW behaves this way; a silently stale gradient is the bug.
    weight = torch.randn(4, 3, dtype=dtype)
    weight = nn.Parameter(weight if layout == "contiguous" else weight.t().contiguous().t())
    x = torch.randn(2, 3, dtype=dtype, requires_grad=True)
    loss = (x @ weight.t()).square().sum()  # saves weight for x's gradient
    loss.backward(retain_graph=True)
    CPUAdam([weight], lr=0.1).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_adam_op_refuses_a_tensor_that_requires_grad_in_grad_mode_like_torch_in_place_ops():
    param = nn.Parameter(torch.randn(4))
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        ops.adam_step(param, torch.ones(4), torch.zeros(4), torch.zeros(4), step=1, lr=0.1)
    with torch.no_grad():
        ops.adam_step(param, torch.ones(4), torch.zeros(4), torch.zeros(4), step=1, lr=0.1)


def test_inference_tensors_follow_torch_in_place_rules():
    with torch.inference_mode():
        param, grad, exp_avg, exp_avg_sq = _adam_args()
        ops.adam_step(param, grad, exp_avg, exp_avg_sq, step=1, lr=0.1)  # fine inside inference mode
    before = param.clone()
    with pytest.raises(ValueError, match="param is an inference tensor"):
        ops.adam_step(param, torch.ones(8), torch.zeros(8), torch.zeros(8), step=1, lr=0.1)
    assert torch.equal(param, before)


# ---- item 21: GradReducer.mark_ready validates before copying ----------------------------------------------

def _single_rank_comm():
    group = _construction.default_process_group(torch.device("cpu"))
    return _C.Comm(group)


def test_grad_reducer_rejects_a_duplicate_gradient_without_overwriting_the_first():
    comm = _single_rank_comm()
    if comm.world_size != 1:
        pytest.skip("needs the single-process default group")
    destination = torch.zeros(8)
    reducer = _C.GradReducer(comm, [8], [0, 0], [0, 4], [4, 4], [0], [destination], torch.float32, 1.0, False)
    reducer.begin_backward(False)
    first, second = torch.full((4,), 1.0), torch.full((4,), 2.0)
    reducer.mark_ready(0, first)
    with pytest.raises(RuntimeError, match="marked ready twice"):
        reducer.mark_ready(0, second)
    with pytest.raises(ValueError, match="has 3 elements, expected 4"):
        reducer.mark_ready(1, torch.ones(3))
    reducer.mark_ready(1, torch.full((4,), 3.0))
    reducer.finalize()
    assert destination.tolist() == [1.0] * 4 + [3.0] * 4


# ---- item 25: param groups ---------------------------------------------------------------------------------

def test_add_param_group_on_the_engine_optimizer_raises_naming_initialize_param_groups():
    model = _linear()
    engine = zerocore.initialize(model, _CONFIG)
    try:
        extra = nn.Parameter(torch.zeros(3))
        with pytest.raises(RuntimeError, match=r"zerocore\.initialize\(model, config, param_groups="):
            engine.optimizer.add_param_group({"params": [extra], "lr": 0.1})
        assert len(engine.optimizer.param_groups) == 1
    finally:
        engine.close()


def test_parameters_as_param_groups_are_one_group_as_torch_takes_them():
    """``param_groups=model.parameters()`` (torch's ``AdamW(model.parameters())``) is one group, as torch's
    optimizers and DeepSpeed's model_parameters read it, not a group per tensor; a mix is refused."""
    model = _linear()
    engine = zerocore.initialize(model, _CONFIG, param_groups=model.parameters())
    try:
        assert [len(g["params"]) for g in engine.optimizer.param_groups] == [4]
    finally:
        engine.close()
    with pytest.raises(TypeError, match="param_groups must be parameters .* or param-group dicts, not a mix"):
        zerocore.initialize(model, _CONFIG, param_groups=[model[0].weight, {"params": [model[0].bias]}])
    assert zerocore._gathered.engine_for(model[0].weight) is None  # nothing was taken over


@pytest.mark.parametrize("key,value,named", [
    ("lr", -1e-3, "param_groups[1].lr"),
    ("lr", math.nan, "param_groups[1].lr"),
    ("lr", math.inf, "param_groups[1].lr"),
    ("betas", (0.9, 1.0), "param_groups[1].betas[1]"),
    ("betas", (0.9,), "param_groups[1].betas"),
    ("eps", math.nan, "param_groups[1].eps"),
    ("eps", -1e-8, "param_groups[1].eps"),
    ("weight_decay", math.nan, "param_groups[1].weight_decay"),
    ("weight_decay", -0.1, "param_groups[1].weight_decay"),
    ("adamw_mode", "yes", "param_groups[1].adamw_mode"),
])
def test_bad_param_group_hyperparameters_are_rejected_at_initialize_naming_group_and_key(key, value, named):
    model = _linear()
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), key: value}]
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        zerocore.initialize(model, _CONFIG, param_groups=groups)
    assert zerocore._gathered.engine_for(model[0].weight) is None  # nothing was taken over


def test_named_parameters_are_taken_as_torchs_optimizers_take_them():
    """torch's optimizers take ``model.named_parameters()`` (since 2.6): the parameters in ``params``, their names
    in ``param_names``, those of frozen parameters left out with them."""
    model = _linear()
    model[0].bias.requires_grad_(False)
    engine = zerocore.initialize(model, _CONFIG, param_groups=model.named_parameters())
    try:
        (group,) = engine.optimizer.param_groups
        assert group["param_names"] == ["0.weight", "2.weight", "2.bias"] and len(group["params"]) == 3
    finally:
        engine.close()
    groups = [{"params": list(model[0].named_parameters()), "weight_decay": 0.0},
              {"params": model[2].named_parameters()}]
    engine = zerocore.initialize(model, _CONFIG, param_groups=groups)
    try:
        assert [g["param_names"] for g in engine.optimizer.param_groups] == [["weight"], ["weight", "bias"]]
    finally:
        engine.close()
    with pytest.raises(ValueError, match="should be with/without names"):  # torch's own rule
        zerocore.initialize(model, _CONFIG, param_groups=[{"params": list(model[0].named_parameters())},
                                                          {"params": list(model[2].parameters())}])
    assert zerocore._gathered.engine_for(model[0].weight) is None  # nothing was taken over


@pytest.mark.parametrize("key,meant", [("weight_deacy", "weight_decay"), ("beta1", "betas"), ("Lr", "lr"),
                                       ("bias_corection", "bias_correction"), ("adam_w_mode", "adamw_mode"),
                                       ("amsgard", "amsgrad")])
def test_a_misspelt_param_group_key_is_refused_naming_the_key_meant(key, meant):
    """A group's own keys are kept (torch and DeepSpeed keep them), but one that misspells a hyperparameter would
    leave that hyperparameter at its default: a silently different run."""
    model = _linear()
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), key: 0.5}]
    with pytest.raises(ValueError, match=rf"param_groups\[1\] has key '{key}': did you mean '{meant}'\?"):
        zerocore.initialize(model, _CONFIG, param_groups=groups)
    assert zerocore._gathered.engine_for(model[0].weight) is None  # nothing was taken over


def test_a_groups_own_keys_are_kept_and_torchs_decoupled_weight_decay_is_read():
    model = _linear()
    groups = [{"params": list(model[0].parameters()), "lr_scale": 0.1, "layer_id": 0, "initial_lr": 1e-3,
               "decoupled_weight_decay": False, "weight_decay": 0.1, "fused": None, "capturable": False},
              {"params": list(model[2].parameters()), "adamw_mode": False}]
    engine = zerocore.initialize(model, _CONFIG, param_groups=groups)
    try:
        first, second = engine.optimizer.param_groups
        assert (first["lr_scale"], first["layer_id"], first["initial_lr"]) == (0.1, 0, 1e-3)
        assert first["adamw_mode"] is False and second["adamw_mode"] is False  # torch's Adam: L2 weight decay
    finally:
        engine.close()
    with pytest.raises(ValueError, match=r"param_groups\[0\] has no 'params'"):
        zerocore.initialize(model, _CONFIG, param_groups=[{"lr": 1e-3}])


def test_check_group_hyperparameters_accepts_what_torch_accepts_and_changes_nothing():
    groups = [{"params": [], "lr": torch.tensor(1e-3), "betas": (0.0, 0.999), "eps": 0.0, "weight_decay": 0,
               "adamw_mode": False, "bias_correction": True, "name": "x"}]
    snapshot = [dict(g) for g in groups]
    _model_checks.check_group_hyperparameters(groups)
    assert groups == snapshot
    with pytest.raises(ValueError, match=r"optimizer\.param_groups\[0\]\.lr"):
        _model_checks.check_group_hyperparameters([{"lr": -1.0}], where="optimizer.param_groups")


def _drop_first_param(groups: list) -> None:
    groups[0]["params"].pop()


def _append_group(groups: list) -> None:
    groups.append({**groups[0], "params": []})


def _swap_groups(groups: list) -> None:
    groups.reverse()


@pytest.mark.parametrize("edit,named", [
    (lambda groups: groups[0].update(amsgrad=True), r"param_groups\[0\]\.amsgrad: zerocore's Adam has no amsgrad"),
    (lambda groups: groups[1].update(maximize=True), r"param_groups\[1\]\.maximize: .*negate the loss"),
    (lambda groups: groups[0].update(decoupled_weight_decay=False), r"param_groups\[0\]\.decoupled_weight_decay.*adamw_mode"),
    (_drop_first_param, r"param_groups\[0\]\['params'\] changed after zerocore\.initialize"),
    (_swap_groups, r"param_groups\[0\]\['params'\] changed after zerocore\.initialize"),
    (_append_group, r"holds 3 groups, but zerocore\.initialize laid out 2"),
])
def test_a_step_is_refused_when_param_groups_ask_for_what_it_would_not_do(edit, named):
    """torch's Adam reads amsgrad, maximize and decoupled_weight_decay from its groups, and a group's params
    say what it updates; the engine's step would ignore all of them (its shards are laid out at initialize),
    training otherwise than the groups say. The step refuses, changing nothing, and trains once undone.
    Keys a scheduler adds (initial_lr, OneCycleLR's max_lr, ...) and flags torch reads as false pass."""
    model = _linear()
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": 0.5}]
    engine = zerocore.initialize(model, _CONFIG, param_groups=groups)
    try:
        saved = [dict(g, params=list(g["params"])) for g in engine.optimizer.param_groups]
        x = torch.randn(4, 4)
        engine.backward(engine(x).square().mean())
        edit(engine.optimizer.param_groups)
        before = engine.full_state_dict()
        with pytest.raises(ValueError, match="the step was refused on every rank") as caught:
            engine.step()
        assert caught.match(named)
        after = engine.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        engine.optimizer.param_groups[:] = saved
        for group in engine.optimizer.param_groups:  # what torch's schedulers add; torch's falsy flags
            group.update(initial_lr=group["lr"], max_lr=1.0, amsgrad=False, maximize=0)
        engine.backward(engine(x).square().mean())
        engine.step()
        assert not all(torch.equal(after[k], v) for k, v in engine.full_state_dict().items())
    finally:
        engine.close()


# ---- item 26 -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                                 "stage3_max_live_parameters", "stage3_param_persistence_threshold"])
def test_bucket_sizes_beyond_int64_are_a_value_error_naming_the_key(key):
    zerocore.ZeroOptimizationConfig(**{key: 2**63 - 1})
    for value in (2**63, 2**64 + 5, 1e19):
        with pytest.raises(ValueError, match=f"zero_optimization.{key}"):
            zerocore.ZeroOptimizationConfig(**{key: value})


def test_check_launch_environment():
    check_launch_environment = _construction.check_launch_environment
    check_launch_environment({})
    check_launch_environment({"WORLD_SIZE": "1"})
    check_launch_environment({"RANK": "0"})
    check_launch_environment({"WORLD_SIZE": "4", "RANK": "3"})
    with pytest.raises(ValueError, match="RANK"):
        check_launch_environment({"WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        check_launch_environment({"RANK": "1"})
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        check_launch_environment({"WORLD_SIZE": "two", "RANK": "0"})
    with pytest.raises(ValueError, match="RANK=4"):
        check_launch_environment({"WORLD_SIZE": "4", "RANK": "4"})


def test_world_size_without_rank_raises_instead_of_running_single_process():
    script = textwrap.dedent("""
        import torch, zerocore
        from torch import nn
        try:
            zerocore.initialize(nn.Linear(2, 2), {"zero_optimization": {"stage": 1}})
        except ValueError as e:
            print("RAISED:", e)
        else:
            print("RAN SINGLE-PROCESS")
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["WORLD_SIZE"] = "2"
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240,
                            check=False)
    assert "RAISED:" in result.stdout, result.stdout + result.stderr
    assert "RANK" in result.stdout.split("RAISED:", 1)[1]


def test_flat_layout_shard_range_rejects_out_of_range_bucket_and_rank():
    layout = zerocore.FlatLayout([5, 7, 3], world_size=2, alignment=2, bucket_cap=6)
    last = layout.num_buckets - 1
    assert layout.shard_range(last, 1) == (layout.buckets[last].flat_start + layout.buckets[last].shard_size,
                                           layout.buckets[last].flat_start + 2 * layout.buckets[last].shard_size)
    for bucket in (-1, -layout.num_buckets, layout.num_buckets):
        with pytest.raises(IndexError, match=f"bucket must be in \\[0, {layout.num_buckets}\\), got {bucket}"):
            layout.shard_range(bucket, 0)
    for rank in (-1, 2):
        with pytest.raises(ValueError, match="rank"):
            layout.shard_range(0, rank)
    for bad in (0.5, True, "0"):
        with pytest.raises(ValueError, match="must be an int"):
            layout.shard_range(0, bad)
        with pytest.raises(ValueError, match="must be an int"):
            layout.shard_range(bad, 0)


def test_binary_config_file_raises_a_value_error_naming_the_file(tmp_path):
    path = tmp_path / "ds_config.bin"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="ds_config.bin") as info:
        zerocore.ZeroConfig.from_deepspeed(path)
    assert not isinstance(info.value, UnicodeDecodeError)


_NON_FINITE = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("key", ["lr", "grad_scale", "eps", "weight_decay"])
@pytest.mark.parametrize("value", _NON_FINITE)
def test_adam_step_rejects_non_finite_hyperparameters_before_writing(key, value):
    param, grad, exp_avg, exp_avg_sq = _adam_args()
    before = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    kwargs = {"lr": 0.1, key: value}
    with pytest.raises(ValueError, match=key):
        ops.adam_step(param, grad, exp_avg, exp_avg_sq, step=1, **kwargs)
    with pytest.raises(ValueError, match=key):
        ops.multi_tensor_adam_step([param], [grad], [exp_avg], [exp_avg_sq], step=1, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(before, (param, exp_avg, exp_avg_sq)))
    assert param._version == 0


@given(lr=st.floats(allow_nan=True, allow_infinity=True), grad_scale=st.floats(allow_nan=True, allow_infinity=True))
def test_adam_step_accepts_exactly_finite_lr_and_grad_scale(lr, grad_scale):
    param, grad, exp_avg, exp_avg_sq = _adam_args(4)
    valid = math.isfinite(lr) and lr >= 0 and math.isfinite(grad_scale)
    try:
        ops.adam_step(param, grad, exp_avg, exp_avg_sq, step=1, lr=lr, grad_scale=grad_scale)
    except ValueError as e:
        assert not valid, e
        assert "lr" in str(e) or "grad_scale" in str(e)
    else:
        assert valid


def test_adam_op_names_a_negated_view_instead_of_a_torch_internal_assert():
    param, grad, exp_avg, exp_avg_sq = _adam_args()
    with pytest.raises(ValueError, match="param is a lazily negated view"):
        ops.adam_step(torch._neg_view(param), grad, exp_avg, exp_avg_sq, step=1, lr=0.1)
    with pytest.raises(ValueError, match="grad is a lazily negated view"):
        ops.adam_step(param, torch._neg_view(grad), exp_avg, exp_avg_sq, step=1, lr=0.1)
    with pytest.raises(ValueError, match="params\\[0\\] must not be a lazily negated"):
        ops.multi_tensor_adam_step([torch._neg_view(param)], [grad], [exp_avg], [exp_avg_sq], step=1, lr=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_adam_updates_a_negated_view_parameter_like_an_ordinary_one(dtype):
    torch.manual_seed(0)
    values = torch.randn(3, 4, dtype=dtype)
    negated = nn.Parameter(torch._neg_view(values.neg()))
    plain = nn.Parameter(values.clone())
    assert negated.is_neg() and torch.equal(negated, plain)
    opt_neg, opt_plain = CPUAdam([negated], lr=0.1), CPUAdam([plain], lr=0.1)
    for _ in range(3):
        x = torch.randn(2, 4, dtype=dtype)
        for p, opt in ((negated, opt_neg), (plain, opt_plain)):
            p.grad = None
            (x @ p.t()).square().sum().backward()
            opt.step()
    assert torch.equal(negated, plain)


def test_engine_trains_a_negated_view_parameter():
    torch.manual_seed(0)
    model = _linear()
    model[0].weight = nn.Parameter(torch._neg_view(model[0].weight.detach().neg()))
    reference = model[0].weight.detach().clone()
    engine = zerocore.initialize(model, _CONFIG)
    try:
        loss = engine(torch.randn(3, 4)).square().sum()
        engine.backward(loss)
        engine.step()
        with zerocore.gathered(list(model.parameters())):
            assert not torch.equal(model[0].weight.detach(), reference)
            assert torch.isfinite(model[0].weight).all()
    finally:
        engine.close()


@pytest.mark.parametrize("modifier_rank", [0.5, 0.0, "0", True])
def test_gathered_rejects_a_modifier_rank_that_is_not_an_int(modifier_rank):
    model = _linear()
    engine = zerocore.initialize(model, _CONFIG)
    try:
        with pytest.raises(TypeError, match="modifier_rank"), \
                zerocore.gathered(list(model.parameters()), modifier_rank=modifier_rank):
            pass
        with zerocore.gathered(list(model.parameters()), modifier_rank=0):
            pass
    finally:
        engine.close()


def test_ready_tracker_validates_sizes_before_allocating():
    # Before: std::length_error, or an attempt to allocate 8 bytes per claimed bucket.
    with pytest.raises(ValueError, match="num_buckets must be >= 0, got -1"):
        _C.ReadyTracker([0], -1, [])
    with pytest.raises(ValueError, match="launch_order must list all 35184372088832 buckets"):
        _C.ReadyTracker([], 2**45, [])
    with pytest.raises(ValueError, match=r"param_bucket\[0\]"):
        _C.ReadyTracker([2**45], 2, [0, 1])


@given(
    param_bucket=st.lists(st.integers(-(2**62), 2**62), max_size=6),
    num_buckets=st.one_of(st.integers(-(2**62), 2**62), st.integers(-3, 6)),
    launch_order=st.lists(st.integers(-2, 8), max_size=8),
)
def test_ready_tracker_construction_is_a_value_error_or_a_valid_tracker(param_bucket, num_buckets, launch_order):
    try:
        tracker = _C.ReadyTracker(param_bucket, num_buckets, launch_order)
    except ValueError as e:
        assert any(name in str(e) for name in ("num_buckets", "launch_order", "param_bucket")), e
        return
    assert sorted(launch_order) == list(range(num_buckets))
    assert all(0 <= b < num_buckets for b in param_bucket)
    launched = [b for p in range(len(param_bucket)) for b in tracker.mark_ready(p)]
    rest, unmarked = tracker.finalize()
    assert launched + rest == launch_order and unmarked == []


# ---- the low-level API's plain arguments (zerocore._arguments) ---------------------------------------------

_X = torch.randn(64)


@pytest.mark.parametrize("call, named", [
    (lambda: ops.quantize(_X, 8.0), "bits"),
    (lambda: ops.quantize(_X, True), "bits"),
    (lambda: ops.quantize(_X, 8, 2.5), "group_size"),
    (lambda: ops.dequantize(*ops.quantize(_X, 8, 4), 64.0, 8, 4), "numel"),
    (lambda: ops.dequantize(*ops.quantize(_X, 4, 4), 64, 4, False), "group_size"),
    (lambda: ops.set_num_threads(2.5), "num_threads"),
    (lambda: ops.set_num_threads(10**9), "num_threads"),
    (lambda: ops.adam_step(*_adam_args(), step=True, lr=1e-3), "step"),
    (lambda: ops.multi_tensor_adam_step(*([t] for t in _adam_args()), step=True, lr=1e-3), "step"),
    (lambda: zerocore.layout.FlatLayout([3, 2], 2.0, 1, 8), "world_size"),
    (lambda: zerocore.layout.FlatLayout([3, 2], 2, True, 8), "alignment"),
    (lambda: zerocore.layout.FlatLayout([3, 2], 2, 1, 8.5), "bucket_cap"),
    (lambda: zerocore.layout.FlatLayout(None, 2, 1, 8), "sizes"),
    (lambda: zerocore.layout.FlatLayout([3, 2], 2, 1, 8).pieces(0.0), "rank"),
])
def test_a_float_or_bool_where_an_int_belongs_is_refused_by_name_not_truncated(call, named):
    before = ops.get_num_threads()
    with pytest.raises(ValueError, match=rf"\b{named} must be"):
        call()
    assert ops.get_num_threads() == before


@pytest.mark.parametrize("call, named", [
    (lambda: ops.quantize(None), "x"),
    (lambda: ops.dequantize(None, torch.ones(1), 4, 8, 4), "q"),
    (lambda: ops.dequantize(torch.zeros(4, dtype=torch.int8), None, 4, 8, 4), "scales"),
    (lambda: ops.dequantize(*ops.quantize(_X, 8, 4), 64, 8, 4, out=[0.0] * 64), "out"),
    (lambda: ops.all_finite(None), "grad"),
    (lambda: ops.multi_tensor_all_finite([_X, None]), r"grads\[1\]"),
    (lambda: ops.multi_tensor_all_finite(_X), "grads"),
    (lambda: ops.adam_step(None, *_adam_args()[1:], step=1, lr=1e-3), "param"),
    (lambda: ops.adam_step(*_adam_args(), step=1, lr=1e-3, param_out=[0]), "param_out"),
    (lambda: ops.multi_tensor_adam_step([_X.clone()], [None], [torch.zeros(64)], [torch.zeros(64)], step=1, lr=1e-3),
     r"grads\[0\]"),
    (lambda: ops.multi_tensor_adam_step([_X.clone()], [_X], [torch.zeros(64)], [torch.zeros(64)], step=1, lr=1e-3,
                                        param_outs=["x"]), r"param_outs\[0\]"),
])
def test_none_or_a_non_tensor_where_a_tensor_belongs_is_a_type_error_naming_it(call, named):
    with pytest.raises(TypeError, match=rf"^{named} must be"):
        call()


def test_integer_like_arguments_are_accepted():
    q, scales = ops.quantize(_X, torch.tensor(8), torch.tensor(16))
    assert torch.equal(ops.dequantize(q, scales, torch.tensor(64), 8, 16), ops.dequantize(q, scales, 64, 8, 16))
    layout = zerocore.layout.FlatLayout(torch.tensor([3, 2]), torch.tensor(2), 1, 8)
    assert layout.world_size == 2 and layout.shard_range(torch.tensor(0), 1) == layout.shard_range(0, 1)


@pytest.mark.parametrize("call, message", [
    (lambda t: ops.all_finite(t), "grad is on the meta device, which holds no values"),
    (lambda t: ops.multi_tensor_all_finite([t]), "must be on the CPU or a CUDA device, got meta"),
])
def test_a_finiteness_check_of_a_meta_tensor_is_a_value_error(call, message):
    # a meta tensor has no values: an error naming the device, not torch's "item() on meta tensors"
    with pytest.raises(ValueError, match=message):
        call(torch.empty(3, device="meta"))


def test_a_cpu_model_on_a_machine_with_cuda_is_named_not_trained_there_silently(monkeypatch):
    """DDP and the engine train where the model is; a script from FSDP2 or DeepSpeed (which move it to the GPU)
    would run on the CPU unnoticed. The warning names the user's line and the move to make."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = nn.Linear(4, 4)
    with pytest.warns(UserWarning, match=r"the model is on the CPU.*model\.cuda\(\)") as caught:
        engine = zerocore.initialize(model, {"zero_optimization": {"stage": 1},
                                             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    engine.close()
    assert [w.filename for w in caught if "on the CPU" in str(w.message)] == [__file__]
