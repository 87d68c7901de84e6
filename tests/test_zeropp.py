"""ZeRO++ (issue 12): the quantized collectives (Note [Quantized collectives] in
bindings/quantized_collectives.cpp) against results rebuilt from explicitly quantized and dequantized
shards, on one machine pretending to be nodes of 2 ranks; and the engine's qwZ, hpZ and qgZ."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from _forward_values import recorded_forward_values
from zerocore import _C
from zerocore._topology import build_topology

pytestmark = pytest.mark.timeout(300)

GROUP = 64


def _qdq(values: torch.Tensor, bits: int, group: int = GROUP) -> torch.Tensor:
    """dequantize(quantize(values)) in fp32 through the kernels' own ops."""
    n = values.numel()
    q = torch.empty(_C.quantized_bytes(n, bits), dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.empty(_C.quantize_num_groups(n, group))
    _C.quantize(values.contiguous(), bits, group, q, scales)
    out = torch.empty(n)
    _C.dequantize(q, scales, n, bits, group, out)
    return out


def _qdq_pieces(values: torch.Tensor, begin: int, cuts: list[int], bits: int, group: int = GROUP) -> torch.Tensor:
    """_qdq of values = bucket[begin, begin + n) piece by piece, cut where ``cuts`` fall inside it."""
    n = values.numel()
    starts = [0] + [c - begin for c in cuts if begin < c < begin + n] + [n]
    return torch.cat([_qdq(values[a:b], bits, group) for a, b in zip(starts, starts[1:])])


def _two_stage_int4(contributions: list[torch.Tensor], node_size: int, begin: int = 0, cuts: Sequence[int] = (),
                    group: int = GROUP) -> torch.Tensor:
    """qgZ's reduction of one shard, explicitly: each rank's fp32 contribution (in rank order) int4 quantized and
    dequantized and summed within its node, then each node's sum again, summed across the nodes; a group starts
    at every cut (the shard begins at ``begin`` of the bucket the cuts are in)."""
    total = torch.zeros_like(contributions[0])
    for node in range(len(contributions) // node_size):
        partial = torch.zeros_like(contributions[0])
        for contribution in contributions[node * node_size:(node + 1) * node_size]:
            partial += _qdq_pieces(contribution, begin, cuts, 4, group)
        total += _qdq_pieces(partial, begin, cuts, 4, group)
    return total


def _bucket(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return (torch.randn(numel, generator=g) * (1 + rank)).to(dtype)


def collectives_worker(rank: int, world: int, node_size: int) -> dict:
    topo = build_topology(dist.group.WORLD, node_size)
    comm = _C.Comm(dist.group.WORLD, "hierarchical", "quantized", quantization_group_size=GROUP, node_size=node_size,
                   node_group=topo.node_group, cross_group=topo.cross_group)
    for seed, (shard, dtype) in enumerate([(1, torch.float32), (5, torch.bfloat16), (300, torch.float32),
                                           (1000, torch.bfloat16), (0, torch.float32)]):
        numel = shard * world
        # all-gather: every slot is dequantize(quantize(its owner's shard)), this rank's too
        bucket = _bucket(rank, numel, dtype, seed)
        comm.all_gather(bucket, seed, "weights").wait()
        for owner in range(world):
            expected = _qdq(_bucket(owner, numel, dtype, seed)[owner * shard:(owner + 1) * shard].float(), 8)
            assert torch.equal(bucket[owner * shard:(owner + 1) * shard], expected.to(dtype)), (owner, shard, dtype)
        # reduce-scatter: stage one sums the node's int4 contributions, stage two the nodes' int4 partials
        bucket = _bucket(rank, numel, dtype, seed + 50)
        comm.reduce_scatter(bucket, seed).wait()
        me = slice(rank * shard, (rank + 1) * shard)
        total = _two_stage_int4([_bucket(r, numel, dtype, seed + 50)[me].float() for r in range(world)], node_size)
        assert torch.equal(bucket[me], total.to(dtype)), (shard, dtype, bucket[me], total)
    # with cuts (where the bucket's parameters begin and end), groups also start at every cut in a shard; a
    # piece of odd length, a piece inside one group, and a cut on a shard's edge
    shard, dtype = 300, torch.bfloat16
    numel = shard * world
    cuts = sorted({0, 5, 131, 132, shard, shard + 77, numel - 9, numel})
    bucket = _bucket(rank, numel, dtype, 76)
    comm.all_gather(bucket, 76, "weights", cuts).wait()
    for owner in range(world):
        mine = slice(owner * shard, (owner + 1) * shard)
        expected = _qdq_pieces(_bucket(owner, numel, dtype, 76)[mine].float(), owner * shard, cuts, 8)
        assert torch.equal(bucket[mine], expected.to(dtype)), ("cuts", owner)
    bucket = _bucket(rank, numel, dtype, 77)
    comm.reduce_scatter(bucket, 77, cuts=cuts).wait()
    me = slice(rank * shard, (rank + 1) * shard)
    total = _two_stage_int4([_bucket(r, numel, dtype, 77)[me].float() for r in range(world)], node_size,
                            rank * shard, cuts)
    assert torch.equal(bucket[me], total.to(dtype)), "cuts"
    with pytest.raises(ValueError, match="cuts must be increasing"):
        comm.reduce_scatter(bucket, 78, cuts=[5, 5])
    with pytest.raises(ValueError, match="cuts must be increasing"):
        comm.all_gather(bucket, 78, "weights", [0, numel + 1])
    stats = {op: (s.algorithm_bytes, s.unquantized_bytes, s.backend_calls) for op, s in comm.stats().items()}
    return {"stats": stats}


@pytest.mark.parametrize("world,node_size", [(4, 2), (2, 1), (2, 2), (4, 4)])
def test_quantized_collectives_equal_explicitly_quantized_values(world, node_size):
    results = run_ranks(collectives_worker, world, node_size, timeout=180)
    for result in results:
        weights, reduce = result["stats"]["weights"], result["stats"]["reduce_scatter"]
        assert weights[0] < 0.55 * weights[1]  # int8 + scales against the bucket's own dtype
        assert reduce[0] < 0.35 * reduce[1]


# ---- the engine ---------------------------------------------------------------------------------------------
import zerocore  # noqa: E402
from torch import nn  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 24)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(24, 24), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(24, 40)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).mean(1)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _config(stage: int = 3, dtype: str = "fp32", **zeropp) -> dict:
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                    "zero_quantization_group_size": GROUP, "zero_node_size": 2, **zeropp}}
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    return config


def _train(engine, rank: int, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        tokens, target = torch.randint(0, 40, (8, 6), generator=g), torch.randint(0, 40, (8,), generator=g)
        loss = nn.functional.cross_entropy(engine(tokens).float(), target)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_worker(rank: int, world: int, dtype: str, zeropp: dict, steps: int) -> dict:
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), _config(3 if zeropp.get("stage", 3) == 3 else 2, dtype,
                                                **{k: v for k, v in zeropp.items() if k != "stage"}))
    for comm in engine.comms.all().values():
        comm.set_logging(True)
    losses = _train(engine, rank, steps)
    state = engine.full_state_dict(rank0_only=False)
    logs = {name: list(comm.log()) for name, comm in engine.comms.all().items()}
    per_comm = {name: {op: (st.algorithm_bytes, st.unquantized_bytes) for op, st in comm.stats().items()}
                for name, comm in engine.comms.all().items()}
    return {"per_comm": per_comm, "losses": losses, "state": {k: v.float().flatten().tolist() for k, v in state.items()},
            "report": engine.comm_report(), "logs": logs}


_RUNS: dict[str, list] = {}


def _train_run(world: int, dtype: str, zeropp: dict, steps: int) -> list:
    """run_ranks(train_worker, ...), each distinct run once per session (tests share the unquantized ones)."""
    key = repr((world, dtype, sorted(zeropp.items()), steps))
    if key not in _RUNS:
        _RUNS[key] = run_ranks(train_worker, world, dtype, zeropp, steps, timeout=240)
    return _RUNS[key]


def test_hpz_changes_no_value_and_keeps_backward_gathers_inside_the_partition():
    base = _train_run(4, "bf16", {}, 4)
    hpz = _train_run(4, "bf16", {"zero_hpz_partition_size": 2}, 4)
    for a, b in zip(base, hpz):  # the partition holds the very values the forward gathered
        assert a["losses"] == b["losses"] and a["state"] == b["state"]
    for result in hpz:
        collectives = result["report"]["collectives"]
        assert "all_gather_backward" not in collectives, collectives
        assert collectives["hpz_partition:all_gather_backward"]["calls"] > 0
        assert not any(entry.startswith("all_gather_backward") for entry in result["logs"]["global"])
        assert all(entry.startswith("all_gather_backward") for entry in result["logs"]["hpz_partition"])


def test_qwz_gathers_int8_and_the_forward_sees_the_dequantized_shards():
    plain = run_ranks(train_worker, 2, "bf16", {}, 4, timeout=240)
    qwz_config = {"zero_quantized_weights": True, "zero_quantization_group_size": 256}
    qwz = run_ranks(train_worker, 2, "bf16", qwz_config, 4, timeout=240)
    both = run_ranks(train_worker, 2, "bf16", {**qwz_config, "zero_hpz_partition_size": 2}, 4, timeout=240)
    for result in qwz:
        c = result["report"]["collectives"]
        weights = result["per_comm"]["weights"]  # the quantized gathers (state dicts gather exact values)
        sent = sum(weights[k][0] for k in ("all_gather_forward", "all_gather_backward"))
        bf16 = sum(weights[k][1] for k in ("all_gather_forward", "all_gather_backward"))
        assert sent <= 0.52 * bf16, (sent, bf16, c)
        assert result["report"]["algorithms"]["parameter_all_gather"] == "quantized"
    # quantized weights change the losses a little, not the training
    for a, b in zip(plain, qwz):
        assert a["losses"] != b["losses"]
        assert all(abs(x - y) < 0.05 * abs(x) for x, y in zip(a["losses"], b["losses"]))
    # hpZ on top gathers the forward's dequantized values again: the same run bit for bit
    for a, b in zip(qwz, both):
        assert a["losses"] == b["losses"] and a["state"] == b["state"]


def quantized_forward_values(engine, exact: dict[str, torch.Tensor], world: int, group: int,
                             rank: int | None = None) -> dict[str, torch.Tensor]:
    """What qwZ's forward must see of each unit's parameters (flattened, by the unit's names for them): the
    unit's flat buffer of the ``exact`` values, each rank's shard quantized piece by piece (a group starts at
    every parameter). With ``rank``, also checks that rank's shard of the exact values is its fp32 master."""
    expected = {}
    for unit in engine.stage3.units:
        buffer = unit.buffer
        flat = torch.zeros(buffer.full.numel())
        for name, param, offset in zip(unit.spec.param_names, buffer.params, buffer.offsets):
            flat[offset:offset + param.numel()] = exact[name].flatten()
        shard = flat.numel() // world
        if rank is not None:
            (mine,) = buffer.optimizer_shards  # the state dict is exact: this rank's part of it is its master
            assert torch.equal(flat[rank * shard:(rank + 1) * shard], mine.master)
        cuts = sorted({c for p, o in zip(buffer.params, buffer.offsets) for c in (o, o + p.numel())})
        values = torch.cat([_qdq_pieces(flat[r * shard:(r + 1) * shard], r * shard, cuts, 8, group)
                            for r in range(world)])
        for name, param, offset in zip(unit.spec.param_names, buffer.params, buffer.offsets):
            expected[name] = values[offset:offset + param.numel()]
    return expected


def forward_values_worker(rank: int, world: int, group: int) -> bool:
    """Inside the forward, every parameter equals dequantize(quantize(its owner's shard)) of the unit's flat
    buffer, in groups that start at each parameter's first element (``group`` larger than the layout's
    alignment: a group would otherwise hold a bias and the next weight): the communication adds no error
    beyond the quantization."""
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), _config(3, "fp32", zero_quantized_weights=True,
                                                zero_quantization_group_size=group))
    _train(engine, rank, 1)  # units still whole from initialize have released: every one is gathered anew
    with recorded_forward_values(engine.module, lambda m: isinstance(m, (nn.Linear, nn.Embedding))) as seen:
        with torch.no_grad():
            engine(torch.randint(0, 40, (2, 3)))
    exact = engine.full_state_dict(rank0_only=False)  # the exact values, never the quantized ones
    masters = {}
    for unit in engine.stage3.units:
        for shard in unit.buffer.optimizer_shards:
            masters[id(shard)] = shard.master.clone()
    expected = quantized_forward_values(engine, exact, world, group, rank)
    for name, value in expected.items():
        assert torch.equal(seen[name].flatten(), value), name
    state = engine.full_state_dict(rank0_only=False)
    assert all(torch.equal(state[k], v) for k, v in exact.items())
    with zerocore.gathered(list(engine.module.parameters()), modifier_rank=0):
        pass  # nothing written: the masters keep their bits (the gathered values were exact)
    for unit in engine.stage3.units:
        for shard in unit.buffer.optimizer_shards:
            assert torch.equal(shard.master, masters[id(shard)])
    return True


@pytest.mark.parametrize("group", [GROUP, 256])
def test_qwz_forward_sees_exactly_the_quantized_shards(group):
    assert all(run_ranks(forward_values_worker, 2, group, timeout=120))


def test_qgz_reduces_int4_across_two_nodes_and_trains_like_the_exact_reduction():
    plain = run_ranks(train_worker, 4, "bf16", {"stage": 2}, 4, timeout=240)
    qgz = run_ranks(train_worker, 4, "bf16", {"stage": 2, "zero_quantized_gradients": True}, 4, timeout=240)
    for a, b in zip(plain, qgz):
        assert all(abs(x - y) < 0.05 * abs(x) for x, y in zip(a["losses"], b["losses"]))
        reduce = b["report"]["collectives"]["reduce_scatter"]
        bf16_ring = reduce["logical_elements"] * 2 * 3 / 4  # what a bf16 reduce-scatter sends per rank at world 4
        assert reduce["algorithm_bytes"] <= 0.30 * bf16_ring, reduce
        assert b["report"]["algorithms"]["reduce_scatter"] == "hierarchical"


def qgz_gradients_worker(rank: int, world: int, stage: int) -> list[str]:
    """The gradients a qgZ step applies (safe_get_full_grad, between backward and step) against every rank's
    local gradients from an unsharded copy, prescaled by 1 / world as the reducer does and reduced explicitly:
    per bucket and shard, int4 quantize-dequantize and sum within each node, then again across the nodes, a
    group starting at every parameter. Several buckets per buffer; at stage 3 one buffer per unit."""
    from zerocore.deepspeed.utils import safe_get_full_grad

    torch.manual_seed(0)
    model = Net()
    local = copy.deepcopy(model)
    group = 256  # above the layout's 64-element alignment, so that groups would span parameters without the cuts
    engine = zerocore.initialize(model, _config(stage, "fp32", zero_quantized_gradients=True, reduce_bucket_size=700,
                                                zero_quantization_group_size=group))
    g = torch.Generator().manual_seed(rank)
    tokens, target = torch.randint(0, 40, (8, 6), generator=g), torch.randint(0, 40, (8,), generator=g)
    nn.functional.cross_entropy(local(tokens), target).backward()
    engine.backward(nn.functional.cross_entropy(engine(tokens).float(), target))
    names, sizes = zip(*[(n, p.numel()) for n, p in local.named_parameters()])
    every = [torch.empty(sum(sizes)) for _ in range(world)]
    dist.all_gather(every, torch.cat([p.grad.flatten() for p in local.parameters()]))
    local_grads = [dict(zip(names, flat.split(sizes))) for flat in every]
    node_size = 2
    failures = []
    for buffer in engine.buffers:
        layout = buffer.layout
        flats = []
        for grads in local_grads:
            flat = torch.zeros(layout.total_size)
            for name, param, offset in zip(buffer.names, buffer.params, buffer.offsets):
                flat[offset:offset + param.numel()] = grads[name] / world
            flats.append(flat)
        expected = torch.zeros(layout.total_size)
        for bucket, cuts in enumerate(layout.bucket_cuts()):
            start = layout.buckets[bucket].flat_start
            for owner in range(world):
                a, e = layout.shard_range(bucket, owner)
                if a == e:
                    continue
                expected[a:e] = _two_stage_int4([flat[a:e] for flat in flats], node_size, a - start, cuts, group)
        if layout.num_buckets < 2 and stage == 2:
            failures.append(f"{buffer.label}: one bucket, the test wants several")
        for name, param, offset in zip(buffer.names, buffer.params, buffer.offsets):
            grad = safe_get_full_grad(param)
            if not torch.equal(grad.flatten(), expected[offset:offset + param.numel()]):
                far = float((grad.flatten() - expected[offset:offset + param.numel()]).abs().max())
                failures.append(f"{name}: not the explicit two-stage int4 reduction (max difference {far:.3g})")
    engine.step()
    return failures


@pytest.mark.parametrize("stage", [2, 3])
def test_qgz_step_applies_exactly_the_explicitly_quantized_reduction(stage):
    for failures in run_ranks(qgz_gradients_worker, 4, stage, timeout=180):
        assert not failures, "\n".join(failures)


def test_all_three_at_stage_3_train_like_none():
    plain = _train_run(4, "bf16", {}, 4)
    zeropp = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
    both = _train_run(4, "bf16", zeropp, 4)
    for a, b in zip(plain, both):
        assert all(abs(x - y) < 0.05 * abs(x) for x, y in zip(a["losses"], b["losses"]))
        algorithms = b["report"]["algorithms"]
        assert (algorithms["reduce_scatter"], algorithms["parameter_all_gather"]) == ("hierarchical", "quantized")
        assert "all_gather_backward" not in b["report"]["collectives"]

def state_read_worker(rank: int, world: int, read: str | None, directory: str) -> dict:
    """qwZ at stage 3, bf16: two steps, a read of the state (or none), two more steps."""
    torch.manual_seed(0)
    model = Net()
    engine = zerocore.initialize(model, _config(3, "bf16", zero_quantized_weights=True))
    losses = _train(engine, rank, 2)
    if read == "full_state_dict":
        engine.full_state_dict()
    elif read == "gathered":
        with zerocore.gathered([model.head.weight, model.blocks[0][0].weight]):
            pass
    elif read == "save_checkpoint":
        engine.save_checkpoint(directory)
    losses += _train(engine, rank, 2)
    return {"losses": losses, "state": {k: v.float().tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}}


def resume_worker(rank: int, world: int, directory: str) -> dict:
    torch.manual_seed(5)
    engine = zerocore.initialize(Net(), _config(3, "bf16", zero_quantized_weights=True))
    engine.load_checkpoint(directory)
    _train(engine, rank, 2)  # (_train's batches depend on the step within the call: the saving run's last two)
    return {"state": {k: v.float().tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}}


def test_qwz_trains_alike_whether_or_not_the_state_was_read_between_steps(tmp_path):
    """An exact read (full_state_dict, gathered(), save_checkpoint) leaves the persistent root gathered with its
    exact values; the next forward must still compute with the quantized ones, or reading the state would
    change the training and a resumed run would not be the run that saved it."""
    plain = run_ranks(state_read_worker, 2, None, str(tmp_path))[0]
    for read in ("full_state_dict", "gathered", "save_checkpoint"):
        got = run_ranks(state_read_worker, 2, read, str(tmp_path))[0]
        assert got["losses"] == plain["losses"], read
        assert got["state"] == plain["state"], read
    resumed = run_ranks(resume_worker, 2, str(tmp_path))[0]  # the saving run's last two steps, from its checkpoint
    assert resumed["state"] == plain["state"]



@pytest.mark.parametrize("zeropp,message", [
    ({"stage": 2, "zero_quantized_weights": True}, "qwZ works on the parameter gathers of stage 3"),
    ({"stage": 2, "zero_hpz_partition_size": 2}, "hpZ works on the parameter gathers of stage 3"),
    ({"stage": 1, "zero_quantized_gradients": True}, "qgZ quantizes the gradient reduce-scatter of stages 2-3"),
    ({"zero_quantization_group_size": 63}, "must be even"),
])
def test_zeropp_config_errors_name_the_key(zeropp, message):
    config = _config(zeropp.pop("stage", 3), **zeropp)
    with pytest.raises(ValueError, match=message):
        zerocore.ZeroConfig.from_deepspeed(config)


@pytest.mark.parametrize("zeropp,message", [
    ({"zero_hpz_partition_size": 3, "zero_node_size": 2}, r"zero_hpz_partition_size \(3\) must divide .* 4 ranks"),
    ({"zero_quantized_gradients": True, "zero_node_size": 3}, "a node of 3 ranks does not divide"),
])
def test_the_estimate_refuses_partitions_that_do_not_divide_the_world_as_initialize_does(zeropp, message):
    with pytest.raises(ValueError, match=message):
        zerocore.estimate_memory(Net(), _config(3, "bf16", **zeropp), 4)


def hpz_not_dividing_worker(rank: int, world: int) -> str:
    with pytest.raises(ValueError) as raised:
        zerocore.initialize(Net(), _config(3, "bf16", zero_hpz_partition_size=3, zero_node_size=2))
    return str(raised.value)


def test_an_hpz_partition_that_does_not_divide_the_world_is_named_at_initialize():
    for message in run_ranks(hpz_not_dividing_worker, 4):  # it named the node size, which was fine
        assert "zero_hpz_partition_size (3) must divide" in message, message


def hpz_memory_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    config = _config(3, "bf16", zero_hpz_partition_size=2)
    planned = zerocore.estimate_memory(Net(), config, world)["step"]["hpz_secondary_peak"]
    engine = zerocore.initialize(Net(), config)
    at_rest = engine.memory_report()["bytes"]["hpz_secondary"]
    tokens = torch.randint(0, 40, (4, 6))
    loss = engine(tokens).float().sum()
    between = engine.memory_report()["bytes"]["hpz_secondary"]
    engine.backward(loss)
    engine.step()
    after = engine.memory_report()["bytes"]["hpz_secondary"]
    with torch.no_grad():  # an evaluation: no backward to keep slices for
        engine(tokens)
    evaluated = engine.memory_report()["bytes"]["hpz_secondary"]
    full = sum(unit.buffer.full.numel() for unit in engine.stage3.units) * 2  # bf16
    return {"planned": planned, "at_rest": at_rest, "evaluated": evaluated, "between": between, "after": after,
            "half": full // 2}


def test_hpz_slices_are_in_the_memory_report_and_the_estimate():
    for r in run_ranks(hpz_memory_worker, 2, timeout=120):
        assert r["at_rest"] == 0 and r["after"] == 0 and r["evaluated"] == 0, r
        assert r["between"] == r["half"] == r["planned"], r


class Gained(nn.Module):
    """A layer and a gain whose gradient is 1e-4 of the layer's: with one int4 scale for both, the gain's would
    round to zero."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.zeros(8))  # first: the layer's weight follows it in the gradient bucket
        self.layer = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer(x)
        return torch.cat([h[:, :8] * (1 + 1e-4 * self.gain), h[:, 8:]], dim=1)


def gain_worker(rank: int, world: int, stage: int, quantized: bool) -> list[float]:
    torch.manual_seed(0)
    model = Gained()
    # groups of 256 elements: wider than the layout's alignment, so a group spans the gain and the weight
    engine = zerocore.initialize(model, _config(stage, "fp32", zero_quantized_gradients=quantized,
                                                zero_quantization_group_size=256))
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + rank)
        engine.backward(nn.functional.mse_loss(engine(torch.randn(16, 24, generator=g)), torch.randn(16, 24, generator=g)))
        engine.step()
    with zerocore.gathered([model.gain]):
        return model.gain.detach().clone().tolist()


@pytest.mark.parametrize("stage", [2, 3])
def test_qgz_gives_a_parameter_its_own_scales(stage):
    """Note [Quantized collectives]: a parameter whose gradients are small beside its neighbour's in the bucket
    trains under qgZ (each parameter's slot starts its own quantization groups), as without quantization: Adam
    moves it by about lr per step whatever its gradients' size. It stayed at 0 when they shared a scale."""
    exact = run_ranks(gain_worker, 4, stage, False, timeout=180)[0]
    quantized = run_ranks(gain_worker, 4, stage, True, timeout=180)[0]
    assert all(abs(value) > 1e-3 for value in exact)
    for ours, reference in zip(quantized, exact):
        assert ours * reference > 0 and abs(ours - reference) < 0.5 * abs(reference), (quantized, exact)


class OneInfNet(Net):
    """Net plus a small parameter whose gradient is 0 except one element made inf on ``poison_rank`` at
    ``poison_step``: a single non-finite gradient element in a bucket of finite ones."""

    def __init__(self, poison_rank: int, poison_step: int) -> None:
        super().__init__()
        self.extra = nn.Parameter(torch.zeros(5))
        self.poison_rank, self.poison_step, self.calls = poison_rank, poison_step, 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        extra = self.extra * 1
        if self.calls == self.poison_step and dist.get_rank() == self.poison_rank:
            extra.register_hook(lambda g: g.index_fill(0, torch.tensor([2]), float("inf")))
        self.calls += 1
        return super().forward(tokens) + extra.sum() * 0


def overflow_worker(rank: int, world: int, stage: int, zeropp: dict) -> dict:
    torch.manual_seed(0)
    config = _config(stage, "fp16", **zeropp)
    config["fp16"].update({"initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 1})
    engine = zerocore.initialize(OneInfNet(poison_rank=3, poison_step=1), config)
    applied, scales, states = [], [], []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        tokens, target = torch.randint(0, 40, (8, 6), generator=g), torch.randint(0, 40, (8,), generator=g)
        engine.backward(nn.functional.cross_entropy(engine(tokens).float(), target))
        engine.step()
        applied.append(engine.was_step_applied())
        scales.append(engine.loss_scale)
        states.append({k: v.float().tolist() for k, v in engine.full_state_dict(rank0_only=False).items()})
    return {"applied": applied, "scales": scales, "states": states,
            "reduce_scatter": engine.comm_report()["algorithms"]["reduce_scatter"]}


@pytest.mark.parametrize("stage", [2, 3])
def test_one_inf_gradient_element_skips_the_step_on_every_rank_under_qgz(stage):
    """fp16: one rank's one inf gradient element sits in a quantization group of finite ones. qgZ must not
    quantize it into a plausible number (Note [Quantized collectives]): every rank skips that step, halves the
    loss scale and keeps its parameters, exactly as the unquantized reduction does."""
    exact = run_ranks(overflow_worker, 4, stage, {}, timeout=180)
    quantized = run_ranks(overflow_worker, 4, stage, {"zero_quantized_gradients": True}, timeout=180)
    assert {r["reduce_scatter"] for r in quantized} == {"hierarchical"}
    for run in (exact, quantized):
        for result in run:
            assert result["applied"] == [True, False, True]
            assert result["scales"] == [256.0, 128.0, 128.0]
            assert result["states"][1] == result["states"][0]  # the skipped step changed nothing
            assert result["states"][2] != result["states"][1]
            assert result["states"] == run[0]["states"]  # every rank holds the same model
