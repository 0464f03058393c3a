"""The project's recorded expectations of the conventions table (expected.json
beside this module); they never reach a cell, they only list where the
measurement disagrees with them."""

from __future__ import annotations

import functools

# The project's recorded expectations, a data file shipped beside this module
# (package data) so a clone or an installed wheel has them; see its "about".
EXPECTED_FILE = "expected.json"
EXPECTED_PATH = f"conformance/native/conventions/{EXPECTED_FILE}"
EXPECTED_SOURCE = f"the recorded expectations ({EXPECTED_PATH})"
# Row keys an expectation may name: the table's columns and the extra
# measurements some runners add (ONNX's past-cache causal alignment).
EXPECTED_KEYS = ("mask_true_means", "fully_masked_row", "fully_masked_weights", "causal_T2_S4", "causal_T4_S2",
                 "causal_T2_S4_past_cache", "rope_pairing", "window", "softcap_order", "sinks", "qk_norm",
                 "keys_visible", "empty_row", "packing", "alibi_placement", "alibi_times_added", "float64_model",
                 "decode_cache_positions")


def parse_expected(text: str) -> dict[str, dict[str, str]]:
    """API name -> {row key: expected value} from EXPECTED_FILE's text; a
    malformed file is a one-line ValueError."""
    import json

    try:
        apis = json.loads(text)["apis"]
        table = {str(api): {str(k): str(v) for k, v in entry["expect"].items()} for api, entry in apis.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{EXPECTED_PATH}: malformed: {type(err).__name__}: {err}") from None
    for api, expect in table.items():
        unknown = sorted(set(expect) - set(EXPECTED_KEYS))
        if unknown:
            raise ValueError(f"{EXPECTED_PATH}: {api!r} names unknown keys {unknown} "
                             f"(known: {', '.join(EXPECTED_KEYS)})")
    return table


@functools.cache
def expected() -> dict[str, dict[str, str]]:
    """The recorded expectations, read once from the package's data file.
    Only used to list disagreements."""
    import importlib.resources

    resource = importlib.resources.files("conformance.native.conventions") / EXPECTED_FILE
    try:
        text = resource.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"{EXPECTED_PATH}: cannot read: {err}") from None
    return parse_expected(text)


