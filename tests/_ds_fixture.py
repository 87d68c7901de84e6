"""The model, data and configurations of the DeepSpeed checkpoint fixtures (tests/fixtures/deepspeed): shared
by the script that writes them with DeepSpeed and the tests that load them into zerocore."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from _models import build

_ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}}
_WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}}

# fp16 with a dynamic scale whose first step overflows (its loss boosted 1e4x): the step is skipped and one
# hysteresis spent. The scale does not grow at the resumed run's first step (it would at the next): on a step
# where it grows, DeepSpeed 0.19.8 unscales the gradients by the new scale, so that step's update is computed
# from half the gradient (measured here: its exp_avg took 0.5 g; deepspeedai/DeepSpeed#8588 describes the
# ordering), which zerocore does not copy
_FP16 = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 3, "hysteresis": 2}

# name -> the DeepSpeed config's sections, whether the parameters are split in two groups (no weight decay
# on the one-element scale and the biases), and by what factor a training step's loss is multiplied
CASES: dict[str, dict] = {
    "stage1-fp32": {"deepspeed": {"optimizer": _ADAMW, "zero_optimization": {"stage": 1}}, "groups": False},
    "stage2-bf16-groups-warmup": {"deepspeed": {"optimizer": _ADAMW, "bf16": {"enabled": True}, "scheduler": _WARMUP,
                                                "zero_optimization": {"stage": 2}}, "groups": True},
    "stage2-bf16-offload": {"deepspeed": {"optimizer": _ADAMW, "bf16": {"enabled": True}, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}}, "groups": False},
    "stage3-bf16": {"deepspeed": {"optimizer": _ADAMW, "bf16": {"enabled": True},
                                  "zero_optimization": {"stage": 3, "sub_group_size": 100}}, "groups": True},
    "stage3-fp32": {"deepspeed": {"optimizer": _ADAMW, "zero_optimization": {"stage": 3}}, "groups": False},
    # bf16 with fp32 gradient accumulation at stage 1: DeepSpeed's BF16_Optimizer (Megatron-DeepSpeed's configs)
    "stage1-bf16-fp32-accum": {"deepspeed": {"optimizer": _ADAMW, "bf16": {"enabled": True},
                                             "data_types": {"grad_accum_dtype": "fp32"},
                                             "zero_optimization": {"stage": 1}}, "groups": True},
    # saved as PEFT/LoRA runs save: without the frozen parameters
    "stage3-bf16-no-frozen": {"deepspeed": {"optimizer": _ADAMW, "bf16": {"enabled": True},
                                            "zero_optimization": {"stage": 3}}, "groups": False,
                              "save": {"exclude_frozen_parameters": True}},
    # stage 0: the optimizer's state in the model state file, by position (FusedAdam's own at fp32, DeepSpeed's
    # FP16_Optimizer's flat fp32 groups at bf16), the parameter groups split in two
    "stage0-fp32": {"deepspeed": {"optimizer": _ADAMW, "zero_optimization": {"stage": 0}}, "groups": True},
    "stage0-bf16": {"deepspeed": {"optimizer": _ADAMW, "bf16": {"enabled": True}, "scheduler": _WARMUP,
                                  "zero_optimization": {"stage": 0}}, "groups": True},
    # DeepSpeed's default model_parameters (every parameter, the frozen ones too: FusedAdam keeps their positions)
    "stage0-fp32-every-param": {"deepspeed": {"optimizer": _ADAMW, "zero_optimization": {"stage": 0}},
                                "groups": False, "model_parameters": "default"},
    # (a boost that overflows the gradients of a stage-0 run too). DeepSpeed 0.19.8's engine.backward leaves a
    # stage-0 fp16 loss unscaled and its FP16_Optimizer divides the gradients by the scale all the same
    # (deepspeedai/DeepSpeed#8393): its moments and its next update come from gradients / scale
    "stage0-fp16-overflow": {"deepspeed": {"optimizer": _ADAMW, "fp16": _FP16, "zero_optimization": {"stage": 0}},
                             "groups": False, "boost": {0: 1e35}, "gradients_over_scale": True},
    # the same at stage 2, whose module state still holds the tied head.weight beside the trainable embed.weight
    "stage2-bf16-no-frozen": {"deepspeed": {"optimizer": _ADAMW, "bf16": {"enabled": True},
                                            "zero_optimization": {"stage": 2}}, "groups": False,
                              "save": {"exclude_frozen_parameters": True}},
    # LLaMA-Factory's ds_z2_config.json: round_robin_gradients reorders each group's flat partitions (and
    # param_shapes says so). DeepSpeed 0.19.8's fragment addresses (safe_get_full_*, ds_to_universal's slices)
    # follow the unordered groups when no alignment padding lies between parameters, so they point at another
    # parameter's elements; what the run holds is read from its flat partitions instead
    "stage2-bf16-round-robin": {"deepspeed": {"optimizer": _ADAMW, "bf16": {"enabled": True}, "zero_optimization": {
        "stage": 2, "round_robin_gradients": True, "overlap_comm": False, "allgather_bucket_size": 5e8,
        "reduce_bucket_size": 5e8, "contiguous_gradients": True}}, "groups": True, "read_flat_partitions": True},
    "stage2-fp16-overflow": {"deepspeed": {"optimizer": _ADAMW, "fp16": _FP16, "zero_optimization": {"stage": 2}},
                             "groups": False, "boost": {0: 1e4}},
    "stage3-fp16-overflow": {"deepspeed": {"optimizer": _ADAMW, "fp16": _FP16, "zero_optimization": {"stage": 3}},
                             "groups": True, "boost": {0: 1e4}},
    # written by 3 ranks (the others by 2): other partition boundaries and alignment padding in DeepSpeed's files
    "stage2-bf16-world3": {"deepspeed": {"optimizer": _ADAMW, "bf16": {"enabled": True}, "scheduler": _WARMUP,
                                         "zero_optimization": {"stage": 2}}, "groups": True, "world": 3},
    "stage3-fp32-world3": {"deepspeed": {"optimizer": _ADAMW, "zero_optimization": {"stage": 3, "sub_group_size": 100}},
                           "groups": True, "world": 3},
}


def build_fixture_model() -> nn.Module:
    model = build("odd")  # tied embedding/head, a frozen layer, an unused layer, a one-element parameter
    model.register_buffer("seen", torch.zeros(3))
    return model


def param_groups(model: nn.Module, case: dict) -> list[dict] | list[nn.Parameter]:
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not case["groups"]:
        return [p for _, p in trainable]
    plain = [p for n, p in trainable if p.dim() < 2]
    return [{"params": [p for n, p in trainable if p.dim() >= 2]}, {"params": plain, "weight_decay": 0.0}]


def fixture_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 20, (4, 6), generator=g), torch.randint(0, 20, (4, 6), generator=g)


def fixture_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.float().reshape(-1, output.shape[-1]), target.reshape(-1))


def run_fixture_script(deepspeed: Any, name: str, rank: int) -> tuple[Any, nn.Module]:
    """The training make_fixtures.py ran under DeepSpeed for case ``name``: three steps on this rank's batches,
    through ``deepspeed.initialize`` of the module given (DeepSpeed's own, or ``zerocore.deepspeed``); returns the
    engine and the model."""
    case = CASES[name]
    model = build_fixture_model()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              **case["deepspeed"]}
    given = None if case.get("model_parameters") == "default" else param_groups(model, case)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=given, config=config)
    for step in range(3):
        tokens, target = fixture_batch(step, rank)
        engine.backward(fixture_loss(engine(tokens), target) * case.get("boost", {}).get(step, 1.0))
        engine.step()
        model.seen += 1  # a buffer the checkpoint carries
    return engine, model


def states_differing(model: nn.Module, expected: dict[str, torch.Tensor]) -> list[str]:
    """The ``master/<name>``, ``exp_avg/<name>`` and ``exp_avg_sq/<name>`` of the trainable parameters that are
    not exactly ``expected``'s as the engine holds them (a moment ``expected`` lacks: zeros, a parameter that
    never got a gradient). A collective (the safe_get_full_* functions)."""
    import zerocore

    differ = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        got = {"master": zerocore.safe_get_full_fp32_param(param),
               "exp_avg": zerocore.safe_get_full_optimizer_state(param, "exp_avg"),
               "exp_avg_sq": zerocore.safe_get_full_optimizer_state(param, "exp_avg_sq")}
        for key, value in got.items():
            if not torch.equal(value, expected.get(f"{key}/{name}", torch.zeros_like(value))):
                differ.append(f"{key}/{name}")
    return differ


def deepspeed_stage0_state(engine, param: torch.Tensor, key: str) -> torch.Tensor:
    """A parameter's fp32 master (``key`` "master") or Adam moment from a live DeepSpeed stage-0 engine: its
    FP16_Optimizer's flat fp32 group (bf16, fp16), or the parameter and its optimizer state (fp32)."""
    optimizer = engine.optimizer
    if not hasattr(optimizer, "fp32_groups_flat"):
        value = param if key == "master" else optimizer.state[param][key]
        return value.detach().float().clone()
    for flat, group in zip(optimizer.fp32_groups_flat, optimizer.fp16_groups):
        offset = 0
        for p in group:
            if p is param:
                source = flat if key == "master" else optimizer.optimizer.state[flat][key]
                return source.detach().narrow(0, offset, p.numel()).view(p.shape).float().clone()
            offset += p.numel()
    raise KeyError("the parameter is in none of the optimizer's groups")


def deepspeed_flat_state(engine, param: torch.Tensor, key: str) -> torch.Tensor:
    """A parameter's fp32 master (``key`` "master") or Adam moment at stages 1-2, read from the ranks' flat
    partitions at the offset DeepSpeed flattened it to (its round-robin order), not through the fragment
    addresses. A collective."""
    import torch.distributed as dist

    optimizer = engine.optimizer
    for g, (group, offsets) in enumerate(zip(optimizer.round_robin_bit16_groups, optimizer.round_robin_bit16_offsets)):
        for p, offset in zip(group, offsets):
            if p is param:
                part = optimizer.single_partition_of_fp32_groups[g]
                part = part if key == "master" else optimizer.optimizer.state[part][key]
                parts = [torch.zeros_like(part) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, part.detach().contiguous())
                return torch.cat(parts)[offset : offset + p.numel()].view(p.shape).float().clone()
    raise KeyError("the parameter is in none of the optimizer's groups")


def deepspeed_full_moment(engine, param: torch.Tensor, key: str) -> torch.Tensor:
    """A parameter's whole Adam moment ``key`` from a live DeepSpeed engine: deepspeed.utils'
    safe_get_full_optimizer_state, but at stages 1-2 through DeepSpeed's fragment addresses by hand: DeepSpeed
    0.19.8's raises on the rank whose last partition of a param group is shorter than its moments (it keeps no
    moment fragment there), and the other ranks then hang in its all-reduce. A collective."""
    import torch.distributed as dist

    if hasattr(param, "ds_id"):
        from deepspeed.utils import safe_get_full_optimizer_state

        return safe_get_full_optimizer_state(param, key).detach().float().clone()
    full = torch.zeros(param.numel())
    mapping = param._hp_mapping
    if mapping is not None:
        optimizer = engine.optimizer  # ZeRO 1-2's flat fp32 partitions, or BF16_Optimizer's
        flats = getattr(optimizer, "single_partition_of_fp32_groups", None) or optimizer.fp32_groups_flat_partition
        flat = flats[mapping.param_group_index]
        moment = engine.optimizer.optimizer.state[flat][key]
        hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
        full[lp.start : lp.start + lp.numel] = moment.narrow(0, hp.start, hp.numel)
    dist.all_reduce(full)
    return full.view(param.shape)
