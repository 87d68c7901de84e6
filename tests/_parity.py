"""The parity rule: judge zerocore against the rounding noise of the fp32 reference itself.

Two correct fp32 implementations of the same training (DDP + torch AdamW and zerocore, or torch's own foreach
and fused AdamW) do not agree elementwise to any fixed tolerance: Adam divides by sqrt(v) + eps, so for an
element whose gradient is close to zero a one-ulp difference in the gradient (from a different summation
order in a matmul or a reduction) becomes a visible difference in the weight, and which elements cross a
fixed tolerance depends on the machine's kernels. Instead the reference is also trained in float64 on the
same batches (rounding 2^29 times smaller: "the exact answer"), and per tensor

    ||zerocore - exact|| / ||exact||  <=  FACTOR * ||fp32 reference - exact|| / ||exact||  +  FLOOR

zerocore may be as far from the exact answer as a correct fp32 implementation is, with some slack (FACTOR) for
its different but equally valid rounding, and a FLOOR for tensors where the reference happens to round almost
exactly (a relative L2 distance of 1e-6 is a few ulps of fp32 spread over the tensor). A real bug (a gradient
contribution dropped, weight decay applied twice, a step lost) moves a tensor by orders of magnitude more:
tests/test_parity_rule.py breaks the engine on purpose in such ways and checks that this rule catches each.
Losses are well conditioned and stay compared directly. Parameters whose gradient is exactly zero in exact
arithmetic (e.g. an attention key bias: softmax is shift-invariant) turn rounding noise into full-size Adam
steps and carry no information; the test models avoid them (see tests/_models.py).

One fp32 reference is a single sample of that noise. Where an element's gradient is within a few eps of zero
(a near-complete cancellation, not a structural zero), Adam's first step turns the last bits of its gradient
into a large share of lr, and one such element can dominate a tensor's distance: a reference that happened to
round it almost exactly then makes a correct engine look ten times as far (seed 607 of the random programs at
world 4: one element of 256 whose gradient, 12 eps, is the sum of four ranks' gradients some 1e5 times larger;
the engine's reduction order lost 2e-9 of it, the reference's 1e-10). Summing the ranks' and micro-batches'
gradients in another order samples that noise again, and misses it just as often (seeds 54 and 138 at world 3
still failed with four such orders). So a program that trains many drawn configurations
(tests/test_random_programs.py) keeps a second fp32 reference that takes the pieces of the loss (per rank and
micro-batch, as an engine reduces them) one gradient at a time and moves their sum, element by element and with
a random sign, by the rounding error bound of any order of that sum, (pieces) x u x sum |piece|
(:func:`sum_at_its_rounding_bound`): where a gradient cancels to near zero the bound is far above the gradient's
own ulp and this reference moves as far as a correct engine can; elsewhere it is a few ulps, and a dropped or
doubled contribution stays orders of magnitude outside it. The noise is the larger of the two references'.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

FACTOR = 2.0
FLOOR = 1e-6


def relative_distance(value: torch.Tensor, exact: torch.Tensor) -> float:
    """||value - exact|| / ||exact|| in float64 (the absolute distance where exact is all zeros)."""
    exact = exact.detach().double().cpu()  # a full state dict lives on the CPU, a reference may not
    diff = float((value.detach().double().cpu() - exact).norm())
    norm = float(exact.norm())
    return diff / norm if norm > 0 else diff


def assert_within_reference_noise(actual: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                                  exact: Mapping[str, torch.Tensor], label: str = "", factor: float = FACTOR,
                                  floor: float = FLOOR, others: Sequence[Mapping[str, torch.Tensor]] = ()) -> None:
    """Every floating tensor of ``actual`` is within ``factor`` x the fp32 ``reference``'s own distance from
    the float64 ``exact`` run (plus ``floor``; with ``others``, more fp32 references, the largest of their
    distances); integer tensors (e.g. BatchNorm's step count) must be equal."""
    assert actual.keys() == exact.keys() == reference.keys(), (
        f"{label}: state keys differ: {sorted(set(actual) ^ set(exact))}")
    failures = []
    for name, exact_value in exact.items():
        value = actual[name]
        if value.shape != exact_value.shape:
            failures.append(f"{name}: shape {tuple(value.shape)} != {tuple(exact_value.shape)}")
        elif not exact_value.is_floating_point():
            if not torch.equal(value, exact_value):
                failures.append(f"{name}: {value.tolist()} != {exact_value.tolist()}")
        else:
            ours = relative_distance(value, exact_value)
            theirs = max(relative_distance(r[name], exact_value) for r in (reference, *others))
            if not ours <= factor * theirs + floor:  # also catches NaN
                failures.append(f"{name}: relative distance from the float64 run {ours:.3g} > {factor} x the "
                                f"fp32 reference's {theirs:.3g} + {floor:g}")
    assert not failures, f"{label}: outside the fp32 reference's rounding noise:\n  " + "\n  ".join(failures)


def sum_at_its_rounding_bound(pieces: Sequence[torch.Tensor], generator: torch.Generator) -> torch.Tensor:
    """The sum of ``pieces`` (one tensor's gradients from each piece of the loss) moved, element by element with
    a random sign, by the bound on the rounding error of summing them in any order and scaling the result:
    len(pieces) x u x sum |piece| (recursive summation: (n - 1) u sum |x|; one more u for the scaling)."""
    total, magnitude = pieces[0].clone(), pieces[0].abs()
    for piece in pieces[1:]:
        total += piece
        magnitude += piece.abs()
    unit_roundoff = torch.finfo(total.dtype).eps / 2
    sign = torch.randint(0, 2, total.shape, generator=generator, dtype=total.dtype) * 2 - 1
    return total + sign * (len(pieces) * unit_roundoff) * magnitude


def as_dtype(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floating inputs follow the model's dtype; integer inputs (tokens, class targets) stay as they are."""
    return value.to(dtype) if value.is_floating_point() else value


class ReferencePair:
    """A reference model in fp32 (what a user would run instead of zerocore) and its float64 twin, trained
    side by side on the same batches; ``assert_matches`` applies the parity rule to an engine's state.

    ``wrap`` wraps each (e.g. in DDP); ``make_optimizer`` builds an optimizer for an unwrapped model (it may
    build param groups from the model). ``train_step(loss_of)`` calls ``loss_of(module, dtype)`` once per twin,
    backpropagates, optionally clips, steps, and returns the fp32 loss and gradient norm (or None).

    ``piecewise``: a third model, a second fp32 reference, that ``train_step`` trains from
    ``pieces_of(module, dtype)`` (losses that sum to the loss), one gradient per piece, their sum moved by its
    rounding error bound (:func:`sum_at_its_rounding_bound`); ``models[2]``."""

    def __init__(self, model: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                 wrap: Callable[[nn.Module], nn.Module] = lambda m: m, piecewise: bool = False) -> None:
        self.models = [copy.deepcopy(model).float(), copy.deepcopy(model).double()]
        if piecewise:
            self.models.append(copy.deepcopy(model).float())
        self.modules = [wrap(m) for m in self.models]
        self.optimizers = [make_optimizer(m) for m in self.models]
        self.rounding_signs = torch.Generator().manual_seed(0)

    @property
    def fp32(self) -> nn.Module:
        return self.models[0]

    def train_step(self, loss_of: Callable[[nn.Module, torch.dtype], torch.Tensor], clip: float = 0.0,
                   pieces_of: Callable[[nn.Module, torch.dtype], list[torch.Tensor]] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert (pieces_of is not None) == (len(self.models) == 3), "pieces_of goes with a piecewise reference"
        results = []
        for index, (model, module, optimizer) in enumerate(zip(self.models, self.modules, self.optimizers)):
            dtype = next(model.parameters()).dtype
            losses = pieces_of(module, dtype) if index == 2 else [loss_of(module, dtype)]
            if index == 2:
                self._gradients_at_their_rounding_bound(model, losses)
            else:
                losses[0].backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip else None
            optimizer.step()
            optimizer.zero_grad()
            results.append((losses[0].detach().float(), norm))
        return results[0]

    def _gradients_at_their_rounding_bound(self, model: nn.Module, losses: list[torch.Tensor]) -> None:
        """Each trainable parameter's .grad: the sum of the pieces' gradients moved by its rounding error bound;
        None where no piece reached it (as one backward of the whole loss leaves it)."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        pieces: list[list[torch.Tensor]] = [[] for _ in trainable]
        for loss in losses:
            for found, grad in zip(pieces, torch.autograd.grad(loss, trainable, allow_unused=True)):
                if grad is not None:
                    found.append(grad)
        for param, found in zip(trainable, pieces):
            param.grad = sum_at_its_rounding_bound(found, self.rounding_signs) if found else None

    def assert_matches(self, actual: Mapping[str, torch.Tensor], label: str = "", **rule: float) -> None:
        assert_within_reference_noise(actual, self.models[0].state_dict(), self.models[1].state_dict(), label,
                                      others=[m.state_dict() for m in self.models[2:]], **rule)
