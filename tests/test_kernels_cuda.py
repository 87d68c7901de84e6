"""The fused CUDA Adam kernels (cuda/fused_adam.cu) through zerocore.ops.adam_step and zerocore.optim.FusedAdam.

Accuracy is judged against a float64 reference (torch.optim.AdamW/Adam on float64 tensors): after 100 steps
our fp32 error must be at most twice that of torch's own fp32 single-tensor optimizer on the same inputs.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import zerocore  # noqa: E402
from zerocore import ops  # noqa: E402

DEV = "cuda"
LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(autouse=True)
def _needs_cuda_build():
    if not zerocore.build_info()["cuda_compiled"]:
        pytest.skip("zerocore was built without CUDA kernels")


def _view(src: torch.Tensor, offset: int) -> torch.Tensor:
    """A contiguous copy of src whose first element sits `offset` elements into its storage."""
    buf = torch.empty(src.numel() + offset, dtype=src.dtype, device=src.device)
    out = buf[offset:]
    out.copy_(src)
    return out


def _grads(n: int, steps: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return [(torch.randn(n, generator=gen, device=DEV) * (0.1 + k % 3)).to(dtype) for k in range(steps)]


def _torch_opt(p: torch.Tensor, adamw: bool, wd: float) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    return cls([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=wd, foreach=False)


def _run(n, *, grad_dtype=torch.float32, adamw=True, wd=0.01, offsets=(0, 0, 0, 0), steps=100, seed=0):
    """Runs zerocore, torch fp32 and torch fp64 side by side; returns (ours, torch32, ref64) state triples and
    the largest magnitude each of ref64's tensors took over the steps."""
    p0 = torch.randn(n, generator=torch.Generator(device=DEV).manual_seed(seed + 1), device=DEV)
    p = _view(p0, offsets[0])
    m = _view(torch.zeros(n, device=DEV), offsets[1])
    v = _view(torch.zeros(n, device=DEV), offsets[2])
    tp, rp = p0.clone(), p0.double()
    topt, ropt = _torch_opt(tp, adamw, wd), _torch_opt(rp, adamw, wd)
    peaks = [p0.abs().max().item() if n else 0.0, 0.0, 0.0]
    for k, g in enumerate(_grads(n, steps, grad_dtype, seed)):
        skipped = ops.adam_step(p, _view(g, offsets[3]), m, v, step=k + 1, lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                                eps=EPS, weight_decay=wd, adamw=adamw)
        assert skipped is False
        tp.grad, rp.grad = g.float(), g.double()
        topt.step()
        ropt.step()
        if n:
            rs = ropt.state[rp]
            peaks = [max(peak, t.abs().max().item()) for peak, t in zip(peaks, (rp, rs["exp_avg"], rs["exp_avg_sq"]))]
    if n == 0:
        return (p, m, v), None, None, None
    ts, rs = topt.state[tp], ropt.state[rp]
    return (p, m, v), (tp, ts["exp_avg"], ts["exp_avg_sq"]), (rp, rs["exp_avg"], rs["exp_avg_sq"]), peaks


def _assert_within_2x_of_torch(ours, torch32, ref, peaks):
    for name, a, t, r, peak in zip(("param", "exp_avg", "exp_avg_sq"), ours, torch32, ref, peaks):
        err = (a.double() - r).abs().max().item()
        err_torch = (t.double() - r).abs().max().item()
        # A few ulps, for lengths too short for statistics: ulps of the largest value the reference took, since
        # a value that ends near zero keeps the absolute error gathered while it was larger.
        floor = 8 * EPS32 * peak
        assert err <= 2 * err_torch + floor, f"{name}: error {err:.3e} vs torch fp32 {err_torch:.3e}"


LENGTHS = [0, 1, 7, 15, 16, 17, 1000003, 2**20 + 3]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
def test_matches_float64_reference(n, adamw):
    ours, t32, ref, peaks = _run(n, adamw=adamw)
    if n == 0:
        return
    _assert_within_2x_of_torch(ours, t32, ref, peaks)


# Contiguous views starting inside their storage: all misaligned alike (vector path after a scalar head,
# also with a bf16 grad), only some misaligned (no common alignment: scalar path), a misaligned grad alone.
UNALIGNED = [
    ((1, 1, 1, 1), torch.float32),
    ((3, 3, 3, 3), torch.bfloat16),
    ((1, 0, 0, 0), torch.float32),
    ((0, 0, 0, 1), torch.float16),
]


@pytest.mark.parametrize("n", [17, 1000003])
@pytest.mark.parametrize("offsets,grad_dtype", UNALIGNED)
def test_unaligned_views(n, offsets, grad_dtype):
    ours, t32, ref, peaks = _run(n, offsets=offsets, grad_dtype=grad_dtype, steps=20)
    _assert_within_2x_of_torch(ours, t32, ref, peaks)
    aligned, _, _, _ = _run(n, grad_dtype=grad_dtype, steps=20)
    for a, b in zip(ours, aligned):  # the vector and scalar paths compute the same bits
        assert torch.equal(a, b)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [17, 1000003])
def test_16bit_grads(grad_dtype, n):
    ours, t32, ref, peaks = _run(n, grad_dtype=grad_dtype)
    _assert_within_2x_of_torch(ours, t32, ref, peaks)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,offset", [(1, 0), (17, 1), (1000003, 0), (1000003, 1)])
def test_param_out_is_rounded_param(out_dtype, grad_dtype, n, offset):
    p = _view(torch.randn(n, device=DEV) * 3, offset)
    m, v = torch.zeros(n, device=DEV), torch.zeros(n, device=DEV)
    out = _view(torch.zeros(n, device=DEV, dtype=out_dtype), offset)
    for k, g in enumerate(_grads(n, 5, grad_dtype)):
        ops.adam_step(p, g, m, v, step=k + 1, lr=0.1, weight_decay=0.01, param_out=out)
        assert torch.equal(out, p.to(out_dtype))  # round to nearest even, as torch's .to()


def test_grad_scale_applied_before_use():
    n = 1000003
    g = torch.randn(n, device=DEV)
    a = [torch.randn(n, device=DEV), torch.zeros(n, device=DEV), torch.zeros(n, device=DEV)]
    b = [t.clone() for t in a]
    for step in (1, 2, 3):
        ops.adam_step(*a[:1], g, *a[1:], step=step, lr=1e-2)
        ops.adam_step(*b[:1], g * 8, *b[1:], step=step, lr=1e-2, grad_scale=0.125)  # exact power-of-two scaling
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [0, 12345, -1])
def test_check_finite_skips_and_leaves_tensors_untouched(grad_dtype, bad, where):
    n = 100003
    g = torch.randn(n, device=DEV).to(grad_dtype)
    g[where] = bad
    p, m, v = torch.randn(n, device=DEV), torch.rand(n, device=DEV), torch.rand(n, device=DEV)
    out = torch.zeros(n, device=DEV, dtype=torch.bfloat16)
    before = [t.clone() for t in (p, m, v, out)]
    assert ops.adam_step(p, g, m, v, step=3, lr=1e-2, param_out=out, check_finite=True) is True
    for t, b in zip((p, m, v, out), before):
        assert torch.equal(t, b)
    g[where] = 1.0
    assert ops.adam_step(p, g, m, v, step=3, lr=1e-2, param_out=out, check_finite=True) is False
    assert not torch.equal(p, before[0]) and torch.equal(out, p.to(torch.bfloat16))


def test_nonfinite_grads_propagate_without_check():
    g = torch.tensor([1.0, float("nan"), float("inf"), 2.0], device=DEV)
    p, m, v = torch.ones(4, device=DEV), torch.zeros(4, device=DEV), torch.zeros(4, device=DEV)
    tp = torch.ones(4, device=DEV)
    topt = _torch_opt(tp, True, 0.0)
    tp.grad = g.clone()
    topt.step()
    assert ops.adam_step(p, g, m, v, step=1, lr=LR) is False
    assert torch.equal(p.isnan(), tp.isnan()) and torch.equal(p.isinf(), tp.isinf())


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 63), torch.nn.Tanh(), torch.nn.Linear(63, 1)
    ).to(DEV)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_fused_adam_matches_torch_fused(adamw_mode):
    from zerocore.optim import FusedAdam

    ours, ref = _model(), _model()
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    opt = FusedAdam(ours.parameters(), adamw_mode=adamw_mode, **kw)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref_opt = ref_cls(ref.parameters(), fused=True, **kw)
    gen = torch.Generator(device=DEV).manual_seed(1)
    for _ in range(20):
        x, y = torch.randn(128, 32, device=DEV, generator=gen), torch.randn(128, 1, device=DEV, generator=gen)
        for model, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            o.step()
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert isinstance(opt, torch.optim.Optimizer)


def test_runs_on_the_current_stream():
    """The op launches on torch's current stream (pool streams do not synchronise with the default stream):
    with the gradient written late on a side stream, the update must still see it."""
    n = 1000003
    src = torch.randn(n, device=DEV)
    init = [torch.randn(n, device=DEV), torch.zeros(n, device=DEV), torch.zeros(n, device=DEV)]
    expected = [t.clone() for t in init]
    ops.adam_step(expected[0], src, *expected[1:], step=1, lr=1e-2)
    p, m, v = (t.clone() for t in init)
    g = torch.zeros(n, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keeps `side` busy so that a launch on another stream would overtake it
        g.copy_(src)
        assert ops.adam_step(p, g, m, v, step=1, lr=1e-2, check_finite=True) is False
    torch.cuda.current_stream().wait_stream(side)
    for a, b in zip((p, m, v), expected):
        assert torch.equal(a, b)


def test_cuda_graph_capture_and_replay():
    """cuda_adam.hpp promises graph-capturable launches (no host sync, no allocation in the kernels)."""
    n = 100003
    g = torch.randn(n, device=DEV)
    init = [torch.randn(n, device=DEV), torch.zeros(n, device=DEV), torch.zeros(n, device=DEV)]
    eager = [t.clone() for t in init]
    captured = [t.clone() for t in init]
    kw = dict(step=1, lr=1e-2, weight_decay=0.01)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (module loading, occupancy caches)
        ops.adam_step(*[t.clone() for t in init[:1]], g, *[t.clone() for t in init[1:]], **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.adam_step(captured[0], g, *captured[1:], **kw)
    for _ in range(3):
        graph.replay()
        ops.adam_step(eager[0], g, *eager[1:], **kw)
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)


def test_more_than_2_31_elements():
    """Index math past 2**31 elements (and past 2**32 bytes): windows at the start, across 2**31 and at the
    end of one long launch match the same windows updated on their own, bit for bit."""
    n = 2**31 + 13
    if torch.cuda.mem_get_info()[0] < 48 * 2**30:
        pytest.skip("needs about 40 GB of free GPU memory")
    gen = torch.Generator(device=DEV).manual_seed(5)
    p = torch.randn(n, generator=gen, device=DEV)
    m = torch.randn(n, generator=gen, device=DEV).mul_(0.1)
    v = torch.rand(n, generator=gen, device=DEV)
    g = torch.randn(n, generator=gen, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(n, device=DEV, dtype=torch.bfloat16)
    windows = [slice(0, 100), slice(2**31 - 50, 2**31 + 50), slice(n - 100, n)]
    small = [[t[w].clone() for t in (p, g, m, v)] for w in windows]
    kw = dict(step=3, lr=1e-2, weight_decay=0.1)
    assert ops.adam_step(p, g, m, v, param_out=out, check_finite=True, **kw) is False
    for w, (sp, sg, sm, sv) in zip(windows, small):
        sout = torch.empty(sp.shape, device=DEV, dtype=torch.bfloat16)
        ops.adam_step(sp, sg, sm, sv, param_out=sout, **kw)
        for big, mine in ((p, sp), (m, sm), (v, sv), (out, sout)):
            assert torch.equal(big[w], mine)
    g[n - 1] = float("inf")  # the finite check must look at the very last element
    before = [p[w].clone() for w in windows]
    assert ops.adam_step(p, g, m, v, check_finite=True, **kw) is True
    for w, b in zip(windows, before):
        assert torch.equal(p[w], b)
    del p, m, v, g, out
    torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------------------------------
# ops.multi_tensor_adam_step and ops.multi_tensor_all_finite on CUDA
# -------------------------------------------------------------------------------------------------------------

# (n, grad dtype, param_out dtype or None, storage offset of every buffer of the tuple)
MULTI_SPANS = [
    (0, torch.float32, None, 0),
    (1, torch.bfloat16, torch.bfloat16, 0),
    (17, torch.float16, torch.float16, 1),
    (100003, torch.float32, torch.bfloat16, 0),
    (1000003, torch.bfloat16, torch.float16, 0),
    (0, torch.float16, torch.bfloat16, 0),
    (1000003, torch.float16, None, 1),
    (17, torch.float32, None, 0),
    (100003, torch.bfloat16, torch.float16, 3),
]
# One set of hyper-parameters per step: both weight-decay modes, a grad scale, other betas, no bias correction.
MULTI_STEPS = [
    dict(step=1, lr=1e-2, weight_decay=0.01),
    dict(step=2, lr=1e-2, weight_decay=0.1, adamw=False, grad_scale=0.5),
    dict(step=3, lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.02, bias_correction=False),
]
_SPAN_KEYS = ("param", "grad", "exp_avg", "exp_avg_sq", "param_out")


def _multi_spans(seed: int, spec=MULTI_SPANS, device=DEV) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(seed)
    spans = []
    for n, grad_dtype, out_dtype, offset in spec:
        spans.append({
            "param": _view(torch.randn(n, generator=gen, device=device) * 3, offset),
            "grad": _view(torch.randn(n, generator=gen, device=device).to(grad_dtype), offset),
            "exp_avg": _view(torch.randn(n, generator=gen, device=device) * 0.1, offset),
            "exp_avg_sq": _view(torch.rand(n, generator=gen, device=device) * 0.01, offset),
            "param_out": None if out_dtype is None else _view(torch.zeros(n, device=device, dtype=out_dtype), offset),
        })
    return spans


def _multi_step(spans: list[dict], **kw) -> None:
    ops.multi_tensor_adam_step(*([t[k] for t in spans] for k in _SPAN_KEYS[:4]),
                               param_outs=[t["param_out"] for t in spans], **kw)


def _single_steps(spans: list[dict], **kw) -> None:
    for t in spans:
        assert ops.adam_step(*(t[k] for k in _SPAN_KEYS[:4]), param_out=t["param_out"], **kw) is False


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """fp32 bits as integers in the order of the values (-0 and +0 both 0), so ulps are differences."""
    bits = t.view(torch.int32).long()
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def _assert_within_1_ulp(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert torch.equal(a.isnan(), b.isnan()), f"{what}: NaNs differ"
    keep = ~a.isnan()
    if keep.any():
        ulps = (_ordered(a[keep]) - _ordered(b[keep])).abs().max().item()
        assert ulps <= 1, f"{what}: {ulps} ulps apart"


def _assert_multi_matches_single(multi: list[dict], single: list[dict], when: str) -> None:
    for i, (a, b) in enumerate(zip(multi, single)):
        for key in ("param", "exp_avg", "exp_avg_sq"):
            _assert_within_1_ulp(a[key], b[key], f"{when}: tensors[{i}] (n={a['param'].numel()}) {key}")
        if a["param_out"] is not None:  # the multi-tensor output is its own params, rounded
            assert torch.equal(a["param_out"], a["param"].to(a["param_out"].dtype)), f"{when}: param_outs[{i}]"


def test_multi_tensor_adam_matches_per_span():
    """Mixed lengths (empty ones too), grad dtypes, outputs and alignments in one list: the same bits as
    ops.adam_step on every span (the kernels share adam_update, so at most 1 ulp is tolerated)."""
    multi, single = _multi_spans(7), _multi_spans(7)
    for kw in MULTI_STEPS:
        _multi_step(multi, **kw)
        _single_steps(single, **kw)
        _assert_multi_matches_single(multi, single, f"step {kw['step']}")


def test_multi_tensor_adam_without_param_outs():
    spec = [(n, torch.float32, None, 0) for n in (5, 0, 100003)]
    multi, single = _multi_spans(3, spec), _multi_spans(3, spec)
    ops.multi_tensor_adam_step(*([t[k] for t in multi] for k in _SPAN_KEYS[:4]), step=1, lr=1e-2)  # param_outs=None
    _single_steps(single, step=1, lr=1e-2)
    _assert_multi_matches_single(multi, single, "param_outs=None")


def test_multi_tensor_runs_on_the_current_stream():
    """As test_runs_on_the_current_stream: with the gradients written late on a side stream, both the finite
    check and the update launched on that (current) stream must see them."""
    lengths = [1000003, 17, 500001]
    src = [torch.randn(n, device=DEV) for n in lengths]
    init = [[torch.randn(n, device=DEV), torch.zeros(n, device=DEV), torch.zeros(n, device=DEV)] for n in lengths]
    expected = [[t.clone() for t in ts] for ts in init]
    ops.multi_tensor_adam_step([t[0] for t in expected], src, [t[1] for t in expected], [t[2] for t in expected],
                               step=1, lr=1e-2)  # on the default stream, with the gradients already there
    state = [[t.clone() for t in ts] for ts in init]
    grads = [torch.zeros(n, device=DEV) for n in lengths]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keeps `side` busy so that a launch on another stream would overtake it
        for g, s in zip(grads, src):
            g.copy_(s)
        finite = ops.multi_tensor_all_finite(grads)
        ops.multi_tensor_adam_step([t[0] for t in state], grads, [t[1] for t in state], [t[2] for t in state],
                                   step=1, lr=1e-2)
        torch.cuda._sleep(50_000_000)
        grads[2][-1] = float("inf")
        late_inf = ops.multi_tensor_all_finite(grads)
    torch.cuda.current_stream().wait_stream(side)
    assert isinstance(finite, torch.Tensor) and finite.dtype == torch.bool and finite.shape == ()
    assert finite.device.type == "cuda"
    assert bool(finite) is True and bool(late_inf) is False
    for ts, es in zip(state, expected):
        for a, b in zip(ts, es):
            assert torch.equal(a, b)


def test_multi_tensor_all_finite_cuda():
    lengths = [0, 1, 17, 100003, 1000003]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    grads = [(torch.randn(n, device=DEV) * 1e3).to(dtypes[i % 3]) for i, n in enumerate(lengths)]
    assert ops.multi_tensor_all_finite([]) is True
    assert bool(ops.multi_tensor_all_finite(grads)) is True
    for where, index in [(4, lengths[4] - 1), (2, 8), (3, 0), (1, 0)]:
        for bad in (float("inf"), float("-inf"), float("nan")):
            kept = grads[where][index].clone()
            grads[where][index] = bad
            assert bool(ops.multi_tensor_all_finite(grads)) is False, f"grads[{where}][{index}] = {bad}"
            grads[where][index] = kept
    assert bool(ops.multi_tensor_all_finite(grads)) is True


def test_multi_tensor_mixed_devices_raise_value_error_naming_index():
    spans = _multi_spans(1, [(64, torch.float32, torch.bfloat16, 0)] * 3)
    lists = {k: [t[k] for t in spans] for k in _SPAN_KEYS}
    for key, pattern in (("param", r"params\[2\]"), ("grad", r"grads\[2\]"), ("param_out", r"param_outs\[2\]")):
        bad = {k: list(v) for k, v in lists.items()}
        bad[key][2] = bad[key][2].cpu()
        with pytest.raises(ValueError, match=pattern):
            ops.multi_tensor_adam_step(*(bad[k] for k in _SPAN_KEYS[:4]), param_outs=bad["param_out"], step=1, lr=1e-3)
    with pytest.raises(ValueError, match=r"grads\[1\]"):
        ops.multi_tensor_all_finite([lists["grad"][0], lists["grad"][1].cpu()])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_multi_tensor_on_a_device_other_than_the_current_one():
    """The bindings switch to the tensors' device (and its current stream) for the launches."""
    other = torch.device("cuda", 1)
    multi, single = _multi_spans(5, device=other), _multi_spans(5, device=other)
    with torch.cuda.device(0):
        _multi_step(multi, **MULTI_STEPS[0])
        finite = ops.multi_tensor_all_finite([t["grad"] for t in multi])
    assert finite.device == other and bool(finite) is True
    _single_steps(single, **MULTI_STEPS[0])
    _assert_multi_matches_single(multi, single, "cuda:1")


# -------------------------------------------------------------------------------------------------------------
# ZeRO++ quantization (cuda/quantize.cu): the CPU kernels' bytes (tests/test_quantize.py checks those against
# float64), so q, scales and every dequantized value must be equal bit for bit.
# -------------------------------------------------------------------------------------------------------------
QUANT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
QUANT_BITS_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _quant_input(n: int, group_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Group magnitudes spread over dtype's range, exact ties on every group's grid, a tiny and a zero group."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (-8, 8) if dtype == torch.float16 else (-30, 30)
    groups = max(1, -(-n // group_size))
    exps = torch.randint(lo, hi + 1, (groups,), generator=gen).double().repeat_interleave(group_size)[:n]
    x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp2(exps)
    ties = torch.rand(n, generator=gen) < 0.3  # k/2 * 2^e: exact ties once the group's absmax is 127 * 2^e
    x[ties] = torch.randint(-254, 255, (int(ties.sum()),), generator=gen).double() / 2 * torch.exp2(exps[ties])
    x[::group_size] = 127 * torch.exp2(exps[::group_size])
    if groups > 2:
        x[group_size : 2 * group_size] = 0.0
        x[2 * group_size : 3 * group_size] *= 2.0 ** (-20 if dtype == torch.float16 else -120)
    return x.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    view = QUANT_BITS_VIEW.get(a.dtype)
    a_bits, b_bits = (a.view(view), b.view(view)) if view else (a, b)
    diff = (a_bits.cpu() != b_bits.cpu()).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.numel()} differ, first at {diff[0].item()}"


def _compare_quantize(x: torch.Tensor, bits: int, group_size: int, device: str = DEV) -> None:
    n = x.numel()
    what = f"n={n} {x.dtype} bits={bits} group_size={group_size}"
    q_cpu, s_cpu = ops.quantize(x, bits=bits, group_size=group_size)
    q_dev, s_dev = ops.quantize(x.to(device), bits=bits, group_size=group_size)
    assert q_dev.device.type == torch.device(device).type
    _same_bits(q_dev, q_cpu, f"q, {what}")
    _same_bits(s_dev, s_cpu, f"scales, {what}")
    for out_dtype in QUANT_DTYPES:
        out_cpu = ops.dequantize(q_cpu, s_cpu, n, bits, group_size, dtype=out_dtype)
        out_dev = ops.dequantize(q_dev, s_dev, n, bits, group_size, dtype=out_dtype)
        _same_bits(out_dev, out_cpu, f"dequantize to {out_dtype}, {what}")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [2, 64, 512, 514, 2048])  # warp teams up to 512, block teams above
def test_quantize_matches_cpu_bytewise(bits, group_size):
    for dtype in QUANT_DTYPES:
        for n in (0, 1, 2, 33, 2047, 2048 * 3 + 5, 2**20 + 7):
            _compare_quantize(_quant_input(n, group_size, dtype, seed=n + group_size), bits, group_size)


def test_quantize_odd_group_size_int8_and_grid_stride():
    _compare_quantize(_quant_input(100_003, 33, torch.float32, seed=1), 8, 33)
    # 2^24 + 2 groups of 2: more teams than the largest grid launched, so teams walk the groups grid-stride.
    _compare_quantize(_quant_input(2**25 + 3, 2, torch.bfloat16, seed=2), 8, 2)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_nonfinite_matches_cpu(bits):
    for dtype in QUANT_DTYPES:
        n, group_size = 10_000, 512 if bits == 8 else 1024
        x = _quant_input(n, group_size, dtype, seed=3)
        for i, v in ((9_000, float("nan")), (4_321, float("inf")), (4_322, -float("inf")), (77, float("nan"))):
            x[i] = v
        q_cpu, s_cpu = torch.empty_like(ops.quantize(torch.zeros(n), bits=bits)[0]), torch.empty(-(-n // group_size))
        q_dev, s_dev = q_cpu.to(DEV), s_cpu.to(DEV)
        assert zerocore._C.quantize(x, bits, group_size, q_cpu, s_cpu) == (4, 77)
        assert zerocore._C.quantize(x.to(DEV), bits, group_size, q_dev, s_dev) == (4, 77)
        _same_bits(q_dev, q_cpu, "q")
        _same_bits(s_dev, s_cpu, "scales (NaN for the flagged groups)")
        for out_dtype in QUANT_DTYPES:
            _same_bits(ops.dequantize(q_dev, s_dev, n, bits, group_size, dtype=out_dtype),
                       ops.dequantize(q_cpu, s_cpu, n, bits, group_size, dtype=out_dtype), f"dequantize {out_dtype}")
        with pytest.raises(ValueError, match=r"4 non-finite value\(s\).*flat index 77\b"):
            ops.quantize(x.to(DEV), bits=bits, group_size=group_size)


def test_dequantize_cuda_writes_only_its_slice_on_the_current_stream():
    n, group_size = 100_001, 2048
    x = _quant_input(n, group_size, torch.bfloat16, seed=4)
    q, s = ops.quantize(x.to(DEV), bits=4, group_size=group_size)
    expected = ops.dequantize(q.cpu(), s.cpu(), n, 4, group_size, dtype=torch.bfloat16)
    unit = torch.full((n + 100,), 7.0, dtype=torch.bfloat16, device=DEV)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.dequantize(q, s, n, 4, group_size, out=unit[3 : 3 + n])
    stream.synchronize()
    _same_bits(unit[3 : 3 + n], expected, "slice")
    assert (unit[:3] == 7.0).all() and (unit[3 + n :] == 7.0).all()


def test_quantize_mixed_devices_raise_value_error():
    x = torch.randn(100, device=DEV)
    with pytest.raises(ValueError, match="q_out must be on cuda"):
        zerocore._C.quantize(x, 8, 10, torch.empty(100, dtype=torch.int8), torch.empty(10, device=DEV))
    q, s = ops.quantize(x, group_size=10)
    with pytest.raises(ValueError, match="scales must be on cpu"):
        zerocore._C.dequantize(q.cpu(), s, 100, 8, 10, torch.empty(100))


def test_deepspeeds_fused_adam_and_accelerator_on_cuda(monkeypatch):
    """zerocore.deepspeed's FusedAdam (DeepSpeed's signature) steps CUDA parameters with the same kernel as
    zerocore.optim.FusedAdam, bit for bit; get_accelerator() is CUDA's where a GPU is."""
    import zerocore.deepspeed.accelerator as accelerator_module
    from zerocore.deepspeed.ops.adam import FusedAdam as DeepSpeedFusedAdam

    torch.manual_seed(0)
    start = torch.randn(1000, 3, device=DEV)
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    ours = DeepSpeedFusedAdam([params[0]], 1e-2, True, (0.9, 0.99), 1e-8, True, 0.1)
    reference = zerocore.optim.FusedAdam([params[1]], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for grad in _grads(3000, 3, torch.float32):
        for param, optimizer in zip(params, (ours, reference)):
            param.grad = grad.view(1000, 3).clone()
            optimizer.step()
    assert torch.equal(params[0], params[1])
    monkeypatch.setattr(accelerator_module, "_ACCELERATOR", None)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    acc = accelerator_module.get_accelerator()
    assert (acc.device_name(), acc.device_name(0), acc.communication_backend_name()) == ("cuda", "cuda:0", "nccl")
    assert acc.device_count() == torch.cuda.device_count() and acc.memory_allocated() > 0
    assert acc.current_device_name() == f"cuda:{torch.cuda.current_device()}" and acc.on_accelerator(params[0])
    stream = acc.Stream()
    with acc.stream(stream):
        acc.synchronize()
