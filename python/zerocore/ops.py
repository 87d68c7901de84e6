"""Stateless kernels for the engine and for other frameworks: ``zerocore.ops.adam_step`` and friends.

The kernels are torch ops (``torch.ops.zerocore.adam_step_``) with fake kernels, so they trace under
``torch.compile``; see Note [Adam op contract] in ``bindings/adam_bindings.cpp``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

import torch

from ._arguments import as_int, as_tensor, as_tensors
from ._native import _C

# A kernel pool larger than the machine's hardware threads only adds switching; far larger is a typo
_MAX_THREADS = max(1024, os.cpu_count() or 1)

__all__ = [
    "adam_step",
    "all_finite",
    "multi_tensor_adam_step",
    "multi_tensor_all_finite",
    "quantize",
    "dequantize",
    "force_simd_path",
    "set_num_threads",
    "get_num_threads",
]


@torch.library.register_fake("zerocore::adam_step_")
def _adam_step_fake(param, grad, exp_avg, exp_avg_sq, param_out, **_: object) -> torch.Tensor:
    # The dispatcher routes here when *any* argument is a meta tensor, so a meta tensor mixed with real
    # ones must be rejected here, or the real tensors would silently not be updated.
    named = {"grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "param_out": param_out}
    for name, tensor in named.items():
        if tensor is not None and tensor.device != param.device:
            raise ValueError(f"{name} must be on {param.device} like param, got {tensor.device}")
    return torch.empty((), dtype=torch.bool, device=param.device)


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = True,
    grad_scale: float = 1.0,
    param_out: torch.Tensor | None = None,
    check_finite: bool = False,
    bias_correction: bool = True,
) -> bool:
    """One fused Adam/AdamW step on flat tensors, in place, on the CPU (SIMD) or a CUDA device.

    Args:
        param, exp_avg, exp_avg_sq: fp32, contiguous, same number of elements and device; updated in place.
        grad: fp32, bf16 or fp16 gradient; multiplied by ``grad_scale`` before use.
        step: the 1-based step count after this update (bias correction uses it).
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.
        adamw: decoupled weight decay (AdamW) when True; L2 added to the gradient (``torch.optim.Adam``)
            when False.
        param_out: optional bf16/fp16 tensor that receives the updated params, rounded to nearest even.
        check_finite: when True and ``grad`` holds an inf/NaN, nothing is written and True is returned.
        bias_correction: Adam's bias correction of the moments.

    Returns:
        True when the step was skipped because of a non-finite gradient (only with ``check_finite``).

    Like torch's in-place ops, a call bumps the autograd version counter of ``param``, ``exp_avg``,
    ``exp_avg_sq`` and ``param_out``, so a backward through a graph that saved their old values raises.

    Raises:
        ValueError: naming the argument, for a wrong dtype, device, size, layout, overlapping buffers, a lazily
            negated view (``x.neg()`` view; pass ``x.resolve_neg()``), an inference tensor outside inference
            mode, or a hyper-parameter out of range (lr, eps, weight_decay and grad_scale must be finite).
        RuntimeError: a written tensor requires grad while grad mode is on (step under ``torch.no_grad()``).
    """
    if isinstance(step, bool):
        raise ValueError(f"step must be a whole number >= 1, got {step!r}")
    skipped = torch.ops.zerocore.adam_step_(
        as_tensor("param", param),
        as_tensor("grad", grad),
        as_tensor("exp_avg", exp_avg),
        as_tensor("exp_avg_sq", exp_avg_sq),
        None if param_out is None else as_tensor("param_out", param_out),
        step=float(step),
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
        adamw=bool(adamw),
        bias_correction=bool(bias_correction),
        grad_scale=float(grad_scale),
        check_finite=bool(check_finite),
    )
    return bool(skipped.item()) if check_finite else False


def all_finite(grad: torch.Tensor) -> bool:
    """True when every element of ``grad`` is finite; on the CPU it reads only ``grad``, once."""
    device = as_tensor("grad", grad).device
    if device.type == "cpu":
        return _C.all_finite(grad.contiguous())
    if device.type == "meta":
        raise ValueError("all_finite: grad is on the meta device, which holds no values to check")
    return bool(torch.isfinite(grad).all().item())


def multi_tensor_adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = True,
    grad_scale: float = 1.0,
    param_outs: Sequence[torch.Tensor | None] | None = None,
    bias_correction: bool = True,
) -> None:
    """``adam_step`` on every ``(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], param_outs[i])``, in one call.

    The results are bit for bit those of calling :func:`adam_step` on each tuple with the same keywords, but
    the work goes into C++ once: on the CPU all tensors are split over the kernel threads together (with the
    GIL released), on CUDA they are updated in a few multi-tensor launches on the current stream. Each tuple
    follows ``adam_step``'s rules (fp32 contiguous params and moments, fp32/bf16/fp16 grads, optional
    bf16/fp16 param_out, matching sizes); tuples may differ in size (empty ones are fine), grad dtype and
    param_out. Every tensor must be on one device, and no buffer may overlap any other in the lists (grads
    may overlap one another). This is not a torch op: it does not trace under ``torch.compile``, and it has
    no ``check_finite`` (call :func:`multi_tensor_all_finite` first).

    Args:
        params, grads, exp_avgs, exp_avg_sqs: lists of the same length.
        param_outs: None, or a list of the same length of bf16/fp16 tensors or None.
        step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale, bias_correction: as in :func:`adam_step`,
            shared by every tuple.

    Like :func:`adam_step`, it bumps the autograd version counter of every tensor it writes, once per call.

    Raises:
        ValueError: before anything is written, for lists of different lengths, a hyper-parameter out of range,
            or naming the offending element (e.g. ``grads[3]``) for a wrong dtype, device, size, layout,
            a lazily negated view or overlapping buffers.
    """
    if isinstance(step, bool):
        raise ValueError(f"step must be a whole number >= 1, got {step!r}")
    if param_outs is not None:
        param_outs = list(param_outs)
        for index, out in enumerate(param_outs):
            if out is not None:
                as_tensor(f"param_outs[{index}]", out)
    _C.multi_tensor_adam_step(
        as_tensors("params", params),
        as_tensors("grads", grads),
        as_tensors("exp_avgs", exp_avgs),
        as_tensors("exp_avg_sqs", exp_avg_sqs),
        param_outs,
        step=float(step),
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
        adamw=bool(adamw),
        bias_correction=bool(bias_correction),
        grad_scale=float(grad_scale),
    )


def multi_tensor_all_finite(grads: Sequence[torch.Tensor]) -> bool | torch.Tensor:
    """Whether every element of every tensor in ``grads`` (fp32/bf16/fp16, one device) is finite.

    On the CPU this is a Python bool, from one pass split over the kernel threads (GIL released) that stops
    early once any thread finds an inf/NaN. On CUDA it is a 0-d bool tensor on that device, computed on the
    current stream without synchronising with the host (``bool()`` it to wait for the answer). An empty list
    gives True. Non-contiguous tensors are copied first.

    Raises:
        ValueError: naming the offending element (e.g. ``grads[2]``) for a wrong dtype or device.
    """
    return _C.multi_tensor_all_finite([g.contiguous() for g in as_tensors("grads", grads)])


def quantize(x: torch.Tensor, bits: int = 8, group_size: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8/int4 quantization of ``x`` (flattened) with one fp32 scale per ``group_size`` elements.

    Per group: ``scale = max|x| / qmax`` rounded up to fp32 (qmax = 127 for int8, 7 for int4) and
    ``q = round_half_even(x / scale)``; an all-zero group has scale 0 and q = 0. Every element then satisfies
    ``|x - q * scale| <= scale / 2``. Runs on the CPU (SIMD, the kernel threads) or a CUDA device (the current
    stream; reading the non-finite count back synchronises). See Note [Quantization arithmetic] in
    ``cpp/include/zerocore/quantize.hpp``.

    Args:
        x: fp32, bf16 or fp16 tensor of any shape (copied first if not contiguous).
        bits: 8 (one int8 per element) or 4 (two per uint8 byte, element 2k in the low nibble).
        group_size: elements per scale, > 0; even for ``bits=4``. The last group may be shorter.

    Returns:
        ``(q, scales)``: ``q`` int8 of ``x.numel()`` elements (bits 8) or uint8 of ``ceil(numel / 2)`` (bits 4),
        ``scales`` fp32 of ``ceil(numel / group_size)``, both 1-D on ``x``'s device.

    Raises:
        ValueError: if ``x`` holds inf or NaN (naming how many and the flat index of the first; nothing is
            quantized silently), or for a bad ``bits``, ``group_size``, dtype or device.
    """
    bits, group_size = as_int("bits", bits), as_int("group_size", group_size)
    flat = as_tensor("x", x).contiguous().view(-1)
    n = flat.numel()
    q = torch.empty(_C.quantized_bytes(n, bits), dtype=torch.int8 if bits == 8 else torch.uint8, device=x.device)
    scales = torch.empty(_C.quantize_num_groups(n, group_size), dtype=torch.float32, device=x.device)
    count, first = _C.quantize(flat, bits, group_size, q, scales)
    if count:
        raise ValueError(
            f"quantize: the input holds {count} non-finite value(s) (inf or NaN), the first at flat index {first} "
            f"(value {flat[first].item()}); they cannot be quantized. Check the tensor for overflow before "
            "quantizing it"
        )
    return q, scales


def dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    bits: int,
    group_size: int,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``q * scale`` for the ``numel`` elements that :func:`quantize` wrote into ``q`` and ``scales``.

    Each value is computed in fp32 and rounded to nearest even to the output dtype, so the original dtype
    (bf16, fp16) comes back without a full-size fp32 temporary.

    Args:
        q, scales: as returned by :func:`quantize` for the same ``numel``, ``bits`` and ``group_size``.
        numel: the number of elements (int4 storage cannot tell an odd count from the next even one).
        out: optional contiguous fp32/bf16/fp16 tensor of ``numel`` elements on ``q``'s device, written in
            place and nothing else (a contiguous slice of a larger buffer, e.g. a rank's part of a gathered unit).
        dtype: the output dtype when ``out`` is None (default fp32); when given with ``out`` it must match it.

    Returns:
        ``out``, or a new 1-D tensor of ``numel`` elements of ``dtype``.

    Raises:
        ValueError: for sizes that do not match ``numel``/``bits``/``group_size``, a wrong dtype or device, a
            non-contiguous ``out``, or ``dtype`` different from ``out.dtype``.
    """
    numel, bits, group_size = as_int("numel", numel), as_int("bits", bits), as_int("group_size", group_size)
    as_tensor("q", q), as_tensor("scales", scales)
    if numel < 0:
        raise ValueError(f"dequantize: numel must be >= 0, got {numel}")
    if out is None:
        # q's size before allocating numel elements: a wrong numel (say 2**40) must be an error naming it, not a
        # failed (or granted) huge allocation first
        if bits in (4, 8) and q.numel() != _C.quantized_bytes(numel, bits):
            raise ValueError(f"dequantize: q must have {_C.quantized_bytes(numel, bits)} elements for numel {numel} "
                             f"at {bits} bits, got {q.numel()}")
        out = torch.empty(numel, dtype=torch.float32 if dtype is None else dtype, device=q.device)
    elif dtype is not None and dtype != as_tensor("out", out).dtype:
        raise ValueError(f"dequantize: dtype is {dtype} but out is {out.dtype}; pass one of them, or make them agree")
    _C.dequantize(q, scales, numel, bits, group_size, as_tensor("out", out))
    return out


@contextlib.contextmanager
def force_simd_path(path: str) -> Iterator[None]:
    """Runs the CPU kernels on one SIMD path (``"scalar"``, ``"avx2"`` or ``"avx512"``) inside the block.

    Raises:
        ValueError: if the path is unknown, not compiled, or not supported by this CPU.
    """
    _C.force_simd_path(path)
    try:
        yield
    finally:
        _C.reset_simd_path()


def set_num_threads(num_threads: int) -> None:
    """Threads used by the CPU kernels (the CPU Adam of an offloaded optimizer, quantization, finiteness
    checks); 0 (the default) follows ``torch.get_num_threads()``, except under torchrun's default of one
    thread per rank (``OMP_NUM_THREADS=1`` with ``LOCAL_WORLD_SIZE`` > 1), where the kernels take the rank's
    share of the cores, ``cores / LOCAL_WORLD_SIZE`` (Note [Kernel threads under torchrun] in
    cpp/include/zerocore/kernel_threads.hpp). ``set_num_threads(1)`` pins one thread.

    Raises:
        ValueError: for a count that is not an int in ``[0, max(1024, os.cpu_count())]``.
    """
    num_threads = as_int("num_threads", num_threads)
    if num_threads > _MAX_THREADS:
        raise ValueError(f"num_threads must be at most {_MAX_THREADS} (this machine has {os.cpu_count()} "
                         f"hardware threads), got {num_threads}")
    _C.set_num_threads(num_threads)


def get_num_threads() -> int:
    """The threads the CPU kernels run on now (see :func:`set_num_threads`)."""
    return _C.get_num_threads()
