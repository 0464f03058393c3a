"""A thin layer around the functional spec: it holds a config and tensors."""

from __future__ import annotations

import os

import numpy as np

import weights
from weights import AttentionConfig

from .attention import multi_head_attention


class MultiHeadAttention:
    def __init__(self, config: AttentionConfig, tensors: dict[str, np.ndarray]):
        self.config = config
        # checked once, here (values included), and held read-only: a call reads the weights once, not twice
        self.tensors = weights.CheckedTensors(config, tensors)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> MultiHeadAttention:
        return cls(*weights.load(path))

    @classmethod
    def from_tensors(cls, config: AttentionConfig, tensors: dict[str, np.ndarray]) -> MultiHeadAttention:
        return cls(config, tensors)

    def to_tensors(self) -> dict[str, np.ndarray]:
        return {name: t.copy() for name, t in self.tensors.items()}

    def __call__(self, query, key=None, value=None, **options):
        return multi_head_attention(self.config, self.tensors, query, key, value, **options)
