"""Writes inputs.safetensors: seed 004's walk-through input (LLMs-from-scratch
ch03: 4 tokens of 3 features, the same sequence stacked twice as a batch).

The token values are the ones seed 004 prints for batch element 0.
Run from the repository root: python examples/seed004/make_inputs.py
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from conformance.io import write_arrays  # noqa: E402

tokens = np.array(
    [[0.3374, -0.1778, -0.3035], [-0.5880, 0.3486, 0.6603], [-0.2196, -0.3792, -0.1606], [-0.4015, 0.6957, -1.8061]],
    dtype=np.float32,
)
write_arrays(Path(__file__).with_name("inputs.safetensors"), {"query": np.stack([tokens, tokens])}, overwrite=True)
