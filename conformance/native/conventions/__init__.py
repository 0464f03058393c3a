"""Measured conventions of each framework's own attention API.

`mha check --conventions` prints this table. Nothing in it is typed in: every
cell comes from running the native API in this process and comparing its
output with the NumPy reference (impl_numpy) on the same q, k, v.

What is measured, per API:
  mask polarity      a bool mask with a known pattern; does the output match
                     reference(allowed=mask) ("attend") or
                     reference(allowed=~mask) ("masked")?
  fully masked row   one query row with every key masked in the API's own
                     polarity; its output is classified against the
                     reference's three masked_row policies ("0", "mean of V
                     (uniform)", "NaN") and its weights row, where the API
                     returns weights.
  causal, T != S     is_causal (or the API's equivalent) with T=2, S=4 and
                     T=4, S=2: top_left (j <= i) or bottom_right
                     (j <= i + S - T) of the reference.
  float32 matmul     a (256, 1024) x (1024, 256) float32 matmul with the
                     framework's default settings on each device present,
                     against float64: relative error near 1e-7 is float32,
                     near 1e-3 is TF32/bf16 (reduced).

The modern arguments (RoPE pairing, what a window argument's value means in
keys visible, softcap before or after the mask, sinks, the QK-norm option)
are a second table, measured by modern.py in this package in the
same run; the native packed and sharded paths (jax's seq lengths, flex_attention
document masks, torch's context_parallel and DTensor heads on 2 gloo
processes) a third, by packed.py; where transformers' ALiBi models (BLOOM, MPT,
Falcon-RW, tiny random models built in the same run) add the bias, how many
times, in which dtype, and what their decode step reads, a fourth, by
alibi_models.py. Keras's own attention (MultiHeadAttention and
keras.ops.dot_product_attention) on each of its backends, tensorflow, jax and
torch, one worker process per backend, is a fifth (the first table's columns,
mask shapes, flash_attention and the kernel run) and a sixth (the same calls
on the same weights across the backends, and the stage that explains each
difference), by keras_backends.py and keras_backends_worker.py.

Layers get identity projections without biases (D = N*H), so their output is
the attention itself, merged over heads, and compares directly with the
reference's. JAX APIs run under jax.jit: one XLA compile per call signature
instead of one per primitive, which keeps the whole run near 10 s.

The project's recorded expectations (expected.json in this
package: the frameworks' documented behaviour, or an earlier measurement where
they document none) never reach a cell; they only list where the measurement
disagrees with them.

Shape letters as in impl_numpy: B batch, T query length, S key length,
N heads, H head dim, D = N*H features.

The package: harness.py (shapes, the reference, Runner/Api, what is measured
of one API), apis.py (the per-API runners and APIS), precision.py (the float32
matmul probe), expectations.py (expected.json), render.py (cells, Markdown,
the terminal), survey.py (the whole run and its command); the second, third and
fourth tables: modern.py, packed.py (with packed_labels.py and packed_sharded.py),
alibi_models.py;
kernels.py, the forced-kernel table (`python -m
conformance.native.conventions.kernels`); features.py, which API takes which
modern feature (`python -m conformance.native.conventions.features`).
"""

from conformance.native.conventions.apis import APIS
from conformance.native.conventions.expectations import (
    EXPECTED_FILE,
    EXPECTED_KEYS,
    EXPECTED_PATH,
    EXPECTED_SOURCE,
    expected,
    parse_expected,
)
from conformance.native.conventions.harness import (
    CAUSAL_SHAPES,
    EMPTY_ROW,
    FLOAT32_REL_ERR_MAX,
    MATMUL_SHAPE,
    NOT_INSTALLED,
    POLICY_LABELS,
    TOL,
    Api,
    B,
    D,
    H,
    N,
    NotExpressible,
    Runner,
    S,
    T,
    measure_api,
    reference,
)
from conformance.native.conventions.render import COLUMNS, disagreements, render_terminal, table_cells, to_markdown
from conformance.native.conventions.survey import main, measure

__all__ = [
    "APIS", "B", "CAUSAL_SHAPES", "COLUMNS", "D", "EMPTY_ROW", "EXPECTED_FILE", "EXPECTED_KEYS", "EXPECTED_PATH",
    "EXPECTED_SOURCE", "FLOAT32_REL_ERR_MAX", "H", "MATMUL_SHAPE", "N", "NOT_INSTALLED", "POLICY_LABELS", "S", "T",
    "TOL", "Api", "NotExpressible", "Runner", "disagreements", "expected", "main", "measure", "measure_api",
    "parse_expected", "reference", "render_terminal", "table_cells", "to_markdown",
]
