"""DeepSpeed's per-parameter accessors (``safe_get_full_grad``, ``safe_get_full_fp32_param``,
``safe_get_full_optimizer_state`` and their setters): one parameter's sharded state assembled whole on every
rank, and written back (Note [Full parameter state] in _full_param_state.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zerocore
from _dist import run_ranks
from test_stage3 import Zoo, data, loss_of

pytestmark = pytest.mark.timeout(300)

BETA1, BETA2 = 0.9, 0.999


def _config(stage: int, dtype: str, offload: str | None = None, path: str | None = None, **zero) -> dict:
    config = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "betas": [BETA1, BETA2]}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 500,
                                    "stage3_param_persistence_threshold": 0, **zero}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if offload == "cpu":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    elif offload in ("nvme", "nvme+params"):
        config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
        config["zero_optimization"]["sub_group_size"] = 37
        config["aio"] = {"block_size": 4096, "queue_depth": 4, "thread_count": 2}
        if offload == "nvme+params":
            config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": path, "max_in_cpu": 0}
    return config


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = Zoo()  # a block called twice, a tied embedding and head
    model.unused = nn.Parameter(torch.randn(7))  # never reaches the loss: no gradient unless one is set
    return model


def _reference_grads(model: nn.Module, world: int, step: int) -> dict[str, torch.Tensor]:
    """The data-parallel gradient of the first step: the mean of every rank's loss."""
    model.zero_grad()
    (sum(loss_of(model, *data(step, r)) for r in range(world)) / world).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def accessors_worker(rank: int, world: int, stage: int, dtype: str, offload: str | None, path: str | None,
                     zero: dict | None = None) -> dict:
    model = _model()
    reference = copy.deepcopy(model)
    engine = zerocore.initialize(model, _config(stage, dtype, offload, path, **(zero or {})))
    names = [name for name, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    seen: dict = {"grads": {}, "masters": {}, "exp_avg": {}, "exp_avg_sq": {}}

    # the first step: every gradient against the fp32 reference's, then the moments Adam built from it
    engine.backward(loss_of(engine, *data(0, rank)))
    grads = {name: zerocore.safe_get_full_grad(params[name]) for name in names}
    compute = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    expected = _reference_grads(reference.to(compute), world, 0)  # the same model in the compute dtype
    seen["unused_grad"] = grads["unused"].abs().max().item()
    for name in names:
        if name in expected:
            # the ranks' gradients summed in another order (and 16-bit ones rounded once more): judged over the
            # whole tensor, as one dropped or doubled contribution moves it by 50% or more
            tolerance = {"fp32": 1e-6, "bf16": 1e-2, "fp16": 2e-3}[dtype]
            if zero and zero.get("zero_quantized_gradients"):
                tolerance = 0.5  # reduced as int4 (16 levels per group): what the step uses is checked below
            distance = float((grads[name] - expected[name].float()).norm() / expected[name].float().norm())
            assert distance < tolerance, (name, distance)
        assert grads[name].dtype == torch.float32 and grads[name].shape == params[name].shape
    engine.step()
    for name in names:
        if name == "unused":
            continue  # no gradient on any rank: the step leaves it alone
        # what the step used is what the getter returned: m = (1 - b1) g, v = (1 - b2) g^2
        torch.testing.assert_close(zerocore.safe_get_full_optimizer_state(params[name], "exp_avg"),
                                   (1 - BETA1) * grads[name], rtol=1e-6, atol=1e-12, msg=name)
        torch.testing.assert_close(zerocore.safe_get_full_optimizer_state(params[name], "exp_avg_sq"),
                                   (1 - BETA2) * grads[name] * grads[name], rtol=1e-5, atol=1e-20, msg=name)

    # two more steps, then the masters against the parameters the model holds
    for step in (1, 2):
        engine.backward(loss_of(engine, *data(step, rank)))
        if step == 2:
            seen["grads"] = {name: zerocore.safe_get_full_grad(params[name]) for name in names}
        engine.step()
    whole = engine.full_state_dict(rank0_only=False)
    for name in names:
        master = zerocore.safe_get_full_fp32_param(params[name])
        seen["masters"][name] = master
        assert torch.equal(master.to(whole[name].dtype), whole[name]), name  # the parameter is its rounding
        for key in ("exp_avg", "exp_avg_sq"):
            seen[key][name] = zerocore.safe_get_full_optimizer_state(params[name], key)

    if offload in ("nvme", "nvme+params"):  # one parameter's state costs its own sub-groups' reads, not its shard's
        before = engine.memory_report()["nvme"]["bytes_read"]
        zerocore.safe_get_full_optimizer_state(params["blocks.0.linear.bias"], "exp_avg")
        seen["nvme_bytes_for_a_bias"] = engine.memory_report()["nvme"]["bytes_read"] - before

    # setters: the fp32 bits come back exactly (-0.0 too), and the parameter holds their rounding
    g = torch.Generator().manual_seed(5)
    value = torch.randn(params["blocks.1.linear.weight"].shape, generator=g) * (1 + 2**-20)
    value.view(-1)[0] = -0.0
    zerocore.safe_set_full_fp32_param(params["blocks.1.linear.weight"], value)
    back = zerocore.safe_get_full_fp32_param(params["blocks.1.linear.weight"])
    seen["set_master_exact"] = torch.equal(back.view(torch.int32), value.view(torch.int32))
    whole = engine.full_state_dict(rank0_only=False)
    seen["set_param_rounded"] = torch.equal(whole["blocks.1.linear.weight"], value.to(whole["embed.weight"].dtype))
    # the root's tied embedding: at stage 3 its unit stays gathered between steps, so the gathered copy follows
    embedding = params["embed.weight"].detach().float().clone() if stage < 3 else whole["embed.weight"].float()
    embedding[0] += 0.5
    zerocore.safe_set_full_fp32_param(params["embed.weight"], embedding)
    with torch.no_grad():  # the next forward computes with the values set: as a plain model loaded from them
        plain = copy.deepcopy(reference)
        plain.load_state_dict(engine.full_state_dict(rank0_only=False))
        tokens = data(4, rank)[0]
        same = torch.equal(engine(tokens), plain(tokens))
        seen["forward_sees_sets"] = same or bool(zero and zero.get("zero_quantized_weights"))  # (qwZ: int8)
    moments = {key: torch.rand(params["embed.weight"].shape, generator=g) for key in ("exp_avg", "exp_avg_sq")}
    for key, moment in moments.items():
        zerocore.safe_set_full_optimizer_state(params["embed.weight"], moment, key)
    seen["set_moments_exact"] = all(
        torch.equal(zerocore.safe_get_full_optimizer_state(params["embed.weight"], key), moment)
        for key, moment in moments.items())

    # a gradient set by hand is the one the step applies: to a parameter with one, and to one without any
    engine.backward(loss_of(engine, *data(3, rank)))
    grad = torch.randn(params["embed.weight"].shape, generator=g) * 1e-2
    zerocore.safe_set_full_grad(params["embed.weight"], grad)
    stored = zerocore.safe_get_full_grad(params["embed.weight"])
    seen["set_grad_close"] = torch.allclose(stored, grad, rtol=1e-2 if dtype != "fp32" else 0, atol=0)
    unused_before = zerocore.safe_get_full_fp32_param(params["unused"])
    zerocore.safe_set_full_grad(params["unused"], torch.ones(7))
    engine.step()
    torch.testing.assert_close(zerocore.safe_get_full_optimizer_state(params["embed.weight"], "exp_avg"),
                               BETA1 * moments["exp_avg"] + (1 - BETA1) * stored, rtol=1e-6, atol=1e-9)
    unused_after = zerocore.safe_get_full_fp32_param(params["unused"])
    # its first update: lr * (m^ / (sqrt(v^) + eps)) = lr * 1 (and weight decay), so every element moved by ~lr
    seen["unused_moved"] = (unused_before - unused_after).tolist()
    seen["forward_after_sets"] = loss_of(engine, *data(4, rank)).item()  # trains on: the model is consistent
    engine.close()
    for key in ("grads", "masters", "exp_avg", "exp_avg_sq"):  # plain lists: tensors would cross through shm
        seen[key] = {name: tensor.tolist() for name, tensor in seen[key].items()}
    return seen


@pytest.mark.parametrize("stage,dtype", [(1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16"), (2, "bf16"),
                                         (3, "bf16"), (2, "fp16")])
def test_full_state_of_every_parameter_is_what_the_step_uses(stage, dtype):
    results = run_ranks(accessors_worker, 2, stage, dtype, None, None)
    for seen in results:
        assert seen["unused_grad"] == 0.0
        assert seen["set_master_exact"] and seen["set_param_rounded"] and seen["set_moments_exact"], seen
        assert seen["set_grad_close"] and seen["forward_sees_sets"], seen
        assert all(0.9e-2 < moved < 1.1e-2 for moved in seen["unused_moved"]), seen["unused_moved"]
    for key in ("grads", "masters", "exp_avg", "exp_avg_sq"):  # every rank got the same whole tensors
        for name, tensor in results[0][key].items():
            assert tensor == results[1][key][name], (key, name)


@pytest.mark.parametrize("stage,dtype,offload", [(2, "bf16", "cpu"), (2, "bf16", "nvme"), (3, "fp32", "nvme"),
                                                 (3, "bf16", "nvme+params"), (1, "fp32", "cpu")])
def test_offloaded_state_reads_the_same_as_in_memory(stage, dtype, offload, tmp_path):
    in_memory = run_ranks(accessors_worker, 2, stage, dtype, None, None)[0]
    ranks = run_ranks(accessors_worker, 2, stage, dtype, offload, str(tmp_path))
    offloaded = ranks[0]
    for key in ("grads", "masters", "exp_avg", "exp_avg_sq"):
        for name, tensor in in_memory[key].items():
            assert tensor == offloaded[key][name], (key, name)
    assert offloaded["set_master_exact"] and offloaded["set_moments_exact"] and offloaded["set_param_rounded"]
    if "nvme" in offload:  # 16 elements in sub-groups of 37: at most two sub-groups of three 4 KiB states
        read = sum(seen["nvme_bytes_for_a_bias"] for seen in ranks)  # (the ranks whose shards hold it read)
        assert 0 < read <= 2 * 3 * 4096, read


def test_world_three_splits_parameters_across_ranks():
    results = run_ranks(accessors_worker, 3, 3, "fp32", None, None)
    for name, tensor in results[0]["masters"].items():
        assert all(tensor == seen["masters"][name] for seen in results[1:]), name


def test_zero_plus_plus_gradients_and_sets_reach_every_node():
    """qwZ, hpZ and qgZ at world 4, two "nodes" of two: the gradients qgZ reduced are the ones returned and
    used, and a master set between steps is what every rank's gathers see."""
    zeropp = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True,
              "zero_node_size": 2}
    results = run_ranks(accessors_worker, 4, 3, "bf16", None, None, zeropp, timeout=240)
    for seen in results:
        assert seen["set_master_exact"] and seen["set_param_rounded"] and seen["set_moments_exact"], seen
        assert seen["forward_sees_sets"]
    for name, tensor in results[0]["masters"].items():
        assert all(tensor == seen["masters"][name] for seen in results[1:]), name


def refusals_worker(rank: int, world: int, stage: int) -> dict:
    model = _model()
    model.embed.weight.requires_grad_(False)  # frozen (and tied to the head)
    engine = zerocore.initialize(model, {**_config(stage, "bf16"), "gradient_accumulation_steps": 2})
    params = dict(model.named_parameters())
    weight, bias = params["blocks.0.linear.weight"], params["blocks.0.linear.bias"]
    seen: dict = {}

    def error_of(call) -> str:
        try:
            call()
        except (RuntimeError, ValueError, TypeError) as error:
            return f"{type(error).__name__}: {error}"
        return "no error"

    before = zerocore.safe_get_full_fp32_param(weight)
    seen["frozen_get"] = (zerocore.safe_get_full_fp32_param(params["embed.weight"]) is None,
                          zerocore.safe_get_full_optimizer_state(params["embed.weight"], "exp_avg") is None)
    seen["frozen_set"] = error_of(lambda: zerocore.safe_set_full_fp32_param(params["embed.weight"],
                                                                           torch.zeros(params["embed.weight"].shape)))
    seen["bad_key"] = error_of(lambda: zerocore.safe_get_full_optimizer_state(weight, "momentum"))
    seen["unmanaged"] = error_of(lambda: zerocore.safe_get_full_grad(nn.Parameter(torch.zeros(3))))
    seen["no_backward_yet"] = error_of(lambda: zerocore.safe_get_full_grad(weight))
    # ranks asking for different parameters: every rank raises, and the next call pairs up again
    seen["different"] = error_of(lambda: zerocore.safe_get_full_fp32_param(weight if rank == 0 else bias))
    # a wrong shape on one rank: refused on every rank, nothing changed
    bad = torch.zeros(weight.shape if rank == 0 else (1,))
    seen["one_bad_shape"] = error_of(lambda: zerocore.safe_set_full_fp32_param(weight, bad))
    seen["unchanged"] = torch.equal(zerocore.safe_get_full_fp32_param(weight), before)
    # mid-window (gradient_accumulation_steps 2) a rank holds a partial sum: refused
    engine.backward(loss_of(engine, *data(0, rank)))
    seen["mid_window"] = error_of(lambda: zerocore.safe_get_full_grad(weight))
    engine.step()
    loss = loss_of(engine, *data(1, rank))
    seen["between_forward_and_backward"] = error_of(lambda: zerocore.safe_set_full_fp32_param(weight, before))
    engine.backward(loss)
    seen["boundary_grad_shape"] = (list(zerocore.safe_get_full_grad(weight).shape), list(weight.shape))
    engine.step()
    seen["after_step"] = error_of(lambda: zerocore.safe_get_full_grad(weight))
    with zerocore.gathered([weight]):
        seen["inside_gathered"] = error_of(lambda: zerocore.safe_set_full_fp32_param(weight, before))
    seen["trains_on"] = loss_of(engine, *data(2, rank)).item()
    engine.close()
    seen["after_close"] = error_of(lambda: zerocore.safe_get_full_fp32_param(weight))
    return seen


@pytest.mark.parametrize("stage", [2, 3])
def test_misuse_is_refused_on_every_rank_and_nothing_changes(stage):
    for rank, seen in enumerate(run_ranks(refusals_worker, 2, stage)):
        assert seen["frozen_get"] == (True, True)
        assert "frozen" in seen["frozen_set"] and "nothing was changed" in seen["frozen_set"]
        assert seen["bad_key"].startswith("ValueError") and "'momentum'" in seen["bad_key"]
        assert seen["unmanaged"].startswith("ValueError") and "no live zerocore engine" in seen["unmanaged"]
        assert "between the accumulation boundary's engine.backward() and engine.step()" in seen["no_backward_yet"]
        assert "different" in seen["different"] and "'blocks.0.linear.weight'" in seen["different"] \
            and "'blocks.0.linear.bias'" in seen["different"], seen["different"]
        assert ("shape [1]" in seen["one_bad_shape"]) if rank == 1 else ("rank(s) [1]" in seen["one_bad_shape"])
        assert seen["unchanged"]
        assert "mid-window" in seen["mid_window"], seen["mid_window"]
        assert "between a forward and its backward" in seen["between_forward_and_backward"]
        assert seen["boundary_grad_shape"][0] == seen["boundary_grad_shape"][1]
        assert "between the accumulation boundary's" in seen["after_step"]
        assert "inside a zerocore.gathered() block" in seen["inside_gathered"]
        assert seen["after_close"].startswith("ValueError")


def vectorized_worker(rank: int, world: int, stage: int) -> list[str]:
    model = _model()
    model.blocks[2].norm.weight.requires_grad_(False)  # frozen: skipped
    engine = zerocore.initialize(model, _config(stage, "bf16"))
    engine.backward(loss_of(engine, *data(0, rank)))
    params = list(model.parameters())
    before = {id(p): zerocore.safe_get_full_grad(p) for p in params if p.requires_grad}
    seen_params = []

    def update(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        seen_params.append(param)
        return grad * 2 + param.dim()

    zerocore.safe_update_full_grad_vectorized(params, update)
    differ = [str(p.shape) for p in params if p.requires_grad
              and not torch.equal(zerocore.safe_get_full_grad(p), (before[id(p)] * 2 + p.dim()).bfloat16().float())]
    called = [p is q for p, q in zip(seen_params, [p for p in params if p.requires_grad])]
    engine.step()
    engine.close()
    return differ + ([] if len(called) == len(before) and all(called) else ["update_func calls"])


@pytest.mark.parametrize("stage", [2, 3])
def test_update_full_grad_vectorized_rewrites_every_trainable_gradient(stage):
    """DeepSpeed's safe_update_full_grad_vectorized: update_func(grad, param) for each trainable parameter in
    order, its result the gradient the step applies (stored in bf16, the gradients' dtype)."""
    for differ in run_ranks(vectorized_worker, 2, stage):
        assert differ == []
