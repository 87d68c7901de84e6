"""DeepSpeed's ``torch_autocast`` section (Note [torch_autocast] in _autocast_config.py): fp32 parameters and
optimizer state, the forward under ``torch.autocast``; a run matches fp32 AdamW on the same model whose forwards
run under autocast, at every stage, and the section reads and writes as DeepSpeed spells it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import zerocore
from zerocore import ZeroConfig
from _dist import run_ranks

WORLD = 2
STEPS = 3
AUTOCAST = {"enabled": True, "dtype": "bfloat16"}


class Net(nn.Module):
    """Linear layers (autocast computes them in bf16) around a LayerNorm (autocast keeps it fp32), the middle
    block checkpointed: its recomputation in the backward must run under the same autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(24, 48)
        self.block = nn.Sequential(nn.Linear(48, 48), nn.GELU(), nn.LayerNorm(48))
        self.out = nn.Linear(48, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        return self.out(h)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 24, generator=g), torch.randn(8, 6, generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).mean()


def _reference(model: nn.Module, autocast: bool) -> dict[str, torch.Tensor]:
    """AdamW on the mean of every rank's gradients, each rank's forward as the engine runs it, in a rank's process
    (the bf16 matmuls' rounding depends on the threads they run on). The AdamW is zerocore.optim.CPUAdam, the
    engine's kernel, so the two runs agree bit for bit: under autocast an ulp of difference in a weight can round
    it to another bf16 value in the next forward, which would turn another Adam's rounding into noise."""
    model = copy.deepcopy(model)
    opt = zerocore.optim.CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(WORLD):
            x, y = _batch(rank, step)
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x)
            _loss(out, y).backward()
            for total, p in zip(grads, model.parameters()):
                total += p.grad
        for total, p in zip(grads, model.parameters()):
            p.grad = total / WORLD
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def autocast_worker(rank: int, world: int, stage: int, autocast: bool) -> dict:
    torch.manual_seed(0)
    model = Net()
    references = {"autocast": _reference(model, True), "fp32": _reference(model, False)}
    config = {"gradient_clipping": 0.0, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    if autocast:
        config["torch_autocast"] = AUTOCAST
    engine = zerocore.initialize(model, config)
    out_dtypes = set()
    for step in range(STEPS):
        x, y = _batch(rank, step)
        with torch.autocast("cpu", dtype=torch.float16):  # a script's own autocast: the section's replaces it
            out = engine(x)
        out_dtypes.add(str(out.dtype))
        engine.backward(_loss(out, y))
        engine.step()
    state = engine.full_state_dict(rank0_only=False)
    result = {"out_dtypes": sorted(out_dtypes),
              "param_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
              "accessors": (engine.torch_autocast_enabled(), str(engine.torch_autocast_dtype()),
                            engine.torch_autocast_lower_precision_safe_modules()[:1]),
              # per tensor: differing elements from each reference, and the two references' relative distance
              "differing": {kind: {name: int((state[name] != value).sum()) for name, value in ref.items()}
                            for kind, ref in references.items()},
              "apart": min(((references["fp32"][name] - value).norm() / value.norm()).item()
                           for name, value in references["autocast"].items())}
    engine.close()
    return result


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_forward_runs_under_the_sections_autocast_and_the_update_is_fp32_adamws(stage):
    for result in run_ranks(autocast_worker, WORLD, stage, True):
        assert result["out_dtypes"] == ["torch.bfloat16"] and result["param_dtypes"] == ["torch.float32"]
        assert result["accessors"] == (True, "torch.bfloat16", ["torch.nn.modules.linear.Linear"])
        assert set(result["differing"]["autocast"].values()) == {0}, result["differing"]["autocast"]
        # (the check can fail: computing the forwards in fp32 instead moves every tensor by bf16's rounding)
        assert result["apart"] > 1e-6 and 0 not in result["differing"]["fp32"].values(), result


def test_without_the_section_a_scripts_own_autocast_applies_as_under_ddp():
    rank0, _ = run_ranks(autocast_worker, WORLD, 2, False)
    assert rank0["out_dtypes"] == ["torch.float16"] and rank0["param_dtypes"] == ["torch.float32"]
    assert rank0["accessors"][0] is False and 0 not in rank0["differing"]["autocast"].values()


def test_the_section_reads_as_deepspeed_spells_it_and_writes_back():
    for spelling in ("bfloat16", "bf16", "torch.bfloat16", "bfloat"):
        config = ZeroConfig.from_deepspeed({"torch_autocast": {"enabled": True, "dtype": spelling}})
        assert (config.torch_autocast, config.autocast_dtype, config.compute_dtype) == (
            "bf16", torch.bfloat16, torch.float32)
    off = ZeroConfig.from_deepspeed({"torch_autocast": {"enabled": False, "dtype": "float16"}})
    assert off.autocast_dtype is None and "torch_autocast" not in off.to_deepspeed()
    modules = ["torch.nn.Linear", "torch.nn.Embedding"]
    config = ZeroConfig.from_deepspeed({"torch_autocast": {**AUTOCAST, "lower_precision_safe_modules": modules},
                                        "zero_optimization": {"stage": 3}})
    written = config.to_deepspeed()
    assert written["torch_autocast"] == {**AUTOCAST, "lower_precision_safe_modules": modules}
    assert ZeroConfig.from_deepspeed(written) == config


@pytest.mark.parametrize("section, extra, match", [
    ({"enabled": True}, {}, r"torch_autocast\.dtype: missing"),
    ({"enabled": True, "dtype": "float16"}, {}, "not supported yet by zerocore: DeepSpeed pairs float16"),
    ({"enabled": True, "dtype": "fp32"}, {}, "leave torch_autocast disabled"),
    ({"enabled": False, "dtype": "bf8"}, {}, r"torch_autocast\.dtype: expected one of"),
    ({"enabled": "yes", "dtype": "bf16"}, {}, r"torch_autocast\.enabled: expected true or false"),
    ({**AUTOCAST, "lower_precision_safe_modules": ["torch.nn.Nope"]}, {}, "'torch.nn.Nope' is not an importable"),
    ({**AUTOCAST, "lower_precision_safe_modules": ["os.path"]}, {}, "'os.path' is not an importable module class"),
    ({**AUTOCAST, "lower_precision_safe_modules": "torch.nn.Linear"}, {}, "expected a list of module class names"),
    ({**AUTOCAST, "cast_inputs": True}, {}, r"torch_autocast\.cast_inputs: unknown key"),
    (AUTOCAST, {"bf16": {"enabled": True}}, "bf16.enabled makes them 16-bit"),
    (AUTOCAST, {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_quantized_weights"),
])
def test_what_the_section_cannot_mean_here_is_named(section, extra, match):
    with pytest.raises(ValueError, match=match):
        ZeroConfig.from_deepspeed({"torch_autocast": section, **extra})


def test_the_kept_module_list_is_no_top_level_key():
    with pytest.raises(ValueError, match="torch_autocast_lower_precision_safe_modules: unknown key"):
        ZeroConfig.from_deepspeed({"torch_autocast_lower_precision_safe_modules": ["torch.nn.Linear"]})
