"""The engine on a CUDA device with NCCL (world size 1): stages 1-3 within the fp32 reference's rounding noise
(tests/_parity.py), bf16 training stays finite, and the reports run. Skipped without a GPU; run by
bench/gpu_check.sh on a lent device machine."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

import zerocore
from _dist import free_port
from _models import batch, build, loss_fn
from _parity import ReferencePair, as_dtype

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module", autouse=True)
def nccl_group():
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def make_config(stage: int, weight_decay: float = 0.01, **extra) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": weight_decay}},
            "zero_optimization": zero, **extra}


def transformer_losses(engine: zerocore.Engine, steps: int) -> list[float]:
    """``steps`` steps of the "transformer" test model on seeded batches; their losses."""
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        inputs, target = (t.cuda() for t in batch("transformer", generator))
        loss = loss_fn("transformer", engine(inputs), target)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_against_the_reference(name: str, config: dict, label: str, weight_decay: float = 0.01,
                                steps: int = 6) -> zerocore.Engine:
    """Trains model ``name`` on the GPU under ``config`` and a torch AdamW ReferencePair (same lr, weight decay
    and clipping) side by side: every step's loss equal within fp32 rounding, the final state within the
    reference's noise. Returns the engine, still open."""
    model = build(name).cuda()
    clip = config.get("gradient_clipping", 0.0)
    reference = ReferencePair(copy.deepcopy(model), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2,
                                                                                weight_decay=weight_decay))
    engine = zerocore.initialize(model, config)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        inputs, target = (t.cuda() for t in batch(name, generator))
        loss = loss_fn(name, engine(inputs), target)
        engine.backward(loss)
        engine.step()
        ref_loss, _ = reference.train_step(
            lambda module, dtype: loss_fn(name, module(as_dtype(inputs, dtype)), target), clip=clip)
        torch.testing.assert_close(loss.detach().float(), ref_loss, rtol=1e-5, atol=1e-6)
    reference.assert_matches(engine.full_state_dict(rank0_only=False), label=label)
    return engine


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", ["mlp", "transformer", "odd"])
def test_fp32_matches_the_reference_on_cuda(stage, name):
    # "odd" has an unused layer: left alone as torch AdamW leaves a parameter without a gradient, weight decay
    # notwithstanding (Note [Parameters without gradients])
    weight_decay = 0.1 if name == "odd" else 0.01
    config = make_config(stage, weight_decay, gradient_clipping=1.0)
    engine = train_against_the_reference(name, config, f"stage {stage} {name} cuda", weight_decay)
    engine.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_trains_and_stays_finite_on_cuda(stage):
    model = build("transformer").cuda()
    engine = zerocore.initialize(model, make_config(stage, bf16={"enabled": True}))
    generator = torch.Generator().manual_seed(0)
    inputs, target = (t.cuda() for t in batch("transformer", generator, size=16))
    losses = []
    for _ in range(30):  # one fixed batch: the loss must fall
        loss = loss_fn("transformer", engine(inputs), target)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < 0.7 * losses[0], losses
    state = engine.full_state_dict(rank0_only=False)
    assert all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())
    assert engine.memory_report() and engine.comm_report()  # the reports run on CUDA too
    allocator = engine.memory_report()["allocator"]  # Note [Allocator pressure]: the real counters
    assert allocator["reserved_bytes"] >= allocator["allocated_bytes"] > 0 and allocator["retries_in_steps"] >= 0
    engine.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpoint_resume_is_bit_exact_on_cuda(stage, tmp_path):
    def train(engine, first: int, steps: int) -> list[float]:
        losses = []
        for step in range(first, first + steps):
            inputs, target = (t.cuda() for t in batch("transformer", torch.Generator().manual_seed(step)))
            loss = loss_fn("transformer", engine(inputs), target)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    torch.manual_seed(0)
    engine = zerocore.initialize(build("transformer").cuda(), make_config(stage, bf16={"enabled": True}))
    train(engine, 0, 3)
    engine.save_checkpoint(tmp_path)
    expected = train(engine, 3, 3)
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    fresh = zerocore.initialize(build("transformer", seed=7).cuda(), make_config(stage, bf16={"enabled": True}))
    fresh.load_checkpoint(tmp_path)
    assert train(fresh, 3, 3) == expected
    after = fresh.full_state_dict(rank0_only=False)
    assert all(torch.equal(after[k], state[k]) for k in state)
    fresh.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_optimizer_matches_the_reference_on_cuda(offload, stage, tmp_path):
    """offload_optimizer on a GPU: the gradients come to the host, the CPU Adam updates the host state (or
    the NVMe file's sub-groups), the parameters go back; fp32 training stays within the reference's noise."""
    section = {"device": offload, "nvme_path": str(tmp_path)} if offload == "nvme" else {"device": "cpu"}
    config = make_config(stage, gradient_clipping=1.0, aio={"thread_count": 2})
    config["zero_optimization"].update(offload_optimizer=section, sub_group_size=5000)
    engine = train_against_the_reference("transformer", config, f"stage {stage} {offload} cuda")
    assert engine.memory_report()["optimizer_placement"] == offload
    engine.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_and_cpu_offload_are_bitwise_equal_on_cuda_bf16(stage, tmp_path):
    """Both run the same CPU kernel on the same elements: bf16 training gives the same bits. The host's
    copies run on two streams of their own (Note [Offload copies]), NVMe's sub-groups copy on the current
    stream: a missing wait between the streams would read gradients or parameters before they landed."""
    from zerocore._host_copies import StreamCopies

    results = []
    for offload in ("cpu", "nvme"):
        section = {"device": offload, "nvme_path": str(tmp_path)} if offload == "nvme" else {"device": "cpu"}
        config = make_config(stage, bf16={"enabled": True})
        config["zero_optimization"].update(offload_optimizer=section, sub_group_size=3000)
        engine = zerocore.initialize(build("transformer").cuda(), config)
        results.append((transformer_losses(engine, 4), engine.full_state_dict(rank0_only=False)))
        assert isinstance(engine.optimizer_state._copies, StreamCopies) == (offload == "cpu")
        engine.close()
    (losses_cpu, state_cpu), (losses_nvme, state_nvme) = results
    assert losses_cpu == losses_nvme
    assert all(torch.equal(state_cpu[k], state_nvme[k]) for k in state_cpu)


@pytest.mark.parametrize("optimizer", ["none", "cpu", "nvme"])
def test_parameter_shards_on_nvme_match_the_reference_on_cuda(optimizer, tmp_path):
    """offload_param: nvme on a GPU (Note [NVMe parameter shards]): shards go to the file and come back into
    the gathered CUDA buffer; fp32 training stays within the reference's noise, with the optimizer state in
    GPU memory, on the host, or on NVMe too."""
    config = make_config(3, gradient_clipping=1.0, aio={"thread_count": 2})
    zero = config["zero_optimization"]
    zero["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}
    if optimizer != "none":
        section = {"device": optimizer, "nvme_path": str(tmp_path)} if optimizer == "nvme" else {"device": "cpu"}
        zero.update(offload_optimizer=section, sub_group_size=5000)
    engine = train_against_the_reference("transformer", config, f"stage 3 params on nvme, optimizer {optimizer}")
    report = engine.memory_report()
    assert report["bytes"]["params"] == 0 and report["nvme"]["param_file_bytes"] > 0
    assert report["nvme"]["param_reads_ahead_used"] > 0
    engine.close()


@pytest.mark.parametrize("dtype,optimizer", [("fp32", "none"), ("bf16", "none"), ("bf16", "cpu")])
def test_parameter_shards_in_host_memory_train_bitwise_like_on_the_gpu(dtype, optimizer):
    """offload_param: cpu on a GPU (Note [Host parameter shards]): every shard lives in pinned host memory
    and comes back into the gathered CUDA buffer; the losses and the final state are bit for bit those of
    the shards kept in GPU memory, the estimate plans the bytes memory_report() shows."""
    results = []
    for offload in (False, True):
        config = make_config(3, gradient_clipping=1.0)
        if dtype == "bf16":
            config["bf16"] = {"enabled": True}
        if optimizer != "none":
            config["zero_optimization"]["offload_optimizer"] = {"device": optimizer}
        if offload:
            config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        model = build("transformer").cuda()
        engine = zerocore.initialize(model, config)
        at_init = engine.memory_report()["bytes"]
        planned = zerocore.estimate_memory(build("transformer").cuda(), config, 1)["bytes"]
        losses = transformer_losses(engine, 5)
        results.append((losses, engine.full_state_dict(rank0_only=False), engine.memory_report()["bytes"],
                        planned, at_init))
        engine.close()
    (want_losses, want_state, want_bytes, *_), (got_losses, got_state, got_bytes, planned, at_init) = results
    assert got_losses == want_losses
    for name, value in want_state.items():
        assert torch.equal(got_state[name], value), name
    assert got_bytes["params"] == 0 and got_bytes["param_offload"] == want_bytes["params"] > 0
    assert planned == at_init, (planned, at_init)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_steady_state_step_syncs_the_host_once(stage):
    """Issue 8 item 6 on the device: a steady-state forward never waits for the GPU (stage 3's gathers and
    divergence tags included); the backward syncs once (its outcome exchange, Note [Backward outcome], at
    every stage since stage 3 plays a one-rank failure out) and step() once (its verdicts' all-reduce read on
    the host), and the
    engine's host_syncs counts exactly those. torch.cuda.set_sync_debug_mode reports every synchronizing
    call with the Python line that made it."""
    model = build("transformer").cuda()
    engine = zerocore.initialize(model, make_config(stage, bf16={"enabled": True}))
    generator = torch.Generator().manual_seed(0)
    inputs, target = (t.cuda() for t in batch("transformer", generator, size=16))
    for _ in range(3):  # the order is recorded, buffers exist
        engine.backward(loss_fn("transformer", engine(inputs), target))
        engine.step()
    torch.cuda.synchronize()
    syncs: dict[str, list[str]] = {}
    counted = engine.host_syncs
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            phases = (("forward", lambda: loss_fn("transformer", engine(inputs), target)),
                      ("backward", lambda: engine.backward(loss)), ("step", engine.step))
            loss = None
            for phase, run in phases:
                seen = len(caught)
                result = run()
                loss = result if phase == "forward" else loss
                syncs[phase] = [f"{w.filename}:{w.lineno}" for w in caught[seen:]
                                if "synchronizing" in str(w.message)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = {"forward": 0, "backward": 1, "step": 1}
    assert {phase: len(lines) for phase, lines in syncs.items()} == expected, syncs
    assert engine.host_syncs - counted == sum(expected.values())
    engine.close()



@pytest.mark.parametrize("stage, offload", [(1, "none"), (3, "none"), (1, "cpu"), (2, "nvme")])
def test_a_write_through_data_is_kept_on_cuda(stage, offload, tmp_path):
    """Note [Writes through .data]: on the device the master takes such writes without a host sync (the
    steady-state test above counts the syncs with these merges in place). Stage 3: a parameter of a unit
    kept whole between backward and step; the sharded ones refuse .data by name. Offloaded, the master on the
    host takes them from the host copy of the shard the step makes anyway."""
    model = build("transformer").cuda()
    config = make_config(stage, bf16={"enabled": True})
    if offload != "none":
        config["zero_optimization"]["offload_optimizer"] = {"device": offload, "nvme_path": str(tmp_path)}
    engine = zerocore.initialize(model, config)
    generator = torch.Generator().manual_seed(0)
    inputs, target = (t.cuda() for t in batch("transformer", generator, size=16))
    for _ in range(2):
        engine.backward(loss_fn("transformer", engine(inputs), target))
        engine.step()
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0  # an update of zero: the step must keep what was written
    engine.backward(loss_fn("transformer", engine(inputs), target))
    written = {}
    for name, param in model.named_parameters():
        try:
            data = param.data
        except RuntimeError:
            assert stage == 3
            continue
        value = torch.linspace(-1, 1, param.numel(), device="cuda").view_as(data).to(data.dtype)
        data.copy_(value)
        written[name] = value.cpu()
    assert written
    engine.step()
    state = engine.full_state_dict(rank0_only=False)
    for name, value in written.items():
        assert torch.equal(state[name], value), name
    engine.close()


@pytest.mark.parametrize("stage,offload", [(2, None), (2, "cpu"), (3, "cpu"), (3, "nvme")])
def test_full_parameter_state_round_trips_on_cuda(stage, offload, tmp_path):
    """safe_get_full_* / safe_set_full_* (Note [Full parameter state]) with the state on the GPU, on the host
    beside it, or on NVMe: the gradient the step uses, exact fp32 bits back, the parameter its rounding."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif offload == "nvme":
        zero.update(offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)}, sub_group_size=1000)
    engine = zerocore.initialize(build("transformer").cuda(), {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999]}}, "bf16": {"enabled": True},
        "zero_optimization": zero})
    generator = torch.Generator().manual_seed(0)
    inputs, target = (t.cuda() for t in batch("transformer", generator))
    engine.backward(loss_fn("transformer", engine(inputs), target))
    name, param = next((n, p) for n, p in engine.module.named_parameters() if p.requires_grad and p.dim() == 2)
    grad = zerocore.safe_get_full_grad(param)
    assert grad.device.type == "cuda" and grad.dtype == torch.float32 and grad.abs().sum() > 0
    engine.step()
    torch.testing.assert_close(zerocore.safe_get_full_optimizer_state(param, "exp_avg"), 0.1 * grad,
                               rtol=1e-6, atol=1e-12)
    value = torch.randn(param.shape, device="cuda") * (1 + 2**-20)
    zerocore.safe_set_full_fp32_param(param, value)
    assert torch.equal(zerocore.safe_get_full_fp32_param(param), value)
    assert torch.equal(engine.full_state_dict(rank0_only=False)[name], value.to(torch.bfloat16).cpu())
    engine.close()


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_local_master_write_survives_the_step_on_cuda(offload):
    """safe_set_local_fp32_param (Note [Local parameter state]) at stage 3 on a GPU: the root unit is whole
    when it is written, and on a GPU the step merges a gathered unit into its shard unconditionally, which
    must not undo the write (``shard_ahead_of_full``); with lr 0 the parameter is then the new master's
    rounding."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    engine = zerocore.initialize(build("transformer").cuda(), {
        "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.0}}, "bf16": {"enabled": True},
        "zero_optimization": zero})
    generator = torch.Generator().manual_seed(0)
    inputs, target = (t.cuda() for t in batch("transformer", generator))
    engine.backward(loss_fn("transformer", engine(inputs), target))
    for name, param in engine.module.named_parameters():
        local = zerocore.safe_get_local_fp32_param(param)
        assert local.device.type == "cuda"
        assert torch.equal(zerocore.safe_get_local_grad(param), zerocore.safe_get_full_grad(param).reshape(-1))
        zerocore.safe_set_local_fp32_param(param, local * 0.5 + 0.25)
    expected = {name: (zerocore.safe_get_full_fp32_param(p)) for name, p in engine.module.named_parameters()}
    engine.step()
    whole = engine.full_state_dict(rank0_only=False)
    for name, value in expected.items():
        assert torch.equal(whole[name], value.to(torch.bfloat16).cpu()), name
    engine.close()


@pytest.mark.parametrize("stage,offload", [(2, None), (3, None), (3, "cpu")])
def test_hf_weights_load_into_gpu_shards(stage, offload, tmp_path):
    """engine.load_hf_weights (Note [Loading Hugging Face weights]) with the shards on the GPU (or the
    master on the host beside them): every tensor the file's, the masters exactly its fp32 values."""
    from zerocore._safetensors_io import write_tensors

    torch.manual_seed(1)
    source = build("transformer")
    weights = {k: v.to(torch.bfloat16).contiguous() for k, v in source.state_dict().items()}
    write_tensors(str(tmp_path / "model.safetensors"), weights)
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    torch.manual_seed(2)
    engine = zerocore.initialize(build("transformer").cuda(), {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "bf16": {"enabled": True}, "zero_optimization": zero})
    result = engine.load_hf_weights(tmp_path)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    whole = engine.full_state_dict(rank0_only=False)
    for name, value in weights.items():
        assert torch.equal(whole[name], value.to(whole[name].dtype)), name
    for name, param in engine.module.named_parameters():
        assert torch.equal(zerocore.safe_get_full_fp32_param(param).cpu(), weights[name].float()), name
    generator = torch.Generator().manual_seed(0)
    inputs, target = (t.cuda() for t in batch("transformer", generator))
    engine.backward(loss_fn("transformer", engine(inputs), target))
    engine.step()
    engine.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_compile_with_inductor_trains_as_eager_on_cuda(stage):
    """engine.compile() with the default backend (inductor, real GPU kernels): every step's loss as the eager
    engine's within fp32 reordering, and at stage 3 each block compiled, the hooks outside."""
    runs = {}
    for how in ("eager", "compiled"):
        engine = zerocore.initialize(build("transformer").cuda(), make_config(stage, gradient_clipping=1.0))
        if how == "compiled":
            engine.compile()
            assert engine.is_compiled and (engine._compiled_modules == [""]) == (stage < 3), engine._compiled_modules
        runs[how] = transformer_losses(engine, 6)
        engine.close()
    torch.testing.assert_close(torch.tensor(runs["compiled"]), torch.tensor(runs["eager"]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_model_moved_off_the_gpu_is_refused_at_its_next_forward_and_trains_on_once_back(stage):
    """``model.cpu()`` after initialize (to evaluate on the host, to free the GPU) moves stages 1-2's
    parameters off the engine's storage: the next forward raises naming the parameter and both devices, with
    nothing changed; moved back with ``.cuda()``, training goes on as if the model had never left."""
    uninterrupted = zerocore.initialize(build("transformer").cuda(), make_config(stage))
    expected = transformer_losses(uninterrupted, 3)
    want = uninterrupted.full_state_dict(rank0_only=False)
    uninterrupted.close()
    model = build("transformer").cuda()
    engine = zerocore.initialize(model, make_config(stage))
    losses = transformer_losses(engine, 1)
    model.cpu()
    with pytest.raises(RuntimeError, match=r"parameter '.*' is on cpu but zerocore holds it on cuda"):
        engine(torch.zeros(1))
    model.cuda()
    generator = torch.Generator().manual_seed(0)
    batch("transformer", generator)  # the first step's batch, already taken
    for _ in range(2):
        inputs, target = (t.cuda() for t in batch("transformer", generator))
        loss = loss_fn("transformer", engine(inputs), target)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses == expected
    got = engine.full_state_dict(rank0_only=False)
    assert all(torch.equal(got[k], want[k]) for k in want)
    engine.close()


@pytest.mark.parametrize("stage,offload", [(1, None), (2, "cpu"), (3, None), (3, "cpu")])
def test_clip_grad_norm_by_hand_trains_as_the_configs_clipping_on_cuda(stage, offload):
    """engine.clip_grad_norm_ on GPU shards (and with the optimizer on the host): the norm is the step's, the
    training that of the config's clipping at the same threshold (within fp32 rounding of the coefficient),
    and the inf-norm is the largest gradient element's."""
    trained = []
    for by_hand in (False, True):
        config = make_config(stage, gradient_clipping=0.0 if by_hand else 0.5)
        if offload:
            config["zero_optimization"]["offload_optimizer"] = {"device": offload}
        model = build("transformer").cuda()
        engine = zerocore.initialize(model, config)
        generator = torch.Generator().manual_seed(0)
        norms = []
        for _ in range(4):
            inputs, target = (t.cuda() for t in batch("transformer", generator))
            engine.backward(loss_fn("transformer", engine(inputs), target))
            if by_hand:
                largest = max(zerocore.safe_get_full_grad(p).abs().max().item() for p in model.parameters())
                assert engine.clip_grad_norm_(float("inf"), norm_type="inf").item() == pytest.approx(largest, rel=1e-6)
                norm = engine.clip_grad_norm_(0.5)
                assert norm.device.type == "cuda" and norm.dtype == torch.float32
                norms.append(norm.item())
            engine.step()
            if not by_hand:
                norms.append(engine.get_global_grad_norm())
        trained.append((norms, engine.full_state_dict(rank0_only=False)))
        engine.close()
    (config_norms, config_state), (hand_norms, hand_state) = trained
    assert hand_norms == pytest.approx(config_norms, rel=1e-5) and max(config_norms) > 0.5
    for name, value in config_state.items():
        torch.testing.assert_close(hand_state[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_initialize_moves_a_cpu_model_to_the_gpu_and_trains_as_one_moved_by_hand(stage, monkeypatch):
    """A DeepSpeed script builds the model and its optimizer on the CPU and leaves the move to
    deepspeed.initialize; switched to zerocore.deepspeed it trains on the local rank's GPU (not on the CPU), with
    the optimizer's param groups, bit for bit as the same model moved by hand and given to zerocore.initialize."""
    import zerocore.deepspeed as deepspeed

    monkeypatch.setenv("LOCAL_RANK", "0")
    trained = []
    for by_deepspeed in (True, False):
        torch.manual_seed(0)
        model = build("transformer")
        config = make_config(stage, bf16={"enabled": True})
        if by_deepspeed:
            del config["optimizer"]
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        else:
            engine = zerocore.initialize(model.cuda(), config)
        assert engine.device == torch.device("cuda", 0)
        transformer_losses(engine, 3)
        trained.append(engine.full_state_dict(rank0_only=False))
        engine.close()
    moved, by_hand = trained
    assert all(torch.equal(moved[k], by_hand[k]) for k in by_hand)
