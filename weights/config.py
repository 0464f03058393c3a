"""AttentionConfig: the one statement of a layer's shape and behaviour.

Shape letters (see impl_numpy for the full list): N query heads, K key/value
heads, H head dim, V value head dim, O output features.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

MASKED_ROW_POLICIES = ("zero", "uniform", "nan")


def _check_positive_int(name: str, value: Any) -> None:
    # bool is an int subclass; True as a head count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer: got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false: got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """A multi-head attention layer. Defaults resolve in __post_init__, so a
    constructed config never holds None except in `scale`."""

    num_heads: int  # N
    query_dim: int  # features of the query input
    head_dim: int  # H, per-head width of queries and keys
    key_dim: int | None = None  # features of the key input; default query_dim
    value_dim: int | None = None  # features of the value input; default key_dim
    value_head_dim: int | None = None  # V; default head_dim
    out_dim: int | None = None  # O; default query_dim (a residual-friendly width)
    num_kv_heads: int | None = None  # K; default num_heads (plain MHA); 1 is MQA
    use_query_bias: bool = True
    use_key_bias: bool = True
    use_value_bias: bool = True
    use_output_bias: bool = True
    scale: float | None = None  # multiplies q.k; None means 1/sqrt(head_dim)
    dropout: float = 0.0  # probability of dropping an attention weight in training
    masked_row: str = "zero"  # a query row with no allowed key: "zero" | "uniform" | "nan"

    def __post_init__(self) -> None:
        _check_positive_int("num_heads", self.num_heads)
        _check_positive_int("query_dim", self.query_dim)
        _check_positive_int("head_dim", self.head_dim)
        resolved = {
            "key_dim": self.query_dim if self.key_dim is None else self.key_dim,
            "value_head_dim": self.head_dim if self.value_head_dim is None else self.value_head_dim,
            "out_dim": self.query_dim if self.out_dim is None else self.out_dim,
            "num_kv_heads": self.num_heads if self.num_kv_heads is None else self.num_kv_heads,
        }
        resolved["value_dim"] = resolved["key_dim"] if self.value_dim is None else self.value_dim
        for name, value in resolved.items():
            _check_positive_int(name, value)
            object.__setattr__(self, name, value)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                "num_kv_heads must divide num_heads: "
                f"got num_kv_heads={self.num_kv_heads}, num_heads={self.num_heads}"
            )
        for name in ("use_query_bias", "use_key_bias", "use_value_bias", "use_output_bias"):
            _check_bool(name, getattr(self, name))
        if self.scale is not None:
            bad = isinstance(self.scale, bool) or not isinstance(self.scale, (int, float))
            try:
                bad = bad or not math.isfinite(float(self.scale))
            except OverflowError:  # an int beyond float range
                bad = True
            if bad:
                shown = repr(self.scale) if len(repr(self.scale)) <= 40 else repr(self.scale)[:37] + "..."
                raise ValueError(f"scale must be a finite number or null: got {shown}")
            object.__setattr__(self, "scale", float(self.scale))
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be a number in [0, 1): got {self.dropout!r}")
        object.__setattr__(self, "dropout", float(self.dropout))
        if self.masked_row not in MASKED_ROW_POLICIES:
            raise ValueError(
                f"masked_row must be one of {', '.join(MASKED_ROW_POLICIES)}: got {self.masked_row!r}"
            )

    # -- derived quantities -------------------------------------------------
    @property
    def effective_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale

    @property
    def group_size(self) -> int:
        """G = N / K: how many query heads share one key/value head."""
        return self.num_heads // self.num_kv_heads

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """The canonical tensors this config has, name -> shape."""
        N, K, H, V = self.num_heads, self.num_kv_heads, self.head_dim, self.value_head_dim
        shapes: dict[str, tuple[int, ...]] = {"query.kernel": (self.query_dim, N, H)}
        if self.use_query_bias:
            shapes["query.bias"] = (N, H)
        shapes["key.kernel"] = (self.key_dim, K, H)
        if self.use_key_bias:
            shapes["key.bias"] = (K, H)
        shapes["value.kernel"] = (self.value_dim, K, V)
        if self.use_value_bias:
            shapes["value.bias"] = (K, V)
        shapes["output.kernel"] = (N, V, self.out_dim)
        if self.use_output_bias:
            shapes["output.bias"] = (self.out_dim,)
        return shapes

    # -- serialisation -------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def replace(self, **changes: Any) -> AttentionConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Any) -> AttentionConfig:
        if not isinstance(data, dict):
            raise ValueError(f"config must be a JSON object: got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"config has unknown fields: {', '.join(map(repr, unknown))}")
        missing = sorted(name for name in ("num_heads", "query_dim", "head_dim") if name not in data)
        if missing:
            raise ValueError(f"config is missing required fields: {', '.join(missing)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> AttentionConfig:
        from .strict_json import _HeaderProblem, _parse_json_text

        if not isinstance(text, str):
            raise ValueError(f"config is not valid JSON: got {type(text).__name__}")
        try:
            data = _parse_json_text(text)
        except _HeaderProblem as err:
            raise ValueError(f"config is not valid JSON: {err}") from None
        return cls.from_dict(data)
