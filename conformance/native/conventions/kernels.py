"""Measured conventions of the attention kernels behind the native APIs, each forced in turn.

torch's F.scaled_dot_product_attention picks one of four kernels behind the
caller's back (flash, memory-efficient, cuDNN, math); the context manager
torch.nn.attention.sdpa_kernel(SDPBackend.X) forces one, and the call raises
when that one cannot run. jax.nn.dot_product_attention takes the choice as an
argument, implementation="xla" | "cudnn". Here each forced kernel is one row:

  conventions   mask polarity, the fully masked row and causal alignment for
                T != S: conventions.measure_api on the same inputs as the main
                table, judged against the float64 reference;
  accepts       dtypes, head dims, a bool mask, a float mask, is_causal, GQA,
                T != S, a value head width != the key's, dropout: one small
                call each, "yes" or the kernel's own refusal (torch states why
                a forced kernel cannot run in a warning; that text is kept).

A kernel that computes in half precision only (flash and cuDNN) runs the
convention measurements in float16 and is judged within HALF_TOL, not the
main table's 1e-4. The main table's inputs have 4 features per head, fewer
than those kernels take: every kernel gets q, k and v zero-padded to
PADDED_HEAD_DIM features with the scale 1/sqrt(4) passed explicitly (zero
features add exact zeros to q.k; the value's padding comes out 0 and is
dropped), so all rows see the same problem.

`python -m conformance.native.conventions.kernels --device gpu --json FILE` measures
and prints the tables; on a machine without a GPU every row says so, and
`--device cpu` measures what the CPU builds offer (torch's math and flash
kernels, jax's xla), which is how the tests run this module.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
import warnings
from typing import Any

import numpy as np

from conformance.native.conventions.harness import (
    TOL,
    Api,
    B,
    H,
    N,
    NotExpressible,
    Runner,
    S,
    T,
    _merge,
    _short,
    _split,
    measure_api,
)
from conformance.native.conventions.precision import _versions
from conformance.native.conventions.render import _cell

PADDED_HEAD_DIM = 64
# float16 keeps 11 significant bits (u = 2**-11 = 4.9e-4). The measured outputs are weighted means of
# standard normal values (|v| < 4.5 for these inputs), so float16 inputs, softmax and sum leave an
# error of a few u x 4.5 ~ 3e-3 at most; a wrong convention (the other polarity, the other causal
# alignment, another masked-row policy) misses by more than 1e-2 on the same inputs (conventions.TOL).
HALF_TOL = 5e-3
ACCEPT_DTYPES = ("float16", "bfloat16", "float32", "float64")
ACCEPT_HEAD_DIMS = (8, 32, 64, 80, 96, 128, 160, 192, 256, 512)
ACCEPT_T, ACCEPT_S = 16, 24
TORCH_KERNELS = (("FLASH_ATTENTION", "float16"), ("EFFICIENT_ATTENTION", "float32"), ("CUDNN_ATTENTION", "float16"),
                 ("MATH", "float32"))  # (SDPBackend member, the dtype its row runs in)
# (implementation, dtype, default matmul precision): jax's default precision on a GPU computes float32
# matmuls at reduced precision (the H200 run's xla row erred by 1e-3), so the xla path also runs at "highest"
JAX_KERNELS = (("xla", "float32", None), ("xla", "float32", "highest"), ("cudnn", "float16", None))


# "<other kernel> has been runtime disabled.": torch's note that sdpa_kernel(X) turned the other kernels
# off, printed with every refusal of X; it says nothing about X.
RUNTIME_DISABLED = re.compile(r"[\w ]+ has been runtime disabled\.(; )?")


def _refusal(err: BaseException, caught: list) -> str:
    """The kernel's reason: torch's warnings say why a forced kernel cannot run (the lines after
    "... kernel not used because:"); else the error's first line."""
    reasons = []
    for w in caught:
        text = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", str(w.message))
        for line in text.strip().splitlines():
            line = line.strip()
            if line and not line.endswith("not used because:") and "is deprecated" not in line \
                    and not RUNTIME_DISABLED.search(line) and line not in reasons:
                reasons.append(line)
    why = "; ".join(reasons[:2]) if reasons else _short(err)
    return "no: " + (why if len(why) <= 200 else why[:197] + "...")


def _attempt(call) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call()
        except Exception as err:  # noqa: BLE001 - the refusal is the measurement
            return _refusal(err, caught)
    return "yes"


# -- torch -----------------------------------------------------------------------------------

def _torch_runner(backend: str, dtype: str, device: str) -> Runner:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from impl_torch.device import resolve_device

    dev, dt, kernel = resolve_device(device), getattr(torch, dtype), getattr(SDPBackend, backend)

    def run(q, k, v, masks=None, causal=False, want_weights=True):
        qt, kt, vt = (F.pad(torch.as_tensor(_split(x)).transpose(1, 2).to(dev, dt), (0, PADDED_HEAD_DIM - H))
                      for x in (q, k, v))  # (B, N, L, 64)
        mask = None
        if masks and "attn_mask" in masks:
            mask = torch.as_tensor(masks["attn_mask"])[:, None].to(dev)  # (B, 1, T, S), True = attend
        with torch.no_grad(), sdpa_kernel(kernel):
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal,
                                                 scale=1 / math.sqrt(H))
        out = out[..., :H].transpose(1, 2).to("cpu", torch.float64).numpy()  # (B, T, N, H)
        return _merge(out), None

    def extra():
        return {"accepts": _torch_accepts(kernel, dt, dev), "dtype": dtype}

    return Runner(run, {"attn_mask": "full"}, returns_weights=False, extra=extra,
                       tolerance=TOL if dtype in ("float32", "float64") else HALF_TOL)


def _torch_accepts(kernel, dt, dev) -> dict[str, str]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    g = torch.Generator(device="cpu").manual_seed(0)

    def call(*, dtype=dt, H=64, Hv=None, T=ACCEPT_T, S=ACCEPT_S, N=4, K=4, **kwargs):
        q = torch.randn(1, N, T, H, generator=g).to(dev, dtype)
        k = torch.randn(1, K, S, H, generator=g).to(dev, dtype)
        v = torch.randn(1, K, S, Hv or H, generator=g).to(dev, dtype)
        if kwargs.pop("bool_mask", False):
            kwargs["attn_mask"] = (torch.arange(S)[None] <= torch.arange(T)[:, None] + S - T).to(dev)
        if kwargs.pop("float_mask", False):
            kwargs["attn_mask"] = torch.zeros(T, S).to(dev, dtype)
        with torch.no_grad(), sdpa_kernel(kernel):
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return out

    out = {f"dtype {name}": _attempt(lambda name=name: call(dtype=getattr(torch, name))) for name in ACCEPT_DTYPES}
    out.update({f"head_dim {h}": _attempt(lambda h=h: call(H=h)) for h in ACCEPT_HEAD_DIMS})
    features = {
        "bool mask": dict(bool_mask=True), "float mask": dict(float_mask=True), "is_causal": dict(is_causal=True),
        "is_causal, T == S": dict(is_causal=True, S=ACCEPT_T),
        "GQA (4 query heads on 2)": dict(K=2, enable_gqa=True),
        "T == S": dict(S=ACCEPT_T), "value head dim != key's (32 vs 64)": dict(Hv=32),
        "dropout_p=0.1": dict(dropout_p=0.1),
    }
    out.update({name: _attempt(lambda kw=kw: call(**kw)) for name, kw in features.items()})
    return out


# -- jax --------------------------------------------------------------------------------------

def _jax_device(device: str):
    import jax

    platform = "gpu" if device == "gpu" else "cpu"
    try:
        return jax.devices(platform)[0]
    except RuntimeError as err:
        raise NotExpressible(f"JAX has no {device} device ({_short(err)})") from None


def _jax_runner(implementation: str, dtype: str, device: str, precision: str | None = None) -> Runner:
    import jax
    import jax.numpy as jnp

    from conformance.native.jax_dpa import pad_heads

    dev = _jax_device(device)
    dt = getattr(jnp, dtype)
    call = jax.jit(jax.nn.dot_product_attention, static_argnames=("is_causal", "implementation", "scale"))

    def run(q, k, v, masks=None, causal=False, want_weights=True):
        qj, kj, vj = (pad_heads(jax.device_put(jnp.asarray(_split(x), dt), dev), PADDED_HEAD_DIM) for x in (q, k, v))
        mask = None
        if masks and "mask" in masks:
            mask = jax.device_put(jnp.asarray(masks["mask"])[:, None], dev)  # (B, 1, T, S), True = attend
        with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
            out = call(qj, kj, vj, mask=mask, is_causal=causal, scale=1 / math.sqrt(H),
                       implementation=implementation)  # (B, T, N, 64)
        return _merge(np.asarray(out[..., :H], np.float64)), None

    def extra():
        return {"accepts": _jax_accepts(implementation, dt, dev), "dtype": dtype}

    return Runner(run, {"mask": "full"}, returns_weights=False, extra=extra,
                       tolerance=TOL if dtype in ("float32", "float64") else HALF_TOL)


def _jax_accepts(implementation, dt, dev) -> dict[str, str]:
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)

    def call(*, dtype=dt, H=64, Hv=None, T=ACCEPT_T, S=ACCEPT_S, N=4, K=4, **kwargs):
        def arr(*shape):
            return jax.device_put(jnp.asarray(rng.standard_normal(shape), dtype), dev)

        q, k, v = arr(1, T, N, H), arr(1, S, K, H), arr(1, S, K, Hv or H)
        if kwargs.pop("bool_mask", False):
            kwargs["mask"] = jax.device_put(np.arange(S)[None] <= np.arange(T)[:, None] + S - T, dev)[None, None]
        if kwargs.pop("bias", False):
            kwargs["bias"] = jax.device_put(jnp.zeros((1, 1, T, S), dtype), dev)
        return jax.block_until_ready(jax.nn.dot_product_attention(q, k, v, implementation=implementation, **kwargs))

    out = {}
    for name in ACCEPT_DTYPES:
        if name == "float64" and not jax.config.jax_enable_x64:
            out[f"dtype {name}"] = "not measured: jax_enable_x64 is off in this process"
            continue
        out[f"dtype {name}"] = _attempt(lambda name=name: call(dtype=getattr(jnp, name)))
    out.update({f"head_dim {h}": _attempt(lambda h=h: call(H=h)) for h in ACCEPT_HEAD_DIMS})
    features = {
        "bool mask": dict(bool_mask=True), "float mask": dict(bias=True), "is_causal": dict(is_causal=True),
        "is_causal, T == S": dict(is_causal=True, S=ACCEPT_T),
        "GQA (4 query heads on 2)": dict(K=2), "T == S": dict(S=ACCEPT_T),
        "value head dim != key's (32 vs 64)": dict(Hv=32),
        "local_window_size (2, 0)": dict(local_window_size=(2, 0), S=ACCEPT_T),
    }
    out.update({name: _attempt(lambda kw=kw: call(**kw)) for name, kw in features.items()})
    return out


# -- the table ------------------------------------------------------------------------------------

def apis(device: str) -> list[Api]:
    where = "cuda" if device == "gpu" else device
    out = [Api(f"torch SDPA {where}, sdpa_kernel({backend}) {dtype}", "torch", ("torch",), "torch extra",
                    lambda backend=backend, dtype=dtype: _torch_runner(backend, dtype, device))
           for backend, dtype in TORCH_KERNELS]
    out += [Api(f"jax.nn.dot_product_attention {device}, implementation={impl} {dtype}"
                + (f", default_matmul_precision={precision}" if precision else ""), "jax", ("jax",), "jax extra",
                lambda impl=impl, dtype=dtype, precision=precision: _jax_runner(impl, dtype, device, precision))
            for impl, dtype, precision in JAX_KERNELS]
    return out


def measure(device: str) -> dict:
    """Every kernel's row on `device` ("gpu" or "cpu"); JSON-serialisable. Never raises for a kernel.
    Turns jax_enable_x64 on where jax is installed (the float64 probe; every row passes its dtype)."""
    import importlib.util

    if importlib.util.find_spec("jax") is not None:
        import jax

        jax.config.update("jax_enable_x64", True)
    rows = [measure_api(api) for api in apis(device)]
    for row in rows:
        row.pop("float32_matmul", None)
    return {"device": device, "devices": _device_names(device), "versions": _versions({"torch", "jax"}),
            "rows": rows, "padded_head_dim": PADDED_HEAD_DIM, "half_tolerance": HALF_TOL, "tolerance": TOL,
            "shapes": {"B": B, "T": T, "S": S, "N": N, "H": H}}


def _device_names(device: str) -> dict[str, str]:
    names: dict[str, str] = {}
    try:
        import torch

        names["torch"] = torch.cuda.get_device_name(0) if device == "gpu" and torch.cuda.is_available() else "cpu"
    except Exception as err:  # noqa: BLE001
        names["torch"] = f"error: {_short(err)}"
    try:
        names["jax"] = str(_jax_device(device))
    except Exception as err:  # noqa: BLE001
        names["jax"] = f"error: {_short(err)}"
    return names


def _accept_cell(text: str) -> str:
    text = RUNTIME_DISABLED.sub("", text).replace("|", "/").strip()
    if text == "no:":  # measured before RUNTIME_DISABLED was filtered out: those notes were the only text kept
        return "no (no reason kept)"
    return text.replace("no:", "no: ", 1) if text.startswith("no:") and not text.startswith("no: ") else text


CONVENTION_COLUMNS = (("kernel", "api"), ("dtype", "dtype"), ("bool True means", "mask_true_means"),
                      ("fully masked row", "fully_masked_row"), ("causal T=2, S=4", "causal_T2_S4"),
                      ("causal T=4, S=2", "causal_T4_S2"))


def markdown(data: dict) -> str:
    """The two tables: conventions per kernel, then what each accepts (one column per kernel)."""
    lines = ["| " + " | ".join(title for title, _ in CONVENTION_COLUMNS) + " |",
             "|" + " --- |" * len(CONVENTION_COLUMNS)]
    for row in data["rows"]:
        if row.get("status") != "measured":
            lines.append(f"| {row['api']} | {row['status']}: {row.get('reason', '')} |" + " |" * 4)
            continue
        lines.append("| " + " | ".join(str(_cell(row, key)) for _, key in CONVENTION_COLUMNS) + " |")
    measured = [row for row in data["rows"] if row.get("status") == "measured" and row.get("accepts")]
    if measured:
        keys = list(dict.fromkeys(k for row in measured for k in row["accepts"]))
        lines += ["", "| accepts | " + " | ".join(row["api"] for row in measured) + " |",
                  "|" + " --- |" * (len(measured) + 1)]
        for key in keys:
            lines.append(f"| {key} | " + " | ".join(_accept_cell(row["accepts"].get(key, "-")) for row in measured) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.native.conventions.kernels",
                                description="the native attention kernels, each forced in turn: conventions and "
                                            "what each accepts")
    p.add_argument("--device", default="gpu", choices=["cpu", "gpu"])
    p.add_argument("--json", metavar="FILE", help="write the measurements as JSON")
    args = p.parse_args(argv)
    data = measure(args.device)
    if args.json:
        from weights.atomic import write_bytes_atomic

        write_bytes_atomic(args.json, (json.dumps(data, indent=1, default=str) + "\n").encode())
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__: list[Any] = ["measure", "markdown", "apis", "PADDED_HEAD_DIM", "HALF_TOL"]
