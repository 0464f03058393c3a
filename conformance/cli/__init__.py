"""The `mha` command line (commands) and its file handling: inputs and
outputs (io), checkpoint files (files) and `mha convert` (convert)."""

from conformance.cli.commands import main

__all__ = ["main"]
