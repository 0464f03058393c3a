"""Strict JSON for headers and configs from other people's files.

json.loads keeps the last of duplicate keys silently, accepts NaN/Infinity,
lone surrogates and arbitrarily deep nesting; these helpers refuse each with
a one-line reason (a ValueError subclass the callers turn into their own
error type).
"""

from __future__ import annotations

import json


class _HeaderProblem(ValueError):
    """Raised from inside json.loads hooks; read_safetensors turns it into `error`."""


def _checked_text(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _HeaderProblem(
            f"contains the string {_short(text)} with a lone surrogate escape (not valid Unicode)"
        ) from None
    return text


def _object_pairs(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object that refuses duplicate keys (json.loads would keep the last silently)."""
    seen: set[str] = set()
    for key, value in pairs:
        _checked_text(key)
        if isinstance(value, str):
            _checked_text(value)
        if key in seen:
            raise _HeaderProblem(f"has the key {_short(key)} twice (duplicate)")
        seen.add(key)
    return dict(pairs)


def _refuse_constant(name: str):
    raise _HeaderProblem(f"contains {name}, which is not JSON")


def _short(value: object, limit: int = 80) -> str:
    """repr of a value from a file, cut so a message stays short."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _show_name(name: object) -> str:
    """A tensor name from a file as a message may show it: as is if short and printable, else a cut repr."""
    if isinstance(name, str) and name.isprintable() and len(name) <= 80 and "," not in name:
        return name
    return _short(name)


def show_names(names: list, limit: int = 10) -> str:
    """Names for a one-line message: at most `limit`, each shown safely, then how many more."""
    shown = ", ".join(_show_name(n) for n in names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def _parse_header(raw: bytes) -> object:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity, no lone surrogates. Raises _HeaderProblem."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _HeaderProblem(f"is not UTF-8 (byte {err.start})") from None
    return _parse_json_text(text, what="is")


def _parse_json_text(text: str, what: str = "") -> object:
    """json.loads that refuses duplicate keys, NaN/Infinity, lone surrogates and deep nesting (_HeaderProblem)."""
    what = f"{what} " if what else ""
    try:
        return json.loads(text, object_pairs_hook=_object_pairs, parse_constant=_refuse_constant)
    except json.JSONDecodeError as err:
        raise _HeaderProblem(f"{what}not JSON: {err.msg} at byte {err.pos}") from None
    except RecursionError:
        raise _HeaderProblem(f"{what}not usable JSON: nested too deeply") from None
    except _HeaderProblem:
        raise
    except ValueError as err:  # e.g. an integer beyond Python's 4300-digit conversion limit
        raise _HeaderProblem(f"{what}not usable JSON: {str(err).splitlines()[0]}") from None
