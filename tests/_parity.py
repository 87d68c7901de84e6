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


def sum_at_its_rounding_bound(pieces: Sequence[torch.Tensor], sign: torch.Generator | float,
                              unit_roundoff: float | None = None) -> torch.Tensor:
    """The sum of ``pieces`` (one tensor's gradients from each piece of the loss) moved, element by element
    with a random sign (drawn from ``sign``, a generator) or the given one (+1 or -1), by the bound on the
    rounding error of summing them in any order and scaling the result: len(pieces) x u x sum |piece|
    (recursive summation: (n - 1) u sum |x|; one more u for the scaling), u the pieces' dtype's unit roundoff
    unless given (a sum that may be rounded to 16 bits on its way)."""
    total, magnitude = pieces[0].clone(), pieces[0].abs()
    for piece in pieces[1:]:
        total += piece
        magnitude += piece.abs()
    if unit_roundoff is None:
        unit_roundoff = torch.finfo(total.dtype).eps / 2
    if isinstance(sign, torch.Generator):
        sign = torch.randint(0, 2, total.shape, generator=sign, dtype=total.dtype) * 2 - 1
    return total + sign * (len(pieces) * unit_roundoff) * magnitude


def piece_gradients(losses: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                    convert: Callable[[torch.Tensor], torch.Tensor] = lambda grad: grad) -> list[list[torch.Tensor]]:
    """For each of ``params``, ``convert`` of its gradient from each of ``losses`` that reaches it."""
    found: list[list[torch.Tensor]] = [[] for _ in params]
    for loss in losses:
        for into, grad in zip(found, torch.autograd.grad(loss, list(params), allow_unused=True)):
            if grad is not None:
                into.append(convert(grad))
    return found


def as_dtype(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floating inputs follow the model's dtype; integer inputs (tokens, class targets) stay as they are."""
    return value.to(dtype) if value.is_floating_point() else value


class ReferencePair:
    """A reference model in fp32 (what a user would run instead of zerocore) and its float64 twin, trained
    side by side on the same batches; ``assert_matches`` applies the parity rule to an engine's state.

    ``wrap`` wraps each (e.g. in DDP); ``make_optimizer`` builds an optimizer for an unwrapped model (it may
    build param groups from the model). ``train_step(loss_of)`` calls ``loss_of(module, dtype)`` once per twin,
    backpropagates, optionally clips (``clip``, ``norm_type``), steps, and returns the fp32 loss and gradient
    norm (or None).

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
                   norm_type: float = 2.0) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert (pieces_of is not None) == (len(self.models) == 3), "pieces_of goes with a piecewise reference"
        results = []
        for index, (model, module, optimizer) in enumerate(zip(self.models, self.modules, self.optimizers)):
            dtype = next(model.parameters()).dtype
            losses = pieces_of(module, dtype) if index == 2 else [loss_of(module, dtype)]
            if index == 2:
                self._gradients_at_their_rounding_bound(model, losses)
            else:
                losses[0].backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type) if clip else None
            optimizer.step()
            optimizer.zero_grad()
            results.append((losses[0].detach().float(), norm))
        return results[0]

    def _gradients_at_their_rounding_bound(self, model: nn.Module, losses: list[torch.Tensor]) -> None:
        """Each trainable parameter's .grad: the sum of the pieces' gradients moved by its rounding error bound;
        None where no piece reached it (as one backward of the whole loss leaves it)."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        for param, found in zip(trainable, piece_gradients(losses, trainable)):
            param.grad = sum_at_its_rounding_bound(found, self.rounding_signs) if found else None

    def assert_matches(self, actual: Mapping[str, torch.Tensor], label: str = "", **rule: float) -> None:
        assert_within_reference_noise(actual, self.models[0].state_dict(), self.models[1].state_dict(), label,
                                      others=[m.state_dict() for m in self.models[2:]], **rule)


class MixedPrecisionReferences:
    """Three references for 16-bit compute with fp32 master weights (how the engine trains in bf16 or fp16):
    each an fp32 master model and its 16-bit copy, which computes every piece of the loss; the pieces' 16-bit
    gradients are summed in fp32 into the master's .grad, Adam steps the master, and the copy takes its
    rounding. The first sums in order; the second and third move each sum up and down by the rounding error
    bound of a sum that may be rounded to 16 bits on its way (a rank's accumulation in 16 bits, the wire).

    Against the float64 run a 16-bit run's distance is mostly 16-bit rounding that every such run shares (a
    write through a 16-bit parameter puts the same rounding into each master), so the rule here compares the
    engine with the first reference directly: the masters may differ by ``factor`` x the larger spread between
    it and the other two (plus ``floor``). Where the pieces of a gradient cancel to within that bound, a
    correct engine's sum may land anywhere in it, zero included (two ranks' 16-bit sums of -0.00808 and 0.00807
    rounded to one magnitude), and Adam's first step turns that into anything from -lr through 0 to +lr: the
    two bounds' references take both ends (a random sign took one, and seed 0's bf16 program, whose engine took
    no step there, failed). Later, once a master crosses a 16-bit rounding boundary and changes what the next
    forwards compute, the spread grows as a correct engine's distance does. A dropped or doubled gradient
    contribution moves a master by a share of lr at once.

    Note [Undetermined signs]: the summation bound covers one window's rounding, not the drift before it. Once
    the masters differ by rounding, every reference (and a correct engine) computes its pieces from slightly
    different 16-bit parameters, and where they cancel, the sum's sign can differ between them by more than the
    bound: seed 1539's bf16 program (world 2, stage 1) summed an expert weight's two pieces to -3.8e-5, -1.7e-4
    and -5.3e-5 in the three references and to +1.1e-5 in the engine, exactly the sum of the pieces its own
    parameters give, and Adam's first step put that element 2 lr away from all three. So wherever the three
    sums, widened by their own spread, hold zero, the second reference takes the widened interval's top and the
    third its bottom: both signs, and the later steps that sign leads to, are in the spread."""

    def __init__(self, model: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                 dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.masters = [copy.deepcopy(model).float() for _ in range(3)]
        self.copies = [copy.deepcopy(master).to(dtype) for master in self.masters]
        self.optimizers = [make_optimizer(master) for master in self.masters]

    @property
    def models(self) -> list[nn.Module]:
        """Every model of the three references (to set an attribute or requires_grad on all of them)."""
        return self.masters + self.copies

    def train_step(self, pieces_of: Callable[[nn.Module], list[torch.Tensor]], clip: float = 0.0,
                   unscale: float = 1.0) -> None:
        """``pieces_of(copy)``: the pieces of the loss, computed by the 16-bit copy (scaled, for fp16); each
        piece's gradient is multiplied by ``unscale`` in fp32."""
        found_by_reference, pairs_by_reference = [], []
        for master, replica in zip(self.masters, self.copies):
            pairs = [(m, c) for m, c in zip(master.parameters(), replica.parameters()) if c.requires_grad]
            found = piece_gradients(pieces_of(replica), [c for _, c in pairs], lambda grad: grad.float() * unscale)
            assert all(torch.isfinite(g).all() for pieces in found for g in pieces), (
                "a reference's 16-bit gradient overflowed where the engine's did not (its step was applied)")
            found_by_reference.append(found)
            pairs_by_reference.append(pairs)
        for index, gradients in enumerate(zip(*found_by_reference)):
            if not gradients[0]:
                for pairs in pairs_by_reference:
                    pairs[index][0].grad = None
                continue
            first = torch.stack(gradients[0]).sum(0) if len(gradients[0]) > 1 else gradients[0][0].clone()
            up, down = (sum_at_its_rounding_bound(pieces, sign, torch.finfo(self.dtype).eps / 2)
                        for pieces, sign in ((gradients[1], 1.0), (gradients[2], -1.0)))
            # Where the references' own sums, widened by how far apart they are, hold zero, the sign of this
            # window's gradient is upstream 16-bit noise (the pieces of a correct engine, computed from masters
            # as far from the first's as the others', can sum to either sign), and Adam's first step makes a sign
            # a whole lr: the bound references take both ends, up above zero, down below (Note [Undetermined
            # signs])
            sums = torch.stack([first, *(torch.stack(pieces).sum(0) for pieces in gradients[1:])])
            width = sums.max(0).values - sums.min(0).values
            high, low = sums.max(0).values + width, sums.min(0).values - width
            undetermined = (low <= 0) & (high >= 0) & (width > 0)
            up = torch.where(undetermined, torch.maximum(up, high), up)
            down = torch.where(undetermined, torch.minimum(down, low), down)
            for pairs, grad in zip(pairs_by_reference, (first, up, down)):
                pairs[index][0].grad = grad
        for master, replica, optimizer in zip(self.masters, self.copies, self.optimizers):
            if clip:
                torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                for param, value in zip(replica.parameters(), master.parameters()):
                    param.copy_(value)

    def write(self, name: str, change: Callable[[torch.Tensor], None]) -> None:
        """A write through the 16-bit parameter ``name`` (``change`` modifies it in place), taken by the master
        where it changed the 16-bit value (Note [Writes through .data])."""
        for master, replica in zip(self.masters, self.copies):
            param, value = replica.get_parameter(name), master.get_parameter(name)
            with torch.no_grad():
                change(param)
                value.copy_(torch.where(value.to(self.dtype) == param, value, param.float()))

    def assert_matches(self, masters: Mapping[str, torch.Tensor], label: str = "", factor: float = FACTOR,
                       floor: float = FLOOR) -> None:
        """``masters``: the engine's fp32 value of every parameter (its master, with the writes through its
        16-bit parameters taken; a frozen one's 16-bit value), by the names of ``named_parameters()``."""
        first, *bounds = ({name: (param if param.requires_grad else replica.get_parameter(name).float())
                           for name, param in master.named_parameters()}
                          for master, replica in zip(self.masters, self.copies))
        assert masters.keys() == first.keys(), f"{label}: names differ: {sorted(set(masters) ^ set(first))}"
        failures = []
        for name, value in masters.items():
            ours = relative_distance(value, first[name])
            spread = max(relative_distance(bound[name], first[name]) for bound in bounds)
            if not ours <= factor * spread + floor:
                failures.append(f"{name}: master {ours:.3g} from the mixed-precision reference's > {factor} x the "
                                f"spread of such references {spread:.3g} + {floor:g}")
        assert not failures, f"{label}: outside the mixed-precision references' rounding spread:\n  " + (
            "\n  ".join(failures))
