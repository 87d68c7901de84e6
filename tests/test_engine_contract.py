"""Engine contracts beyond parity: collective order, memory formula, comm volume, no_sync, bad input."""

from __future__ import annotations

import contextlib
import copy
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocore
from zerocore._model_checks import all_gather_json
from _dist import run_ranks
from _models import batch, build, loss_fn
from _parity import ReferencePair, as_dtype

pytestmark = pytest.mark.timeout(300)


def _config(stage: int, bucket: int = 1000, **extra) -> dict:
    return {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
            **extra}


class Branches(nn.Module):
    """Eight parallel branches whose forward (so backward, so gradient-ready) order is permuted per call."""

    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(16, 16) for _ in range(8))
        self.order = list(range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(self.branches[i](x) * (i + 1) for i in self.order)


def order_worker(rank: int, world: int, stage: int) -> list[str]:
    torch.manual_seed(0)
    model = Branches()
    engine = zerocore.initialize(model, _config(stage, bucket=300))
    engine.comm.set_logging(True)
    rng = random.Random(1234 + rank)  # a different ready order on every rank and every step
    for step in range(4):
        model.order = rng.sample(range(8), 8)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).square().mean())
        engine.step()
    log = list(engine.comm.log())
    everyone = all_gather_json(engine.comm, log, torch.device("cpu"))
    assert all(other == log for other in everyone), "ranks issued different collective sequences"
    return log


@pytest.mark.parametrize("stage", [1, 2])
def test_collective_sequence_is_identical_on_every_rank_under_permuted_ready_orders(stage):
    logs = run_ranks(order_worker, 3, stage)
    assert len({tuple(log) for log in logs}) == 1
    reduce_scatters = [entry for entry in logs[0] if entry.startswith("reduce_scatter")]
    assert len(reduce_scatters) >= 4 * 3  # several buckets per step


def memory_worker(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    # Every parameter is a multiple of 64 * world elements, so the layout adds no padding and Psi is exact.
    model = nn.Sequential(nn.Linear(128, 128, bias=False), nn.Linear(128, 256, bias=False))
    engine = zerocore.initialize(model, _config(stage, bucket=20_000, bf16={"enabled": True}))
    engine.backward(engine(torch.randn(2, 128).bfloat16()).float().square().mean())
    engine.step()
    return engine.memory_report()


@pytest.mark.parametrize("stage", [1, 2])
def test_memory_report_matches_the_zero_formula_byte_for_byte(stage):
    psi = 128 * 128 + 128 * 256
    for report in run_ranks(memory_worker, 2, stage):
        n = 2
        b = report["bytes"]
        assert report["psi"] == report["psi_padded"] == psi
        assert b["params"] == 2 * psi  # bf16
        assert b["grads"] == (2 * psi if stage == 1 else 2 * psi // n)
        assert b["master_params"] == 4 * psi // n
        assert b["optimizer_moments"] == 8 * psi // n
        expected = 2 * psi + 2 * psi + 12 * psi // n if stage == 1 else 2 * psi + (2 + 12) * psi // n
        assert report["model_state_bytes"] == expected == report["formula"]["total"]
        # itemized beside the model state; stage 1 reduces its bf16 gradient buffer in place (Gloo's send_recv
        # sums the bf16 values in fp32 at the receiver), stage 2 fills bf16 pool buffers
        assert (b["reduce_buckets"] == 0) if stage == 1 else (b["reduce_buckets"] > 0)
        assert report["model_state_bytes"] < report["ddp_bytes"]


def comm_worker(rank: int, world: int, stage: int) -> dict:
    model = build("mlp")
    engine = zerocore.initialize(model, _config(stage))
    engine.reset_comm_stats()
    x, y = batch("mlp", torch.Generator().manual_seed(rank))
    engine.backward(loss_fn("mlp", engine(x), y))
    engine.step()
    return engine.comm_report()


@pytest.mark.parametrize("stage", [1, 2])
def test_comm_report_shows_psi_reduce_scattered_and_psi_all_gathered_per_step(stage):
    for report in run_ranks(comm_worker, 2, stage):
        c = report["collectives"]
        psi = report["psi_padded"]
        assert c["reduce_scatter"]["logical_elements"] == psi
        assert c["all_gather"]["logical_elements"] == psi
        # Gloo, every rank on this host: the bytes go through shared memory, none through the ProcessGroup
        assert report["algorithms"] == {"reduce_scatter": "shared_memory", "all_gather": "shared_memory",
                                        "parameter_all_gather": "shared_memory"}
        assert report["shared_memory_bytes"] > 0
        assert c["reduce_scatter"]["algorithm_bytes"] > 0 and c["all_gather"]["backend_calls"] == 0
        assert report["optimizer_steps"] == 1
        assert report["per_step"]["reduce_scatter"]["logical_elements"] == psi


def no_sync_worker(rank: int, world: int, stage: int) -> bool:
    """no_sync accumulation for 3 micro-batches, then a synced one, equals gradient_accumulation_steps=4:
    both match a replica that sees every rank's four micro-batches at once."""
    micro = [[batch("mlp", torch.Generator().manual_seed(10 * r + m)) for m in range(4)] for r in range(world)]
    reference = ReferencePair(build("mlp"), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0,
                                                                         foreach=False))
    reference.train_step(lambda module, dtype: sum(loss_fn("mlp", module(as_dtype(x, dtype)), y)
                                                   for per_rank in micro for x, y in per_rank) / (4 * world))
    for use_no_sync in (True, False):
        model = build("mlp")
        config = _config(stage, gradient_accumulation_steps=1 if use_no_sync else 4)
        engine = zerocore.initialize(model, config)
        for m, (x, y) in enumerate(micro[rank]):
            loss = loss_fn("mlp", engine(x), y)
            if use_no_sync:
                if m < 3:
                    with engine.no_sync():
                        engine.backward(loss / 4)
                else:
                    engine.backward(loss / 4)
                    engine.step()
            else:
                engine.backward(loss)
                engine.step()
        assert engine.global_steps == 1
        reference.assert_matches(engine.full_state_dict(rank0_only=False), label=f"no_sync={use_no_sync}")
        engine.close()
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_sync_works_in_every_stage(stage):
    run_ranks(no_sync_worker, 2, stage)


def grad_visibility_worker(rank: int, world: int, stage: int) -> list[bool]:
    torch.manual_seed(0)
    model = build("mlp")
    engine = zerocore.initialize(model, _config(stage, bucket=200, gradient_accumulation_steps=2))
    x, y = batch("mlp", torch.Generator().manual_seed(rank))
    engine.backward(loss_fn("mlp", engine(x), y))  # not the boundary: stage 1 accumulates locally, like no_sync
    local = [p.grad is not None for p in model.parameters()]
    engine.step()
    engine.backward(loss_fn("mlp", engine(x), y))  # the boundary: reduce-scattered, each rank holds its shard
    reduced = [p.grad is None for p in model.parameters()]
    # a user's clip over .grad finds nothing, on every rank alike, instead of each rank's own mix of values
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    engine.step()
    return [all(local) == (stage == 1), all(reduced), norm == 0.0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_grad_is_none_once_reduced_and_local_before(stage):
    for flags in run_ranks(grad_visibility_worker, 2, stage):
        assert all(flags), flags


class RankDependentBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.use_b = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) if self.use_b else self.a(x)


def unused_worker(rank: int, world: int, stage: int) -> bool:
    torch.manual_seed(0)
    model = RankDependentBranch()
    engine = zerocore.initialize(model, _config(stage, bucket=64))
    for step in range(3):
        model.use_b = (rank + step) % 2 == 0  # some ranks use b, others do not, changing every step
        engine.backward(engine(torch.randn(2, 8)).sum())
        engine.step()
    flat = torch.cat([v.reshape(-1) for v in engine.full_state_dict(rank0_only=False).values()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    return all(torch.equal(flat, other) for other in everyone)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameters_unused_on_some_ranks_never_hang_and_stay_replicated(stage):
    assert all(run_ranks(unused_worker, 2, stage, timeout=120))


def mismatch_worker(rank: int, world: int) -> str:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3 if rank == 1 else 4))
    try:
        zerocore.initialize(model, _config(1))
    except ValueError as error:
        return str(error)
    return "no error"


def test_different_models_on_different_ranks_raise_on_every_rank():
    for message in run_ranks(mismatch_worker, 2, timeout=120):
        assert "1.weight" in message and "rank 1" in message, message


def misuse_worker(rank: int, world: int) -> list[str]:
    errors = []
    model = build("mlp")
    engine = zerocore.initialize(model, _config(2))
    x, y = batch("mlp", torch.Generator().manual_seed(0))
    try:
        engine.step()
    except RuntimeError as error:
        errors.append(str(error))
    engine.backward(loss_fn("mlp", engine(x), y))
    try:
        engine.backward(loss_fn("mlp", engine(x), y))
    except RuntimeError as error:
        errors.append(str(error))
    engine.step()
    try:
        loss_fn("mlp", engine(x), y).backward()
    except RuntimeError as error:
        errors.append(str(error))
    mixed = nn.Linear(2, 2)
    mixed.bias = nn.Parameter(torch.zeros(2, device="meta"))
    try:
        zerocore.initialize(mixed, _config(1))
    except ValueError as error:
        errors.append(str(error))
    return errors


def test_misuse_raises_clear_errors():
    for errors in run_ranks(misuse_worker, 2, timeout=120):
        assert len(errors) == 4, errors
        assert "before backward" in errors[0]
        assert "twice without step" in errors[1]
        assert "instead of loss.backward()" in errors[2]
        assert "several devices" in errors[3]


def test_bad_comm_algorithm_and_meta_model_outside_stage3():
    with pytest.raises(ValueError, match="stage"):
        with torch.device("meta"):
            model = build("mlp")
        zerocore.initialize(model, _config(2))
    with pytest.raises(ValueError, match="reduce_scatter"):
        zerocore.initialize(build("mlp"), _config(1), comm_algorithms={"reduce_scatter": "magic"})


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No bias before the BatchNorm: its true gradient is exactly zero (BatchNorm subtracts the batch mean),
        # so Adam would turn rounding noise into full-size steps there (see tests/_parity.py).
        self.net = nn.Sequential(nn.Linear(12, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def train_beside_ddp(engine: zerocore.Engine, model: nn.Module, rank: int, steps: int, size: int = 4,
                     process_group: dist.ProcessGroup | None = None) -> None:
    """Trains the engine and a DDP-wrapped reference (fp32 and float64, built from ``model`` before the engine
    took it) on the same per-rank batches, then applies the parity rule (tests/_parity.py) to every final
    parameter and buffer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    reference = ReferencePair(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0,
                                                                 foreach=False),
                              wrap=lambda m: DDP(m, process_group=process_group))
    for step in range(steps):
        x, y = batch("mlp", torch.Generator().manual_seed(10 * step + rank), size=size)
        engine.backward(loss_fn("mlp", engine(x), y))
        engine.step()
        reference.train_step(lambda module, dtype: loss_fn("mlp", module(as_dtype(x, dtype)), y))
    reference.assert_matches(engine.full_state_dict(rank0_only=False))


def batchnorm_worker(rank: int, world: int, stage: int) -> bool:
    torch.manual_seed(0)
    model = WithBatchNorm()
    replica = copy.deepcopy(model)
    engine = zerocore.initialize(model, _config(stage))
    train_beside_ddp(engine, replica, rank, steps=5, size=6)
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_buffers_follow_rank0_like_ddp(stage):
    assert all(run_ranks(batchnorm_worker, 2, stage))


def subgroup_worker(rank: int, world: int, stage: int) -> bool:
    """Two data-parallel groups of 2 inside a world of 4 (as under tensor or pipeline parallelism):
    each group trains its own replica and must match a DDP reference over the same group."""

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    with pytest.raises(ValueError, match="not a member of the process_group"):  # not "world_size -1"
        zerocore.initialize(build("mlp"), _config(stage), process_group=groups[1 - rank // 2])
    torch.manual_seed(rank // 2)  # a different model per group
    model = build("mlp", seed=rank // 2)
    replica = copy.deepcopy(model)
    engine = zerocore.initialize(model, _config(stage), process_group=group)
    assert (engine.rank, engine.world_size) == (rank % 2, 2)
    train_beside_ddp(engine, replica, rank, steps=4, process_group=group)
    return True


@pytest.mark.parametrize("stage", [2, 3])
def test_data_parallel_subgroups_compose(stage):
    assert all(run_ranks(subgroup_worker, 4, stage, timeout=240))


def two_forwards_worker(rank: int, world: int, stage: int) -> list[float]:
    """Two forwards before one backward (contrastive pairs, sentence-transformers) on a model with buffers:
    the buffer broadcast before the second forward must not invalidate the first forward's graph (DDP's does
    not), and the running statistics end as DDP's: rank 0's, updated by this rank's second forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    engine = zerocore.initialize(model, _config(stage))
    for net in (engine, reference):
        g = torch.Generator().manual_seed(rank)
        a, b = torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)
        loss = (net(a) - net(b)).square().mean()
        engine.backward(loss) if net is engine else loss.backward()
    engine.step()
    ours, theirs = model[1], reference.module[1]
    assert torch.allclose(ours.running_mean, theirs.running_mean) and torch.allclose(ours.running_var, theirs.running_var)
    return [float(loss)]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_forwards_before_one_backward_with_buffers(stage):
    run_ranks(two_forwards_worker, 2, stage)


def buffers_between_forwards_worker(rank: int, world: int, stage: int) -> bool:
    """Note [Buffers follow rank 0]: DDP broadcasts rank 0's buffers before a forward that follows a grad-enabled
    forward outside no_sync(). So on every rank the buffers at rest, an evaluation forward right after training
    (BatchNorm in eval mode reads the running statistics), and training after evaluation and inside no_sync()
    are DDP's."""
    torch.manual_seed(0)
    model = WithBatchNorm()
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0, foreach=False)
    config = _config(stage)
    config["optimizer"]["params"]["weight_decay"] = 0.0
    engine = zerocore.initialize(model, config)
    ours, theirs = model.net[1], reference.module.net[1]
    seen = 0

    def same(where: str) -> None:
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{where}, {name}: {m}")

    def data() -> torch.Tensor:
        nonlocal seen
        seen += 1
        return torch.randn(6, 12, generator=torch.Generator().manual_seed(100 * seen + rank)) * (1 + rank)

    def train(window: list[bool]) -> None:  # one accumulation window; True: that micro-step inside no_sync()
        for inside in window:
            x = data()
            with engine.no_sync() if inside else contextlib.nullcontext():
                engine.backward(engine(x).square().mean() / len(window))
            with reference.no_sync() if inside else contextlib.nullcontext():
                (reference(x).square().mean() / len(window)).backward()
        engine.step()
        ref_optimizer.step()
        ref_optimizer.zero_grad()

    def evaluate(where: str) -> None:
        for net in (model, reference):
            net.eval()
        with torch.no_grad():
            x = data()
            torch.testing.assert_close(engine(x), reference(x), rtol=1e-4, atol=1e-5, msg=lambda m: f"{where}: {m}")
        for net in (model, reference):
            net.train()
        same(where)

    train([False])
    same("after a step")
    evaluate("evaluation after training")
    train([True, True, False])  # no_sync() forwards: the forward after one is not synced
    same("after a window with no_sync")
    evaluate("evaluation after a no_sync window")
    evaluate("a second evaluation")
    train([False])
    same("training after evaluation")
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_buffers_between_forwards_follow_ddp_on_every_rank(stage):
    assert all(run_ranks(buffers_between_forwards_worker, 2, stage))


def stale_graph_worker(rank: int, world: int, stage: int, directory: str) -> list[str]:
    """A graph recorded before the engine rewrote the parameters (step(), load_checkpoint(), a modifier rank's
    gathered()) cannot be back-propagated, as after a torch optimizer's in-place step: it would combine the new
    weights with the old activations. Each raises on every rank, and the engine trains on afterwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    engine = zerocore.initialize(model, _config(stage))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).square().mean())
    engine.step()
    engine.save_checkpoint(directory)
    errors = []

    def rewrite_between_forward_and_backward(rewrite) -> None:
        loss = engine(x).square().mean()
        rewrite()
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
            engine.backward(loss)
        errors.append(" ".join(info.value.__notes__))
        engine.backward(engine(x).square().mean())  # a fresh forward trains as usual
        engine.step()

    rewrite_between_forward_and_backward(lambda: engine.load_checkpoint(directory))

    def modify() -> None:
        with zerocore.gathered(list(model.parameters()), modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    model[0].weight.mul_(0.5)

    rewrite_between_forward_and_backward(modify)
    # retain_graph: a second backward of the same graph after step() raises as with torch.optim.AdamW
    loss = engine(x).square().mean()
    engine.backward(loss, retain_graph=True)
    engine.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        engine.backward(loss)
    engine.backward(engine(x).square().mean())
    engine.step()
    assert all(torch.isfinite(v).all() for v in engine.full_state_dict(rank0_only=False).values())
    return errors


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_graph_recorded_before_the_parameters_were_rewritten_cannot_be_back_propagated(stage, tmp_path):
    for errors in run_ranks(stale_graph_worker, 2, stage, str(tmp_path)):
        assert len(errors) == 2 and all("run the forward again" in e for e in errors), errors


class TwiceCheckpointed(nn.Module):
    """One block run twice per loss under reentrant activation checkpointing (R-Drop, a shared layer with
    Hugging Face's gradient_checkpointing_enable()): its parameters' gradients arrive in two autograd passes."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        run = lambda h: torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True)  # noqa: E731
        return self.head(torch.tanh(run(x)) + torch.tanh(run(x * 2)))


def reentrant_twice_worker(rank: int, world: int, stage: int) -> str:
    torch.manual_seed(0)
    engine = zerocore.initialize(TwiceCheckpointed(), {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                                       "zero_optimization": {"stage": stage}})
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError) as raised:
        engine.backward(engine(x).square().mean())
    engine.backward(engine(x.detach()).square().mean())  # the engine is ready for the next batch
    engine.step()
    return str(raised.value)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_gradient_arriving_twice_names_the_parameter_and_use_reentrant(stage):
    for message in run_ranks(reentrant_twice_worker, 2, stage):
        assert "'block.weight'" in message or "'block.bias'" in message, message
        assert "use_reentrant=False" in message, message
