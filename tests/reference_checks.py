"""Judging a framework backend on the case grid, the way `mha check` does.

Framework tests go through conformance.compare.run_case, so they use exactly
the tolerance policy of the suite (scales, gradient magnitudes, same-precision
errors) and their failures read like `mha check`'s.
"""

from __future__ import annotations

from conformance.compare import STATUS_PASS, CaseResult, judge_gradients, run_case


class WithOptions:
    """An adapter that adds fixed call options (e.g. use_sdpa=True)."""

    def __init__(self, adapter, **extra):
        self.adapter, self.extra = adapter, extra

    def devices(self):
        return self.adapter.devices()

    def forward(self, config, tensors, inputs, options, **kwargs):
        return self.adapter.forward(config, tensors, inputs, {**options, **self.extra}, **kwargs)

    def vjp(self, config, tensors, inputs, options, d_output, **kwargs):
        return self.adapter.vjp(config, tensors, inputs, {**options, **self.extra}, d_output, **kwargs)


def describe(result: CaseResult) -> str:
    lines = [f"{result.case} {result.backend}/{result.device}/{result.dtype}: {result.status} {result.message}"]
    lines += [c.describe() for c in result.comparisons if not c.ok]
    if result.divergence is not None:
        lines.append(result.divergence.describe())
    if "traceback" in result.arrays:
        lines.append(result.arrays["traceback"])
    return "\n".join(lines)


def assert_case_conforms(case, dtype, backend_id, adapter, *, gradients=True, device="cpu", precision="highest") -> CaseResult:
    result = run_case(case, backend_id, dtype=dtype, adapter=adapter, gradients=gradients, device=device,
                      precision=precision)
    assert result.status == STATUS_PASS, describe(result)
    return result


def assert_gradients_conform(case, dtype, grads, *, precision="highest") -> None:
    """Gradients obtained some other way (a layer's own backward) under the policy."""
    failures = [c.describe() for c in judge_gradients(case, dtype, grads, precision=precision) if not c.ok]
    assert not failures, f"{case.name} {dtype}:\n" + "\n".join(failures)
