"""Paths that used to end in a silently wrong result (issue 9): a rejected loss.backward() leaves no gradient
behind (item 7), an fp16 gradient reduction that overflows skips the update instead of writing NaN (item 8),
a float64 model is refused and only what DeepSpeed casts is cast (item 10)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
from _dist import run_ranks

pytestmark = pytest.mark.timeout(300)


def _config(stage: int, **extra) -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage}, **extra}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out if scale is None else out * scale


def _x(step: int, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank)).to(dtype)


def _engine_and_twin(build: type[nn.Module], config: dict) -> tuple[nn.Module, zerocore.Engine, zerocore.Engine]:
    """An engine on a fresh model and an engine on an identical twin: the twin takes the clean path, the
    engine the one under test, and both must end in the same state."""
    torch.manual_seed(0)
    model, twin = build(), build()
    twin.load_state_dict(model.state_dict())
    return model, zerocore.initialize(model, config), zerocore.initialize(twin, config)


def _train_step(engine: zerocore.Engine, step: int, rank: int) -> None:
    engine.backward(engine(_x(step, rank)).square().mean())
    engine.step()


def _assert_same_state(engine: zerocore.Engine, other: zerocore.Engine, message: str = "") -> None:
    mine, theirs = engine.full_state_dict(rank0_only=False), other.full_state_dict(rank0_only=False)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), message


# ---- item 7 -----------------------------------------------------------------------------------------
def rejected_backward_worker(rank: int, world: int, stage: int) -> bool:
    model, engine, other = _engine_and_twin(Net, _config(stage))
    for step in range(3):
        if step == 1:  # the user calls loss.backward() by mistake, reads the error, and goes on
            with pytest.raises(RuntimeError, match="engine.backward"):
                engine(_x(step, rank)).square().mean().backward()
            assert all(p.grad is None or not p.grad.any() for p in model.parameters())
        _train_step(engine, step, rank)
        _train_step(other, step, rank)
    _assert_same_state(engine, other, "the rejected gradient was counted")
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_rejected_loss_backward_leaves_no_gradient_behind(stage):
    assert all(run_ranks(rejected_backward_worker, 2, stage))


def autograd_grad_worker(rank: int, world: int, stage: int) -> bool:
    """torch.autograd.grad accumulates nothing, so it is not an engine.backward() misuse: it works."""
    torch.manual_seed(0)
    model = Net()
    engine = zerocore.initialize(model, _config(stage))
    x = _x(0, rank).requires_grad_()
    (grad_x,) = torch.autograd.grad(engine(x).square().mean(), x)
    assert torch.isfinite(grad_x).all()
    return True


@pytest.mark.parametrize("stage", [1, 2])
def test_autograd_grad_through_the_engine_still_works(stage):
    assert all(run_ranks(autograd_grad_worker, 2, stage))


# ---- item 8 -----------------------------------------------------------------------------------------
def fp16_reduce_worker(rank: int, world: int, stage: int) -> tuple[int, bool]:
    torch.manual_seed(0)
    model = Net()
    engine = zerocore.initialize(model, _config(stage, bf16={"enabled": True}, communication_data_type="fp16"))
    before = engine.full_state_dict(rank0_only=False)
    # a loss whose gradients are finite in bf16 (max ~3e38) but overflow fp16 (max 65504)
    engine.backward(engine(_x(0, rank, torch.bfloat16)).float().sum() * 1e8)
    with pytest.warns(RuntimeWarning, match="communication_data_type"):
        engine.step()
    after = engine.full_state_dict(rank0_only=False)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    engine.backward(engine(_x(1, rank, torch.bfloat16)).float().mean())
    engine.step()
    finite = all(bool(torch.isfinite(v).all()) for v in engine.full_state_dict(rank0_only=False).values())
    return engine.skipped_steps, unchanged and finite


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_fp16_reduction_overflow_skips_the_update_instead_of_writing_nan(stage):
    assert run_ranks(fp16_reduce_worker, 2, stage) == [(1, True), (1, True)]


def nan_loss_worker(rank: int, world: int, stage: int, precision: str, check: bool | None) -> tuple:
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    extra = {"bf16": {"enabled": precision == "bf16", **({} if check is None else {"check_grad_overflow": check})}}
    engine = zerocore.initialize(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)), _config(stage, **extra))
    before = engine.full_state_dict(rank0_only=False)
    loss = engine(_x(0, rank, dtype)).float().mean()
    engine.backward(loss * float("nan") if rank == 1 else loss)  # one rank's batch held a NaN
    with pytest.warns(RuntimeWarning, match="global gradient norm is nan") as caught:
        engine.step()
    assert {w.filename for w in caught if "norm is nan" in str(w.message)} == {__file__}  # the step's line
    applied = engine.was_step_applied()
    after = engine.full_state_dict(rank0_only=False)
    kept = all(torch.equal(before[k], after[k]) for k in before)
    # and the next batch trains on (or, applied, on NaN parameters)
    engine.backward(engine(_x(1, rank, dtype)).float().mean())
    engine.step()
    finite = all(bool(torch.isfinite(v).all()) for v in engine.full_state_dict(rank0_only=False).values())
    return applied, kept, finite, engine.skipped_steps


@pytest.mark.parametrize("stage,precision", [(1, "bf16"), (2, "fp32"), (3, "bf16")])
def test_a_nan_gradient_on_one_rank_skips_the_update_on_every_rank_as_deepspeed_does(stage, precision):
    """DeepSpeed 0.19 skips a step whose gradient norm is inf or NaN at every stage and dtype (bf16 unless
    bf16.check_grad_overflow is false): the parameters stay as they were, said on every rank, and training goes
    on; torch's AdamW would have made every parameter NaN."""
    assert run_ranks(nan_loss_worker, 2, stage, precision, None) == [(False, True, True, 1)] * 2


@pytest.mark.parametrize("stage", [1, 3])
def test_check_grad_overflow_false_applies_a_nan_update_as_torch_does_but_says_so(stage):
    assert run_ranks(nan_loss_worker, 2, stage, "bf16", False) == [(True, False, False, 0)] * 2


# ---- item 10 ----------------------------------------------------------------------------------------
def float64_worker(rank: int, world: int, stage: int) -> bool:
    model = Net().double()
    with pytest.raises(ValueError, match=r"fc1.weight.*float64.*model.float\(\)"):
        zerocore.initialize(model, _config(stage))
    assert next(model.parameters()).dtype == torch.float64  # the user's model is left as it was
    return True


@pytest.mark.parametrize("stage", [1, 3])
def test_a_float64_model_is_refused_not_cast(stage):
    assert all(run_ranks(float64_worker, 2, stage))


def sparse_worker(rank: int, world: int, stage: int) -> bool:
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"module '0' \(Embedding\) has sparse=True"):
        zerocore.initialize(model, _config(stage))
    model[0].requires_grad_(False)  # frozen, it produces no gradient: accepted
    zerocore.initialize(model, _config(stage)).close()
    return True


@pytest.mark.parametrize("stage", [1, 3])
def test_a_module_with_sparse_gradients_is_refused_at_initialize(stage):
    """Before, nn.Embedding(sparse=True) failed inside the first backward with an error about data pointers."""
    assert all(run_ranks(sparse_worker, 2, stage))


def test_an_unmaterialized_lazy_module_is_refused_by_name():
    """Before, torch's "Can't access the shape of an uninitialized parameter" came from zerocore's model check."""
    model = nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"parameter '0.weight' is not materialized yet.*run one forward"):
        zerocore.initialize(model, _config(1))


def test_a_complex_parameter_is_refused_naming_its_real_view():
    """model.float() leaves complex tensors alone, so the float64 advice would not help; the real view would."""
    model = nn.Linear(4, 4).to(torch.cfloat)
    weight = model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"'weight' is torch.complex64.*torch.view_as_real\(w\)"):
        zerocore.initialize(model, _config(1))
    assert torch.equal(model.weight, weight)
    model.weight = nn.Parameter(torch.view_as_real(weight))
    model.bias.requires_grad_(False)
    zerocore.initialize(model, _config(1)).close()


def mixed_dtypes_worker(rank: int, world: int, stage: int) -> list[str]:
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 2).bfloat16())
    with pytest.warns(UserWarning, match=r"several dtypes \(float32: 2 \(0.weight, 0.bias\); bfloat16: 2 .*cast"):
        engine = zerocore.initialize(model, _config(stage))
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    engine.close()
    return dtypes


@pytest.mark.parametrize("stage", [1, 3])
def test_parameters_of_several_dtypes_are_cast_with_a_warning_not_silently(stage):
    """A bf16 layer in an fp32 model (or an fp32 router kept in a bf16 one) trains in the one compute dtype."""
    assert run_ranks(mixed_dtypes_worker, 1, stage) == [["torch.float32"]]


def cast_worker(rank: int, world: int, stage: int) -> bool:
    torch.manual_seed(0)
    model = Net()
    engine = zerocore.initialize(model, _config(stage, bf16={"enabled": True}))
    scale = torch.tensor([1.0 + 2**-12])  # not representable in bf16: a cast would make it exactly 1.0
    out = engine(_x(0, rank, torch.bfloat16), scale=scale)
    plain = engine(_x(0, rank, torch.bfloat16))
    assert out.dtype == torch.float32  # bf16 output times an fp32 keyword argument: not cast (DeepSpeed casts none)
    assert not torch.equal(out, plain.float())
    # fp16 with auto_cast casts the positional floating inputs, as DeepSpeed does
    torch.manual_seed(0)
    half = zerocore.initialize(Net(), _config(stage, fp16={"enabled": True, "auto_cast": True}))
    assert half(_x(0, rank)).dtype == torch.float16
    return True


@pytest.mark.parametrize("stage", [1, 3])
def test_only_what_deepspeed_casts_is_cast(stage):
    assert all(run_ranks(cast_worker, 2, stage))


class WithOddFrozenTensors(nn.Module):
    """Tensors of dtypes mixed precision must not touch: a complex filter (an FFT-based layer's), a complex
    buffer (Llama's rotary freqs_cis) and integer positions above 256, which bf16 cannot hold."""

    def __init__(self) -> None:
        super().__init__()
        self.filter = nn.Parameter(torch.randn(8, 8, dtype=torch.cfloat), requires_grad=False)
        self.positions = nn.Parameter(torch.arange(257, 265), requires_grad=False)
        self.register_buffer("turn", torch.polar(torch.ones(8), torch.linspace(0, 3, 8)))  # Llama's freqs_cis
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x.to(torch.cfloat) @ self.filter * self.turn).imag + (self.positions % 7).float()
        h = h.to(x.dtype)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return h


def odd_frozen_worker(rank: int, world: int, stage: int, precision: str, directory: str) -> bool:
    torch.manual_seed(0)
    model = WithOddFrozenTensors()
    kept = {k: v.clone() for k, v in model.state_dict().items() if k in ("filter", "positions", "turn")}
    config = _config(stage, **{precision: {"enabled": True}})
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # stage 3 shards them too
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    engine = zerocore.initialize(model, config)
    for step in range(2):
        engine.backward(engine(_x(step, rank, dtype)).float().square().mean())
        engine.step()
    state = engine.full_state_dict(rank0_only=False)
    assert all(torch.equal(state[k], v) for k, v in kept.items()), {k: state[k].dtype for k in kept}
    engine.save_checkpoint(directory, tag="t")
    engine.close()
    assert all(torch.equal(getattr(model, k), v) for k, v in kept.items())  # handed back whole and exact
    torch.manual_seed(1)
    fresh = zerocore.initialize(WithOddFrozenTensors(), config)
    fresh.load_checkpoint(directory, tag="t")
    loaded = fresh.full_state_dict(rank0_only=False)
    assert all(torch.equal(loaded[k], v) for k, v in kept.items())
    fresh.close()
    return True


@pytest.mark.parametrize("stage,precision", [(1, "bf16"), (2, "fp16"), (3, "bf16")])
def test_mixed_precision_casts_no_complex_or_integer_frozen_parameter(stage, precision, tmp_path):
    """Before, stages 1-2 cast the model with module.to(dtype), which turns a complex tensor real (its
    imaginary part dropped, with only torch's warning); DeepSpeed's module.bfloat16() casts floating-point
    tensors only. Stage 3 keeps non-floating frozen parameters whole and uncast (checked here too)."""
    assert all(run_ranks(odd_frozen_worker, 2, stage, precision, str(tmp_path), timeout=200))


# ---- item 18 ----------------------------------------------------------------------------------------
class FailingBackward(torch.autograd.Function):
    """Identity forward; its backward raises when told to (after later layers' gradients were reduced)."""

    fail = False

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if FailingBackward.fail:
            raise RuntimeError("simulated failure in backward")
        return grad


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 64)
        self.rest = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(FailingBackward.apply(torch.tanh(self.first(x))))


def backward_failure_worker(rank: int, world: int, stage: int) -> bool:
    _, engine, other = _engine_and_twin(Deep, _config(stage, zero_optimization={"stage": stage,
                                                                                  "reduce_bucket_size": 5000}))
    for step in range(3):
        if step == 1:  # every rank fails at the same point, with buckets of later layers already in flight
            FailingBackward.fail = True
            with pytest.raises(RuntimeError, match="simulated failure") as caught:
                engine.backward(engine(_x(step, rank)).square().mean())
            FailingBackward.fail = False
            assert "gradients were dropped" in "".join(getattr(caught.value, "__notes__", []))
            assert engine.state.value == "idle", engine.state
        _train_step(engine, step, rank)
        _train_step(other, step, rank)
    _assert_same_state(engine, other, "the failed backward left something behind")
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_exception_in_backward_leaves_the_engine_usable(stage):
    assert all(run_ranks(backward_failure_worker, 2, stage))


# ---- item 20 ----------------------------------------------------------------------------------------
class HalfCheckpointed(nn.Module):
    """A block (a stage 3 unit) of which one half runs inside a reentrant checkpoint: that half's gradients
    come from the recomputation's own backward, the other half's from the outer one."""

    def __init__(self, inside: str) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.second = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.inside = inside

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for half in (self.first, self.second):
            h = torch.utils.checkpoint.checkpoint(half, h, use_reentrant=True) if half is getattr(self, self.inside) \
                else half(h)
        return h


class Checkpointed(nn.Module):
    """``where``: "block" checkpoints each block whole (Hugging Face's gradient_checkpointing_enable), "first" or
    "second" half of each."""

    def __init__(self, where: str = "block") -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) if where == "block"
                                    else HalfCheckpointed(where) for _ in range(3))
        self.out = nn.Linear(16, 4)
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True) if self.where == "block" else block(h)
        return self.out(h)


def reentrant_worker(rank: int, world: int, stage: int, where: str) -> bool:
    from _parity import ReferencePair

    torch.manual_seed(0)
    model = Checkpointed(where)
    reference = ReferencePair(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0,
                                                                 foreach=False))
    engine = zerocore.initialize(model, _config(stage, zero_optimization={"stage": stage,
                                                                           "reduce_bucket_size": 300}))
    for step in range(3):
        engine.backward(engine(_x(step, rank)).square().mean())
        engine.step()
        reference.train_step(lambda module, dtype: sum(module(_x(step, r).to(dtype)).square().mean()
                                                       for r in range(world)) / world)
    reference.assert_matches(engine.full_state_dict(rank0_only=False), label=f"stage {stage}")
    return True


@pytest.mark.parametrize("stage,where", [(1, "block"), (2, "block"), (3, "block"), (3, "first"), (3, "second")])
def test_reentrant_activation_checkpointing_trains_like_ddp(stage, where):
    """At stage 3 a unit half inside a checkpoint gets its gradients from two backwards, one inside the other:
    its reduction waits for both (Note [Parameters this backward will not reach])."""
    assert all(run_ranks(reentrant_worker, 2, stage, where))


# ---- item 24 ----------------------------------------------------------------------------------------
class MaybeFails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.fail_at: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i == self.fail_at:
                raise RuntimeError("simulated failure in forward")
            x = torch.tanh(block(x))
        return x


def failed_forward_worker(rank: int, world: int) -> int:
    torch.manual_seed(0)
    model = MaybeFails()
    engine = zerocore.initialize(model, _config(3, zero_optimization={"stage": 3}), units=[nn.Linear])
    model.fail_at = 2  # the very first forward fails half-way
    with pytest.raises(RuntimeError, match="simulated failure in forward"):
        engine(_x(0, rank))
    model.fail_at = None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a recorded half order would warn "the forward order changed"
        for step in range(3):
            engine.backward(engine(_x(step, rank)).square().mean())
            engine.step()
    return len(engine.stage3.recorded_order)


def test_a_failed_forward_does_not_become_the_prefetch_order():
    assert run_ranks(failed_forward_worker, 2) == [4, 4]


# ---- item 22 ----------------------------------------------------------------------------------------
def step_error_worker(rank: int, world: int, stage: int, ranks_with_bad_lr: tuple[int, ...]) -> bool:
    """A step refused for a hyperparameter ends the window as any step error does (README: the window's
    gradients dropped, the engine ready for the next batch), on every rank alike even when only some ranks'
    param_groups are bad: a rank raising alone would leave the others in the step's all-reduce."""
    _, engine, other = _engine_and_twin(Net, _config(stage))
    for step in range(4):
        engine.backward(engine(_x(step, rank)).square().mean())
        if step == 1:  # a scheduler (or the user) made the learning rate unusable, here on some ranks only
            if rank in ranks_with_bad_lr:
                engine.optimizer.param_groups[0]["lr"] = float("nan")
            before = engine.full_state_dict(rank0_only=False)
            with pytest.raises(ValueError, match="refused on every rank") as caught:
                engine.step()
            mine = r"param_groups\[0\]\.lr" if rank in ranks_with_bad_lr else "other rank"
            assert caught.match(mine) and "gradients were dropped" in "".join(caught.value.__notes__)
            after = engine.full_state_dict(rank0_only=False)
            assert all(torch.equal(before[k], after[k]) for k in before)
            assert (engine.global_steps, engine.micro_steps, engine.state.value) == (1, 2, "idle")
            engine.optimizer.param_groups[0]["lr"] = 1e-2
            continue  # the next batch trains as if this window never ran
        engine.step()
        _train_step(other, step, rank)
    _assert_same_state(engine, other, "the refused step changed something or left its gradients behind")
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("ranks_with_bad_lr", [(0,), (0, 1)])
def test_a_step_refused_for_a_hyperparameter_drops_the_window_on_every_rank(stage, ranks_with_bad_lr):
    assert all(run_ranks(step_error_worker, 2, stage, ranks_with_bad_lr, timeout=90))


def scheduler_to_inf_worker(rank: int, world: int) -> list[str]:
    """A scheduler that keeps producing an infinite lr makes every step raise, each leaving the engine usable."""
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), _config(2, scheduler={"type": "ExponentialLR", "params": {"gamma": 1e200}}))
    states = []
    for step in range(4):
        engine.backward(engine(_x(step, rank)).square().mean())
        try:
            engine.step()
        except ValueError as error:
            assert "optimizer.param_groups[0].lr" in str(error)
        states.append(engine.state.value)
    return states


def test_a_scheduler_driving_lr_to_inf_leaves_the_engine_usable():
    assert run_ranks(scheduler_to_inf_worker, 2, timeout=90) == [["idle"] * 4] * 2


def recast_worker(rank: int, world: int, stage: int) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    engine = zerocore.initialize(model, _config(stage))
    engine.backward(engine(torch.randn(2, 8)).square().mean())
    engine.step()
    model.half()  # stage 2 trained a step in fp16, then cast back silently; stage 1 failed inside torch
    with pytest.raises(RuntimeError) as raised:
        engine(torch.randn(2, 8).half())
    model.float()  # cast back: trains on
    engine.backward(engine(torch.randn(2, 8)).square().mean())
    engine.step()
    return str(raised.value)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_model_cast_after_initialize_is_refused_at_the_next_forward_naming_the_config_keys(stage):
    for message in run_ranks(recast_worker, 2, stage):
        assert "'0.weight' is torch.float16" in message and "bf16.enabled" in message, message


def foreign_parallelism_worker(rank: int, world: int) -> list[str]:
    """Each model another system already parallelizes is refused at initialize (and by estimate_memory), before
    anything touches it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    errors = []

    def refused(model: nn.Module) -> None:
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        for attempt in (lambda: zerocore.initialize(model, _config(3)),
                        lambda: zerocore.estimate_memory(model, _config(3), world_size=world)):
            with pytest.raises(ValueError) as info:
                attempt()
            errors.append(str(info.value))
        assert all(torch.equal(p.detach(), before[name]) for name, p in model.named_parameters())

    torch.manual_seed(0)
    refused(nn.parallel.DistributedDataParallel(Net()))
    nested = nn.Sequential(nn.Linear(8, 8), nn.parallel.DistributedDataParallel(Net()))
    refused(nested)
    sharded = Net()
    fully_shard(sharded, mesh=init_device_mesh("cpu", (world,)))
    errors.append(str(pytest.raises(ValueError, zerocore.initialize, sharded, _config(3)).value))
    partitioned = Net()  # what DeepSpeed's zero.Init leaves: an empty tensor, the partition and the whole shape
    weight = partitioned.fc1.weight
    weight.data, weight.ds_tensor, weight.ds_shape = torch.empty(0), torch.zeros(64), weight.shape
    refused(partitioned)
    engine = zerocore.initialize(Net(), _config(3))  # zerocore's own ds_ attributes are not DeepSpeed's partitions
    engine.close()
    return errors


def test_a_model_another_system_parallelizes_is_refused_naming_what_to_pass():
    """A DDP-wrapped model trained as well, but all-reduced every gradient twice and kept DDP's whole gradient
    copy; FSDP2's DTensor parameters failed in a broadcast with "does not have a sharding strategy"; DeepSpeed's
    zero.Init partitions failed in the first forward with "'weight' must be 2-D"."""
    errors = run_ranks(foreign_parallelism_worker, 2)[0]
    assert "DistributedDataParallel" in errors[0] and "model.module" in errors[0] and errors[1] == errors[0]
    assert "module '1'" in errors[2] and "1.module" in errors[2]
    assert "DTensor" in errors[4] and "fully_shard" in errors[4]
    assert "'fc1.weight' was partitioned by DeepSpeed's zero.Init" in errors[5] and "0 of its 128" in errors[5]
    assert "HfDeepSpeedConfig" in errors[5]


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.body = Net()
        self.head = nn.Linear(8, 10, bias=False)
        self.act = nn.Tanh()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.embed(tokens)) + self.body.fc2.weight.sum() * 0)


def added_parameter_worker(rank: int, world: int, stage: int) -> list[str]:
    """Note [Parameters added after initialize]: a parameter the engine does not manage, added to its model,
    would compute in the forward and never be trained or saved; each way of adding one raises where it is
    added, leaving the model as it was, while assignments of managed parameters and modules go through."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    finals = []
    for attempts in (False, True):
        torch.manual_seed(0)
        model = Tied()
        engine = zerocore.initialize(model, {**_config(stage), "gradient_clipping": 0.0,
                                             "zero_optimization": {"stage": stage,
                                                                   "stage3_param_persistence_threshold": 0}})
        messages = []
        for step in range(3):
            tokens = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(10 * step + rank))
            if attempts and step == 1:
                head, weight = model.head, model.head.weight
                for add in (lambda: setattr(model, "head", nn.Linear(8, 10, bias=False)),
                            lambda: setattr(model.head, "weight", nn.Parameter(torch.zeros(10, 8))),
                            lambda: model.register_parameter("extra", nn.Parameter(torch.zeros(3))),
                            lambda: model.body.add_module("fc3", nn.Linear(4, 4)),
                            lambda: model.head.load_state_dict({"weight": torch.zeros(10, 8)}, assign=True)):
                    try:
                        add()
                        messages.append("no error")
                    except RuntimeError as error:
                        messages.append(str(error))
                assert model.head is head and model.head.weight is weight and not hasattr(model, "extra")
                model.act = nn.GELU()  # no parameter: joins the model
                model.act = nn.Tanh()
                model.body.fc1 = checkpoint_wrapper(model.body.fc1)  # a wrapper around managed parameters
            engine.backward(nn.functional.cross_entropy(engine(tokens).reshape(-1, 10), tokens.reshape(-1)))
            engine.step()
        finals.append({k.replace("._checkpoint_wrapped_module", ""): v
                       for k, v in engine.full_state_dict(rank0_only=False).items()})
        engine.close()
        if attempts:
            model.extra = nn.Parameter(torch.zeros(3))  # closed: the model is the user's again
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    return messages


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_added_after_initialize_raises_where_it_is_added(stage):
    for messages in run_ranks(added_parameter_worker, 2, stage):
        assert len(messages) == 5
        *added, loaded = messages
        for message, name in zip(added, ("head.weight", "head.weight", "extra", "body.fc3.weight")):
            assert f"parameter {name!r} would be added" in message and "before zerocore.initialize" in message, \
                (name, message)
        if stage == 3:  # a load while sharded is refused first (inside gathered() the assignment would be)
            assert "load_state_dict() into a ZeRO stage 3 model" in loaded, loaded
        else:
            assert "parameter 'head.weight' would be added" in loaded, loaded


class Symmetric(nn.Module):
    """A parametrization without parameters of its own (its right inverse is the identity)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + x.t()) / 2


class Parametrized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.pair = nn.Linear(6, 6)
        torch.nn.utils.parametrize.register_parametrization(self.pair, "weight", Symmetric())  # before initialize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pair(torch.tanh(self.fc(x)))


def part_way_worker(rank: int, world: int, stage: int) -> list[str]:
    """Note [Parameters added after initialize]: weight_norm, old and new, deletes the weight (and the new one
    swaps the module's class and adds a property) before it adds its parameters; refused, it leaves the model
    as it was and training goes on as if it had never been tried."""
    import warnings

    from torch.nn.utils import parametrizations

    def shape_of(model: nn.Module) -> list:
        return [(name, id(param)) for name, param in model.named_parameters()] + [
            (name, type(module).__name__, sorted(k for k, v in vars(type(module)).items() if isinstance(v, property)))
            for name, module in model.named_modules()]

    finals, messages = [], []
    for attempts in (False, True):
        torch.manual_seed(0)
        model = Parametrized()
        engine = zerocore.initialize(model, {**_config(stage), "gradient_clipping": 0.0})
        for step in range(3):
            if attempts and step == 1:
                before = shape_of(model)
                for attempt in (lambda: torch.nn.utils.weight_norm(model.fc),  # deletes fc.weight first
                                lambda: parametrizations.weight_norm(model.fc),  # also a new class and property
                                lambda: parametrizations.weight_norm(model.pair, "bias")):  # parametrized already
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", FutureWarning)  # (the old weight_norm is deprecated)
                        with pytest.raises(RuntimeError) as error:
                            attempt()
                    messages.append(str(error.value))
                    assert shape_of(model) == before, (str(error.value), shape_of(model), before)
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
            engine.backward(engine(x).square().mean())
            engine.step()
        finals.append(engine.full_state_dict(rank0_only=False))
        engine.close()
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    return messages


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_refused_weight_norm_leaves_the_model_as_it_was(stage):
    for messages in run_ranks(part_way_worker, 2, stage):
        if stage == 3:  # computing the norm of a sharded weight is refused first (inside gathered() it would not)
            assert all("which is sharded by ZeRO stage 3" in message for message in messages), messages
        else:
            for message, name in zip(messages, ("fc.weight_g", "fc.parametrizations.weight.original0",
                                                "pair.parametrizations.bias.original0")):
                assert f"parameter {name!r} would be added" in message, (name, message)
