"""Drop-in replacements for ``torch.optim.AdamW`` built on the fused op ``zerocore.ops.adam_step``.

``CPUAdam`` updates CPU parameters with the SIMD kernels; ``FusedAdam`` updates CUDA parameters with the
fused CUDA kernel. Both are ordinary ``torch.optim.Optimizer`` subclasses: ``param_groups``, lr schedulers,
``zero_grad``, hooks and ``state_dict``/``load_state_dict`` work as with torch's optimizers, and a state dict
moves between them and ``torch.optim.AdamW`` in both directions.

Per parameter, one op call reads the gradient once and updates the parameter and both moments in a single
pass (see Note [Adam arithmetic] in ``cpp/include/zerocore/adam_types.hpp``):

* float32 parameters are updated in place;
* bfloat16/float16 parameters keep a float32 master copy in ``state["master_param"]``; the op updates the
  master and writes the rounded parameter (round to nearest even, as ``master.to(dtype)``) in the same
  pass. Unlike ``torch.optim.AdamW``, which then computes in the 16-bit dtype, the moments stay float32;
* a non-contiguous parameter (a transposed or sliced view) or a lazily negated one (an ``x.neg()`` view,
  ``is_neg()``) is updated through a contiguous copy that is written back afterwards.

State per parameter, as in torch: ``step`` (a 0-d float32 CPU tensor), ``exp_avg`` and ``exp_avg_sq``
(float32, the parameter's shape, contiguous, on its device), plus ``master_param`` for 16-bit parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import chain
from typing import Any, ClassVar

import torch
from torch.optim.optimizer import ParamsT

from . import ops
from ._model_checks import check_group_hyperparameters

__all__ = ["CPUAdam", "FusedAdam"]

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# State tensors kept in float32 whatever the parameter's dtype (torch casts loaded state to the param's).
_FP32_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master_param")


def _as_float(value: float | torch.Tensor, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a 1-element tensor, got shape {tuple(value.shape)}")
        return float(value.item())
    return float(value)


class _ZerocoreAdam(torch.optim.Optimizer):
    """Shared implementation of CPUAdam and FusedAdam; subclasses set the device type they accept."""

    _device_type: ClassVar[str]
    _other_hint: ClassVar[str]

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        adamw_mode: bool = True,
        bias_correction: bool = True,
    ) -> None:
        name = type(self).__name__
        lr_value = _as_float(lr, "lr")
        if not lr_value >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for index, beta in enumerate(betas):
            if not 0.0 <= _as_float(beta, "betas") < 1.0:
                raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if amsgrad:
            raise ValueError(f"{name} does not support amsgrad=True; use torch.optim.AdamW for AMSGrad")
        if maximize:
            raise ValueError(f"{name} does not support maximize=True; negate the loss instead")
        if capturable:
            raise ValueError(f"{name} does not support capturable=True")
        if differentiable:
            raise ValueError(f"{name} does not support differentiable=True")
        # foreach and fused are accepted for signature compatibility with torch.optim.AdamW and ignored:
        # every update is one fused kernel per parameter.
        del foreach, fused
        defaults: dict[str, Any] = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=False,
            adamw_mode=bool(adamw_mode),
            bias_correction=bool(bias_correction),
        )
        super().__init__(params, defaults)
        self._check_build()

    def _check_build(self) -> None:
        """Raises when this zerocore build cannot run the subclass's kernels."""

    # -- parameter checks -------------------------------------------------------------------------------------

    def _param_error(self, label: str, param: torch.Tensor) -> str | None:
        """Why ``param`` (``label``: ``param <index in state_dict order>``) cannot be optimized, or None."""
        name = type(self).__name__
        if param.device.type != self._device_type:
            return (f"{name} updates {self._device_type.upper()} tensors only, but {label} is on "
                    f"{param.device}{self._other_hint}")
        if param.dtype not in _PARAM_DTYPES:
            return (f"{name} supports float32, bfloat16 and float16 params, but {label} is "
                    f"{param.dtype}")
        return None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group like ``torch.optim.Optimizer.add_param_group``, checking its params' device and dtype.

        Raises:
            ValueError: naming the param's index (in state_dict order) when it is on the wrong device or of an
                unsupported dtype.
        """
        first_index = sum(len(group["params"]) for group in self.param_groups)
        super().add_param_group(param_group)
        for offset, param in enumerate(self.param_groups[-1]["params"]):
            error = self._param_error(f"param {first_index + offset}", param)
            if error is not None:
                del self.param_groups[-1]
                raise ValueError(error)

    # -- state dict -------------------------------------------------------------------------------------------

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            # A torch.optim.Adam/AdamW state dict says decoupled_weight_decay instead of adamw_mode.
            decoupled = group.pop("decoupled_weight_decay", None)
            if "adamw_mode" not in group:
                group["adamw_mode"] = self.defaults["adamw_mode"] if decoupled is None else bool(decoupled)
            group.setdefault("bias_correction", self.defaults["bias_correction"])
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, plus ``decoupled_weight_decay`` (= ``adamw_mode``) in every group so that
        ``torch.optim.Adam`` loads it in the same mode."""
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            group["decoupled_weight_decay"] = bool(group["adamw_mode"])
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of ``torch.optim.Adam``/``AdamW``.

        torch casts loaded state to each param's dtype; here ``exp_avg``, ``exp_avg_sq`` and
        ``master_param`` are instead copied as float32 from the given tensors (exact for 16-bit params
        whose state was saved by this class), and ``step`` becomes a 0-d float32 CPU tensor. At its next
        step a 16-bit param whose loaded ``master_param`` is missing (saved by torch) or does not round to
        the param (stale, or the model's weights were loaded afterwards) gets one from the param.
        """
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        params = chain.from_iterable(group["params"] for group in self.param_groups)
        saved_state = state_dict["state"]
        for saved_id, param in zip(saved_ids, params):
            if saved_id not in saved_state or param not in self.state:
                continue
            original = saved_state[saved_id]
            state = self.state[param]
            for key in _FP32_STATE_KEYS:
                value = original.get(key)
                if isinstance(value, torch.Tensor):
                    state[key] = value.detach().to(
                        device=param.device, dtype=torch.float32, memory_format=torch.contiguous_format,
                        copy=True,
                    )
            if param.dtype == torch.float32:
                state.pop("master_param", None)
            if "step" in state:
                state["step"] = torch.tensor(_as_float(state["step"], "step"), dtype=torch.float32)
        # A loaded master may be stale (saved by this class, then trained on by torch, which carries the key
        # along untouched) and the model's weights may be loaded after the optimizer: check at the next step.
        self._verify_masters = {id(p) for group in self.param_groups for p in group["params"]
                                if p.dtype != torch.float32}

    # -- the update -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Performs one optimization step over every param that has a gradient.

        Args:
            closure: optional; re-evaluates the model and returns the loss (run with grad enabled).

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: a param on the wrong device, of an unsupported dtype, or a group asking for amsgrad or
                maximize.
            RuntimeError: a sparse gradient.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Everything is checked before the first param is written: a refusal half-way through would leave some
        # params (and their step counts) updated and the rest not, which no retry could repair.
        for label, param, hyper in self._checked_work():
            self._update(label, param, hyper)
        return loss

    def _checked_work(self) -> list[tuple[str, torch.Tensor, dict[str, Any]]]:
        """``(label, param, hyper)`` for every param with a gradient, after checking every group's
        hyper-parameters and every such param, its gradient and its state; raises naming the group or the param
        (its index in state_dict order and its place in ``param_groups``)."""
        check_group_hyperparameters(self.param_groups)
        work = []
        index = 0
        for g, group in enumerate(self.param_groups):
            hyper = self._group_hyper(group)
            for i, param in enumerate(group["params"]):
                label = f"param {index} (param_groups[{g}]['params'][{i}])"
                index += 1
                if param.grad is not None:
                    self._check_param(label, param)
                    work.append((label, param, hyper))
        return work

    @staticmethod
    def _group_hyper(group: dict[str, Any]) -> dict[str, Any]:
        beta1, beta2 = (_as_float(beta, "betas") for beta in group["betas"])
        return dict(
            lr=_as_float(group["lr"], "lr"),
            beta1=beta1,
            beta2=beta2,
            eps=_as_float(group["eps"], "eps"),
            weight_decay=_as_float(group["weight_decay"], "weight_decay"),
            adamw=bool(group["adamw_mode"]),
            bias_correction=bool(group["bias_correction"]),
        )

    def _check_param(self, label: str, param: torch.Tensor) -> None:
        grad = param.grad
        assert grad is not None
        if grad.is_sparse or grad.layout != torch.strided:
            raise RuntimeError(
                f"{type(self).__name__} does not support sparse gradients ({label}); consider torch.optim.SparseAdam"
            )
        error = self._param_error(label, param)
        if error is not None:
            raise ValueError(error)
        if grad.dtype not in _GRAD_DTYPES:
            raise ValueError(f"{label}: gradient dtype {grad.dtype} is not float32, bfloat16 or float16")
        if grad.device != param.device:
            raise ValueError(f"{label}: gradient is on {grad.device} but the param on {param.device}")
        if grad.shape != param.shape:  # grad.data = ... can give a param a gradient of another shape
            raise ValueError(f"{label}: gradient has shape {tuple(grad.shape)} but the param {tuple(param.shape)}")
        state = self.state.get(param, {})
        for key in _FP32_STATE_KEYS:
            value = state.get(key)
            if isinstance(value, torch.Tensor) and (value.numel() != param.numel() or value.device != param.device):
                raise ValueError(f"{label}: state[{key!r}] has {value.numel()} elements on {value.device} but the param "
                                 f"{param.numel()} on {param.device} (a state dict of another model?)")
        if "step" in state:
            step = _as_float(state["step"], f"{label}: state['step']")
            if not (math.isfinite(step) and step >= 0 and step == int(step)):
                raise ValueError(f"{label}: state['step'] = {step} is not a whole number >= 0")

    def _update(self, label: str, param: torch.Tensor, hyper: dict[str, Any]) -> None:
        grad = param.grad
        assert grad is not None
        state = self.state[param]
        fp32 = dict(dtype=torch.float32, device=param.device)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros(param.shape, **fp32)
        if param.dtype != torch.float32:
            verify = getattr(self, "_verify_masters", None)
            if verify and id(param) in verify:
                verify.discard(id(param))
                master = state.get("master_param")
                if master is not None and not torch.equal(master.to(param.dtype), param.detach()):
                    del state["master_param"]  # does not round to the param: the param is the truth
            if "master_param" not in state:
                state["master_param"] = param.detach().to(memory_format=torch.contiguous_format, copy=True, **fp32)
        # counted once the op has run: an op refusal (overlapping buffers) leaves the count as it was
        step = int(_as_float(state["step"], "step")) + 1 if "step" in state else 1

        # The op takes dense, plainly stored tensors: a non-contiguous or lazily negated (x.neg() view) gradient
        # is resolved into a copy, and such a param is updated through one and written back.
        grad = grad if grad.is_contiguous() and not grad.is_neg() else grad.resolve_neg().contiguous()
        direct = param.is_contiguous() and not param.is_neg()
        if param.dtype == torch.float32:
            target = param if direct else param.resolve_neg().contiguous()
            ops.adam_step(target, grad, state["exp_avg"], state["exp_avg_sq"], step=step, **hyper)
            if target is not param:
                param.copy_(target)
        else:
            out = param if direct else torch.empty(param.shape, dtype=param.dtype, device=param.device)
            ops.adam_step(state["master_param"], grad, state["exp_avg"], state["exp_avg_sq"], step=step,
                          param_out=out, **hyper)
            if out is not param:
                param.copy_(out)
        if "step" in state:
            state["step"] += 1.0
        else:
            state["step"] = torch.tensor(1.0, dtype=torch.float32)


_DOC_ARGS = """
    Args:
        params: an iterable of tensors, of (name, tensor) pairs or of dicts defining param groups.
        lr: learning rate (a float or a 1-element tensor).
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: decoupled weight decay (AdamW) or, with ``adamw_mode=False``, the L2 penalty added to
            the gradient (``torch.optim.Adam``). Defaults to AdamW's 1e-2 in both modes.
        amsgrad, maximize, capturable, differentiable: only False is supported (ValueError otherwise).
        foreach, fused: accepted for compatibility with ``torch.optim.AdamW`` and ignored.
        adamw_mode: decoupled weight decay when True; L2 in the gradient (``torch.optim.Adam``) when False.
        bias_correction: Adam's bias correction of the moments.

    Raises:
        ValueError: for invalid hyper-parameters, or a param on the wrong device or of a dtype other than
            float32, bfloat16 and float16 (naming its index in state_dict order).
"""


class CPUAdam(_ZerocoreAdam):
    __doc__ = (
        "Adam/AdamW for CPU parameters on zerocore's fused SIMD kernels; a drop-in ``torch.optim.AdamW``.\n\n"
        "    Threads follow ``torch.get_num_threads()`` (a rank's share of the cores under torchrun's\n"
        "    ``OMP_NUM_THREADS=1``) unless ``zerocore.ops.set_num_threads`` pins a count; the GIL is released\n"
        "    while a step runs.\n" + _DOC_ARGS
    )
    _device_type = "cpu"
    _other_hint = "; use zerocore.optim.FusedAdam for CUDA params"


class FusedAdam(_ZerocoreAdam):
    __doc__ = (
        "Adam/AdamW for CUDA parameters on zerocore's fused CUDA kernel; a drop-in ``torch.optim.AdamW``.\n\n"
        "    One kernel launch per param; the step count stays on the host, so a step never synchronizes.\n"
        + _DOC_ARGS
        + "        RuntimeError: when zerocore was built without its CUDA kernels.\n"
    )
    _device_type = "cuda"
    _other_hint = "; use zerocore.optim.CPUAdam for CPU params"

    def _check_build(self) -> None:
        from ._info import build_info

        if not build_info()["cuda_compiled"]:
            raise RuntimeError(
                "FusedAdam needs zerocore's CUDA kernels, but this build has none; rebuild with ZEROCORE_CUDA=ON "
                "or use zerocore.optim.CPUAdam"
            )
