"""``deepspeed.ops.adam`` for scripts switched to zerocore (``import zerocore.deepspeed as deepspeed``).

DeepSpeed's ``FusedAdam`` and ``DeepSpeedCPUAdam`` with DeepSpeed's signatures (argument order, names and
defaults: ``adam_w_mode`` / ``adamw_mode``, ``weight_decay=0``, ``bias_correction``), on zerocore's fused Adam
kernels (:mod:`zerocore.optim`): ordinary torch optimizers that step CPU parameters (and CUDA ones where zerocore
has its CUDA kernels), and what ``deepspeed.initialize(optimizer=...)`` turns into the engine's sharded Adam with
the same groups, as DeepSpeed's own take them. DeepSpeed's scripts pick one of the two by whether the optimizer
state is offloaded (``DeepSpeedCPUAdam if offload else FusedAdam``); with zerocore the config's
``offload_optimizer`` decides where the engine's state lives either way. Moments are fp32 (DeepSpeed's default;
``fp32_optimizer_states=False`` is accepted and keeps them fp32 too: more precise, not less). AMSGrad is refused,
as DeepSpeed refuses it.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import ParamsT

from ..._info import build_info
from ...optim import _PARAM_DTYPES, CPUAdam, _ZerocoreAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class FusedAdam(_ZerocoreAdam):
    """DeepSpeed's ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad,
    set_grad_none)``: Adam with decoupled weight decay (AdamW) unless ``adam_w_mode=False`` (L2 in the gradient),
    for CPU or CUDA parameters."""

    _device_type = "cpu or cuda"
    _other_hint = ""

    def __init__(self, params: ParamsT, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (amsgrad=True)")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adam_w_mode,
                         bias_correction=bias_correction)
        self.adam_w_mode = bool(adam_w_mode)  # DeepSpeed's attribute, which scripts and initialize read
        self.set_grad_none = bool(set_grad_none)

    def _param_error(self, label: str, param: torch.Tensor) -> str | None:
        if param.device.type not in ("cpu", "cuda"):
            return f"FusedAdam updates CPU and CUDA tensors, but {label} is on {param.device}"
        if param.device.type == "cuda" and not build_info()["cuda_compiled"]:
            return (f"FusedAdam: {label} is on {param.device}, but this zerocore build has no CUDA kernels; rebuild "
                    "with ZEROCORE_CUDA=ON")
        if param.dtype not in _PARAM_DTYPES:
            return f"FusedAdam supports float32, bfloat16 and float16 params, but {label} is {param.dtype}"
        return None

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """DeepSpeed's: gradients set to None with ``set_grad_none`` (the default), zeroed otherwise."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPUAdam(CPUAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
    adamw_mode, fp32_optimizer_states)``: zerocore's SIMD CPU Adam (:class:`zerocore.optim.CPUAdam`)."""

    def __init__(self, model_params: ParamsT, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        del fp32_optimizer_states  # the moments are fp32 either way (the module's docstring)
        if amsgrad:
            raise RuntimeError("DeepSpeedCPUAdam does not support the AMSGrad variant (amsgrad=True)")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                         bias_correction=bias_correction)
        self.adam_w_mode = bool(adamw_mode)

