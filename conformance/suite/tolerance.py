"""The tolerance policy: how close a result must be to the float64 reference.

Reasoning (docs/conformance.md "Tolerance policy" says the same in prose):

* A dot product of length n computed in a precision with unit round-off u
  has a relative error of order u * sqrt(n) for random-signed data (the
  deterministic bound is n * u; rounding errors of mixed sign add like a
  random walk, Higham, "Accuracy and Stability of Numerical Algorithms",
  sec. 3.6). The forward pass chains four reductions: the projection (D),
  the logits (H), the softmax sum and the attention average (S), the output
  projection (N*V). So L = D + H + S + N*V for the output; L = D + H + S for
  the attention weights; gradients add the batch and sequence sums of the
  kernel gradients, L + B*max(T, S).
* Softmax turns an absolute logit error e into a relative weight error e: a
  logit of magnitude z computed with relative error r is off by z * r. So
  everything downstream of the logits is scaled by (1 + z), z the largest
  finite logit magnitude of the case.
* Errors are measured against the scale of the reference tensor (its largest
  magnitude), so a tensor of tiny values is not judged by a looser absolute
  bar than its neighbours.
* Rounding error follows the size of what was summed, not of the sum
  (Higham sec. 3.5: a dot product's error is bounded by |x|.|y|, not
  |x.y|), and a norm divides the error upstream of it by the RMS it divides
  by. A forward value that cancels (an output of -9e-4 summed from terms of
  0.1) or that a norm divides by its own small RMS (head_dim 1 under RMS
  QK-norm) carries an error of the size of those terms. The reference
  therefore carries forward magnitudes beside its values
  (impl_numpy.magnitudes: the stages run on |inputs| and |weights|, every
  difference a sum, a norm's true 1/RMS kept): elementwise bounds of what
  each value is summed from. Each forward element is allowed at least
  rtol * (1 + z) * its magnitude (the tensor-wide bar still applies where
  it is larger), and z, the logit scale, is the largest logit magnitude
  (|scale| |q|.|k| per entry, after any norm's amplification), since a
  logit's absolute error follows its terms too.
* Gradients cancel (softmax's backward subtracts a row sum; the key bias
  gradient is exactly zero by shift invariance), and rounding error follows
  the size of the terms summed, not of the result. The reference backward
  pass run on absolute values (impl_numpy.backward, gradient_magnitudes=True)
  gives, elementwise, the size of the terms each gradient element is summed
  from (the componentwise bound of Higham sec. 3.5), and each element is
  allowed at least rtol * (1 + z) * its own term magnitude, as a forward
  value is. Not the largest term of the whole tensor: a gradient whose
  terms are large in one row and small in another (a sharp softmax, a
  clipped key) would otherwise be judged by its largest row's noise
  everywhere, an allowance above the gradient itself (issue 38: zero key
  gradients passed). The tensor-wide atol is the float32/64 formula on the
  gradient's own max|reference|, as for every other quantity.

    rtol = SAFETY * u * sqrt(L)
    atol = rtol * (1 + z) * max|reference|
    floor_i = rtol * (1 + z) * magnitude_i        (forward quantities and gradients)
    pass iff |actual - reference| <= max(atol, floor_i) + rtol * |reference| everywhere

margin = max over elements of |actual - reference| / (atol + rtol*|reference|);
a pass has margin <= 1. SAFETY was set from the random-case sweep
(tests/test_conformance_sweep.py) so that the worst margin over thousands of
correct cases stays well below 1 while TF32 (u = 2**-11) inputs in float32
exceed it by orders of magnitude.

Low precision (float16, bfloat16), as the flash-attention maintainers judge
kernels: the bar is REFERENCE_FACTOR times the error of the NumPy reference
run in the same dtype (same-precision reference minus float64 reference),
so a kernel must be about as good as a careful implementation in its own
dtype, and no looser. The u*sqrt(L) formula with the 16-bit u would allow
errors of the size of the output on large logits (bfloat16 logits of 60
carry absolute errors of 0.23); it is used only where no same-precision
error is known (stage localisation). The float32 formula is the floor, for
quantities the 16-bit reference happens to get exactly, and rtol is at least
one 16-bit step (2u): results stored in 16 bits that straddle a rounding
boundary differ by one step whatever the reference's own error. A chunked
core's or a fused kernel's output is judged against the larger of the
stages' and the NumPy chunked core's same-dtype error
(compare.chunked_same_precision: it rounds other intermediates than the
stages), and of a kernel formulation's (compare.kernel_same_precision:
NumPy's backward with the chunked core's precision, a fused kernel's also
with the scale folded into the stored query, the order MLX's CPU kernel
takes); so are such a path's 16-bit gradients (the stages' and the kernel
formulation's errors, the larger): each is one sample of its order's
rounding noise, not its size (issues 40 and 42, docs/conformance.md).

16-bit gradients: atol = max(REFERENCE_FACTOR x the same-dtype reference's
error, the float32 formula on max|reference|), and each element is allowed at
least its own 16-bit noise, u * sqrt(L) * magnitude_i (no safety factor), or
the float32 floor rtol32 * (1 + z) * magnitude_i where larger. A gradient
that cancels (the key bias one is exactly zero) is rounding noise of the
size of its terms, and one 16-bit sample of that noise (the same-dtype
reference's) says little about another order's; the noise of element i
follows element i's terms, not the tensor's largest (policy_for, magnitude).
Without elementwise magnitudes (assert_close's scale_floor) the noise floor
is tensor-wide: u * sqrt(L) * the largest term.

The modern stages lengthen L (modern_length):
* RoPE: the angle position x frequency is rounded to the compute dtype,
  an absolute error u * theta for an angle theta, so the rotated q and k
  carry a relative error of about u * theta_max (theta_max: the largest
  angle of the case, max |position| x the largest frequency). Adding
  theta_max^2 to L makes sqrt(L) >= theta_max: the bar grows with the
  position, as the error does. (cos and sin of a large angle add no more
  than the angle's own rounding: both are computed to within an ulp.)
* QK-norm: a mean of squares over H (head scope) or the whole N*H / K*H
  (all), one more reduction of that length before the logits; the value
  norm the same over V or K*V.
* Sinks: one more term in every softmax denominator (S + 1).
* The cache: every key counts, S is S_total = P + S.
* Softcap: c tanh(x / c) has slope <= 1, so it adds no error beyond one
  rounding; the logit scale z is taken before it (the larger value), the
  conservative side. Its backward's slope 1 - t^2 (t = tanh(x / c)) is a
  difference: the gradient magnitudes count it as 1 + t^2, since near
  saturation the slope cancels and its rounding (about u) dwarfs its value
  (random_case(981596), docs/conformance.md).
* ALiBi: its bias is one rounded product, so z is taken from the alibi
  stage's magnitudes (|logits| + |bias|) where the case has one
  (conformance.suite.compare.case_policy).
* Output gate: its projection is one more reduction over the query input
  (query_dim).
* Local chunks, the QKV clip and the query temperature add none (a mask,
  an exact clamp, one product whose factor is in q's magnitudes).
* Latent attention (MLA): the query's low-rank norm and up-projection (the
  query rank, twice) and the latent's norm and up-projection (kv_rank,
  twice) lengthen the chain before the logits; the absorbed form sums over
  the same C latent features in another order (q W_uk^T . c against
  q . c W_uk), which the same length covers.

`precision="tf32"` (reduced matmul precision on GPUs, asked for explicitly)
uses u = 2**-11 for float32 and says so in the reason.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from weights import dtype_from_name

SAFETY = 8.0
REFERENCE_FACTOR = 3.0

UNIT_ROUNDOFF = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
    "tf32": 2.0**-11,  # 10 explicit mantissa bits
}

QUANTITIES = ("output", "weights", "grad", "stage")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    reason: str
    # An elementwise absolute allowance where it is larger than atol: rtol * (1 + z) * the magnitude of what
    # each element is summed from (None: atol alone). Broadcasts against the compared tensor.
    floor: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    # Where a 16-bit result may be NaN although the float64 reference is finite: the same-dtype reference is
    # NaN there (None: nowhere). See conformance.suite.compare.case_policy.
    nan_allowed: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Comparison:
    ok: bool
    name: str
    max_abs_error: float
    index: tuple[int, ...] | None  # worst element (largest error / allowance)
    actual: float | None
    expected: float | None
    margin: float  # worst |err| / allowance; <= 1 passes
    tolerance: Tolerance
    # Why the comparison is no check (its allowance is not well below the quantity's own size: a zero result
    # would pass; see not_judged_reason), or None. Such a comparison is reported "not judged", never a pass; it
    # still fails where the result is beyond even that allowance.
    not_judged: str | None = None

    @property
    def judged(self) -> bool:
        return self.not_judged is None

    @property
    def label(self) -> str:
        return "FAIL" if not self.ok else ("ok" if self.judged else "not judged")

    def describe(self) -> str:
        if self.index is None:
            return f"{self.name}: {self.label} ({self.tolerance.reason})"
        why = f" [{self.not_judged}]" if self.not_judged and self.ok else ""
        return (
            f"{self.name}: {self.label}{why} margin {self.margin:.3g} "
            f"(worst at {list(self.index)}: got {self.actual!r}, expected {self.expected!r}, "
            f"max abs error {self.max_abs_error:.3g}; rtol {self.tolerance.rtol:.3g}, atol {self.tolerance.atol:.3g}: "
            f"{self.tolerance.reason})"
        )


def reduction_length(quantity: str, *, D: int, H: int, S: int, NV: int, B: int = 1, T: int = 1) -> int:
    if quantity not in QUANTITIES:
        raise ValueError(f"quantity must be one of {', '.join(QUANTITIES)}: got {quantity!r}")
    base = D + H + S
    if quantity == "weights":
        return base
    length = base + NV
    if quantity == "grad":
        length += B * max(T, S)
    return length


def tolerance(
    dtype: str,
    *,
    length: int,
    reference_scale: float,
    logit_scale: float = 0.0,
    precision: str = "highest",
    same_precision_error: float | None = None,
    quantity_is_gradient: bool = False,
) -> Tolerance:
    """The allowance for one compared tensor (see the module docstring)."""
    dtype = dtype_from_name(dtype).name
    amplification = 1.0 + float(logit_scale)
    if dtype in ("float16", "bfloat16") and same_precision_error is not None:
        # The main bar is what a careful implementation in this dtype achieves;
        # the float32 formula is only a floor for quantities it gets exactly.
        unit = UNIT_ROUNDOFF["float32"]
        rtol = SAFETY * unit * math.sqrt(max(length, 1))
        floor = rtol * amplification * float(reference_scale)
        if quantity_is_gradient:
            # Gradients that cancel (the key bias one is exactly zero) are
            # rounding noise of the size of their terms; one 16-bit sample of
            # that noise says little about another's, so the floor is the
            # noise itself: u * sqrt(L) * term magnitude, no safety factor.
            floor = max(floor, UNIT_ROUNDOFF[dtype] * math.sqrt(max(length, 1)) * float(reference_scale))
        atol = max(REFERENCE_FACTOR * float(same_precision_error), floor)
        # Every result is stored in the 16-bit dtype: two correct
        # implementations whose float32 values straddle a rounding boundary
        # land one 16-bit step (2u relative) apart, however small the
        # reference's own error happened to be (the JAX sweep found one:
        # float16 output 0.19336 against 0.19324, reference error 1.7e-5).
        rtol = max(rtol, 2 * UNIT_ROUNDOFF[dtype])
        reason = (f"{dtype}: {REFERENCE_FACTOR:g}x the {dtype} reference's error {same_precision_error:.3g}, "
                  f"plus one {dtype} step (2u relative) "
                  f"(floor: float32's {SAFETY:g}*u*sqrt(L), L={length}, logit scale {logit_scale:.3g})")
        if atol == 0.0:
            atol = np.finfo(np.float64).tiny
        return Tolerance(rtol=rtol, atol=atol, reason=reason)
    unit = UNIT_ROUNDOFF["tf32"] if precision == "tf32" and dtype == "float32" else UNIT_ROUNDOFF[dtype]
    rtol = SAFETY * unit * math.sqrt(max(length, 1))
    atol = rtol * amplification * float(reference_scale)
    reason = f"{dtype}{' with TF32 matmuls' if unit != UNIT_ROUNDOFF[dtype] else ''}: {SAFETY:g}*u*sqrt(L), u={unit:.3g}, L={length}, logit scale {logit_scale:.3g}"
    if atol == 0.0:
        atol = np.finfo(np.float64).tiny  # an all-zero reference: any nonzero error fails
    return Tolerance(rtol=rtol, atol=atol, reason=reason)


# A comparison is a check only where its allowance is well below what it compares: somewhere an all-zero result
# must score a margin of at least JUDGED_ZERO_MARGIN (the allowance at most half the reference's value there).
JUDGED_ZERO_MARGIN = 2.0
# A reference that is zero up to the float64 reference's own rounding of its terms (the key bias gradient, zero
# by shift invariance) is judged: its allowance is the noise a backend may return, and zero is the answer.
ZERO_REFERENCE = 1e-9


def allowance_of(tol: Tolerance, expected) -> np.ndarray:
    """Each element's absolute allowance: max(atol, floor) + rtol * |reference|."""
    r = np.asarray(expected, dtype=np.float64)
    atol = tol.atol if tol.floor is None else np.maximum(tol.atol, np.asarray(tol.floor, dtype=np.float64))
    return atol + tol.rtol * np.abs(np.nan_to_num(r, nan=0.0, posinf=0.0, neginf=0.0))


def structural_zero(tol: Tolerance, expected) -> bool:
    """Whether the reference is zero up to the float64 reference's own rounding of its terms: max |reference| at
    most ZERO_REFERENCE times the largest allowance's scale, max(atol, floor) / rtol (for a gradient, (1 + z)
    times its largest term magnitude)."""
    r = np.abs(np.nan_to_num(np.asarray(expected, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0))
    if r.size == 0 or tol.rtol <= 0:
        return False
    largest = tol.atol if tol.floor is None else max(tol.atol, float(np.max(tol.floor)))
    return float(r.max()) <= ZERO_REFERENCE * largest / tol.rtol


def not_judged_reason(tol: Tolerance, expected) -> str | None:
    """Why a comparison under `tol` cannot fail a result of the right size (None: it can). The margin an all-zero
    result would score is max |reference| / allowance over the elements; below JUDGED_ZERO_MARGIN the allowance
    is not well below the quantity's own size (issue 38: a bfloat16 reference whose own error on a QKV-clipped
    key gradient is 45% of it gives an allowance of 1.4x max|grad|, and a port returning zero passes)."""
    r = np.abs(np.nan_to_num(np.asarray(expected, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0))
    if r.size == 0 or structural_zero(tol, r):
        return None
    zero_margin = float((r / allowance_of(tol, expected)).max())
    if zero_margin >= JUDGED_ZERO_MARGIN:
        return None
    return (f"not judged: the allowance is not well below the quantity's own size (an all-zero result scores "
            f"margin {zero_margin:.3g}, under {JUDGED_ZERO_MARGIN:g})")


def comparison_status(c: Comparison) -> str:
    """A comparison's status: "pass", "fail", or "not judged" (it passed an allowance that is no check:
    not_judged_reason)."""
    return "fail" if not c.ok else ("pass" if c.judged else "not judged")


def compare(name: str, actual, expected, tol: Tolerance) -> Comparison:
    """Compare two arrays under one Tolerance. NaN matches NaN only where the
    reference has NaN (a masked_row="nan" row); shapes must match."""
    a = np.asarray(actual, dtype=np.float64)
    r = np.asarray(expected, dtype=np.float64)
    if a.shape != r.shape:
        return Comparison(False, f"{name} (shape {a.shape} != {r.shape})", math.inf, None, None, None, math.inf, tol)
    if a.size == 0:
        return Comparison(True, name, 0.0, None, None, None, 0.0, tol)
    allowance = allowance_of(tol, r)
    both_nan = np.isnan(a) & np.isnan(r)
    same_inf = np.isinf(a) & np.isinf(r) & (np.sign(a) == np.sign(r))
    with np.errstate(invalid="ignore"):
        err = np.abs(a - r)
    err = np.where(both_nan | same_inf, 0.0, err)
    if tol.nan_allowed is not None:  # the dtype's own NaN (Tolerance.nan_allowed)
        err = np.where(np.isnan(a) & np.asarray(tol.nan_allowed, dtype=bool), 0.0, err)
    err = np.where(np.isnan(err), np.inf, err)  # NaN on one side only is a failure
    ratio = err / allowance
    flat = int(np.argmax(ratio))
    index = tuple(int(i) for i in np.unravel_index(flat, a.shape))
    margin = float(ratio.flat[flat])
    finite_err = err[np.isfinite(err)]
    max_abs = float(finite_err.max()) if finite_err.size == err.size else math.inf
    return Comparison(
        ok=margin <= 1.0, name=name, max_abs_error=max_abs, index=index, actual=float(a.flat[flat]),
        expected=float(r.flat[flat]), margin=margin, tolerance=tol, not_judged=not_judged_reason(tol, r),
    )


def max_finite_abs(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    finite = x[np.isfinite(x)]
    return float(np.abs(finite).max()) if finite.size else 0.0


def modern_length(config, max_position: int) -> int:
    """What the modern stages add to the reduction length L (module docstring)."""
    extra = 0
    if config.rope is not None:
        from weights.rope import inverse_frequencies

        fastest = max(float(inverse_frequencies(config.rope, long=long).max()) for long in (False, True))
        theta_max = abs(max_position) * fastest  # (longrope: either table)
        extra += math.ceil(theta_max**2)
    if config.qk_norm is not None:
        heads = 1 if config.qk_norm.scope == "head" else max(config.num_heads, config.num_kv_heads)
        extra += heads * config.head_dim
    if config.value_norm is not None:  # the same reduction over the value features
        extra += (1 if config.value_norm.scope == "head" else config.num_kv_heads) * config.value_head_dim
    if config.use_sinks:
        extra += 1
    if config.output_gate is not None:  # the gate's projection: one more reduction over the query input
        extra += config.query_dim
    latent = config.latent
    if latent is not None:  # the query's and the latent's norms and up-projections: Qr twice, C twice
        extra += 2 * (latent.query_rank or 0) + 2 * latent.kv_rank
    return extra


def policy_for(config, *, dtype: str, quantity: str, B: int, T: int, S: int, reference, logits=None,
               precision: str = "highest", same_precision_error: float | None = None,
               scale_floor: float = 0.0, max_position: int | None = None, magnitude=None,
               logit_error=None) -> Tolerance:
    """The Tolerance for one quantity of one case: the policy applied.

    scale_floor: a magnitude the reference scale may not fall below. For a
    gradient judged without elementwise magnitudes (assert_close) it is the
    largest term magnitude the gradient is summed from (impl_numpy's
    gradient_magnitudes), because gradients cancel: the key bias gradient is
    exactly zero, and what a backend returns there is rounding noise the size
    of those terms. With magnitude given it is not needed (case_policy
    passes 0): each element's own terms set its floor.

    S: every key the softmax sees (P + S with a cache). max_position: the
    largest |position| of the call (RoPE); None: T + S, the largest a
    call without explicit positions reaches.

    magnitude: the elementwise magnitude of what each element is summed from
    (a forward quantity's from impl_numpy.magnitudes, a gradient's from
    impl_numpy.backward's gradient_magnitudes); each element is then allowed
    at least rtol * (1 + z) * its magnitude (a 16-bit gradient also its
    16-bit noise, u * sqrt(L) * its magnitude). logits: the logits'
    magnitudes (or, without them, the logits) give z.

    logit_error: for a quantity downstream of the softmax, the elementwise
    bound of what a relative rounding of the logits does to it, per unit of
    that rounding (impl_numpy.magnitudes, logit_errors=True). Each element is
    then allowed rtol * (magnitude + logit_error) where that is below
    rtol * (1 + z) * magnitude, and the tensor-wide bar takes z_eff =
    max(logit_error) / max(magnitude) where that is below z: the keys that
    carry weight set the bar, not the largest logit of the case."""
    D = max(config.query_dim, config.key_dim, config.value_dim)
    length = reduction_length(quantity, D=D, H=config.head_dim, S=S, NV=config.num_heads * config.value_head_dim, B=B, T=T)
    length += modern_length(config, T + S if max_position is None else max_position)
    logit_scale = 0.0 if logits is None else max_finite_abs(logits)
    terms = None if magnitude is None else \
        np.nan_to_num(np.abs(np.asarray(magnitude, dtype=np.float64)), nan=0.0, posinf=0.0, neginf=0.0)
    weighted = None
    if terms is not None and logit_error is not None and logits is not None:
        weighted = np.nan_to_num(np.abs(np.asarray(logit_error, dtype=np.float64)), nan=0.0, posinf=0.0, neginf=0.0)
        top = float(terms.max()) if terms.size else 0.0
        effective = float(weighted.max()) / top if top > 0 else logit_scale
        logit_scale = min(logit_scale, effective)  # never above the largest logit's (1 + z)
    tol = tolerance(
        dtype, length=length, reference_scale=max(max_finite_abs(reference), scale_floor),
        logit_scale=logit_scale, precision=precision,
        same_precision_error=same_precision_error, quantity_is_gradient=quantity == "grad" and terms is None,
    )
    if terms is None:
        return tol
    float32_rtol = SAFETY * UNIT_ROUNDOFF["float32"] * math.sqrt(max(length, 1))  # the 16-bit bars' float32 floor
    rtol = float32_rtol if dtype_from_name(dtype).name in ("float16", "bfloat16") and same_precision_error is not None \
        else tol.rtol
    # A 16-bit forward quantity: one 16-bit step of the size of its terms. The stages store intermediate sums in
    # the 16-bit dtype (the attend result, the output projection before its bias), and two correct
    # implementations whose float32 intermediates straddle a rounding boundary land one step of the
    # intermediate's size apart, which a cancelling sum keeps: tf's fused bfloat16 output of random_1450113
    # was 0.328 - 0.400 = -0.0723 where the stages' was 0.330 - 0.400 = -0.0703 (the same 0.4004 bias, the
    # products one bfloat16 step of 0.33 apart), 1.3x a bar scaled by |-0.07|. An intermediate is at most the
    # magnitude (the sum of |terms|), so 2u * magnitude covers one such step; where nothing cancels, the
    # magnitude is the value and this is the bar's own 2u relative.
    step = None
    if dtype_from_name(dtype).name in ("float16", "bfloat16") and same_precision_error is not None \
            and quantity != "grad":
        step = 2 * UNIT_ROUNDOFF[dtype_from_name(dtype).name] * terms
    if weighted is not None:
        full = 0.0 if logits is None else max_finite_abs(logits)
        floor = rtol * np.minimum((1.0 + full) * terms, terms + weighted)
        if step is not None:
            floor = np.maximum(floor, step)
        return dataclasses.replace(tol, floor=floor, reason=tol.reason + (
            f" from the keys with weight (largest {full:.3g}); elementwise at least rtol*(magnitude + logit "
            f"error){' and one 16-bit step of the magnitude (2u*magnitude)' if step is not None else ''} "
            f"(up to {float(floor.max(initial=0.0)):.3g})"))
    floor = rtol * (1.0 + logit_scale) * terms
    if step is not None:
        floor = np.maximum(floor, step)
    if quantity == "grad" and dtype_from_name(dtype).name in ("float16", "bfloat16") and same_precision_error is not None:
        # the 16-bit noise of each gradient element's own terms (tolerance(): quantity_is_gradient)
        floor = np.maximum(floor, UNIT_ROUNDOFF[dtype_from_name(dtype).name] * math.sqrt(max(length, 1)) * terms)
        return dataclasses.replace(tol, floor=floor, reason=tol.reason + (
            "; elementwise at least max(rtol*(1+z), u*sqrt(L))*magnitude, the 16-bit noise of the terms each "
            f"element is summed from (up to {float(floor.max(initial=0.0)):.3g})"))
    # (initial=0.0: an empty quantity has no largest floor, e.g. the gradient of a V4 cache of 0 entries)
    return dataclasses.replace(tol, floor=floor, reason=tol.reason + "; elementwise at least rtol*(1+z)*magnitude"
                               + (" and one 16-bit step of it (2u*magnitude)" if step is not None else "")
                               + ", the size of the terms each element is summed from "
                               f"(up to {float(floor.max(initial=0.0)):.3g})")


def assert_close(name: str, actual, expected, *, config, dtype: str, quantity: str, B: int, T: int, S: int,
                 logits=None, precision: str = "highest", same_precision_error: float | None = None,
                 scale_floor: float = 0.0) -> Comparison:
    """For tests: compare under the policy, raise AssertionError with the numbers.
    For gradients pass scale_floor = max|magnitude| of that gradient, from
    impl_numpy.multi_head_attention_vjp(..., gradient_magnitudes=True)."""
    tol = policy_for(config, dtype=dtype, quantity=quantity, B=B, T=T, S=S, reference=expected, logits=logits,
                     precision=precision, same_precision_error=same_precision_error, scale_floor=scale_floor)
    result = compare(name, actual, expected, tol)
    if not result.ok:
        raise AssertionError(result.describe())
    return result
