"""What every command line of the project shares: exit codes, one-line errors
(OneLineParser, guarded), full-width output on a pipe, and the package's
version. `mha` (conformance.cli) and the module commands
(`python -m conformance.native.conventions`, ...) use it; it imports nothing
of the suite, so any layer may."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import sys
from collections.abc import Callable
from pathlib import Path

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
# The reader of stdout went away (`mha trace --json | head`): exit without a
# word, with the status a shell shows for a process killed by SIGPIPE
# (128 + 13), as cat or grep do there, so `set -o pipefail` still sees that
# the output was not all read. Not 0: the run may have been cut short.
EXIT_CLOSED_PIPE = 141
DISTRIBUTION = "mha-conformance"
# rich wraps at 80 columns when stdout is not a terminal (or at the width of
# the terminal on stdin); a file or a pipe gets whole lines instead: this many
# columns, through the COLUMNS variable rich reads (one setting for every
# console any subcommand makes). A COLUMNS the user set wins.
REDIRECTED_COLUMNS = 4096

class BackendUnavailable(RuntimeError):
    """The backend's framework (or the backend itself) is not installed here."""


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus an error; we print only the error, on one line."""

    def error(self, message: str):  # noqa: D401
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(EXIT_USAGE)


def package_version() -> str:
    """The installed distribution's version; from a source checkout that is
    not installed, pyproject.toml's, marked so."""
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(DISTRIBUTION)
    import tomllib

    with contextlib.suppress(OSError, tomllib.TOMLDecodeError, KeyError, TypeError):
        project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
        if project["project"]["name"] == DISTRIBUTION:
            return f"{project['project']['version']} (source checkout, not installed)"
    return "unknown (not installed)"


@contextlib.contextmanager
def _environment(**values: str):
    """Set environment variables for the block, then put back what was there
    (main() also runs inside test processes)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # closed or replaced stdout
        return False


@contextlib.contextmanager
def full_width_output():
    """COLUMNS=REDIRECTED_COLUMNS for the block when stdout is a file or a
    pipe and the user set none. Not around argument parsing: argparse reads
    COLUMNS too, and its --help is best wrapped at 80 on a pipe."""
    wide = "COLUMNS" not in os.environ and not _stdout_is_terminal()
    with _environment(**({"COLUMNS": str(REDIRECTED_COLUMNS)} if wide else {})):
        yield


def _closed_pipe() -> int:
    # Point stdout at /dev/null so the interpreter's final flush of what is
    # still buffered cannot raise BrokenPipeError a second time.
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_CLOSED_PIPE


def guarded(command: Callable[[], int]) -> int:
    """Run a command line's work as `mha` does: framework log lines filtered
    (conformance.logs.quiet_framework_logging), every error one line on
    stderr, a quiet exit on a closed stdout."""
    from conformance.logs import quiet_framework_logging

    restore_stderr = quiet_framework_logging()  # before anything imports a framework
    try:
        code = command()
        sys.stdout.flush()  # a closed pipe shows up here, inside the handlers below
        return code
    except BrokenPipeError:
        return _closed_pipe()
    except (ValueError, OSError, BackendUnavailable) as err:
        message = str(err).replace("\n", " ") or type(err).__name__
        if isinstance(err, OSError) and err.filename and err.strerror:
            message = f"{err.filename}: {err.strerror}"
        sys.stderr.write(f"mha: error: {message}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("mha: interrupted\n")
        return 130
    except Exception as err:  # a bug in mha itself: still one line, but say so
        if os.environ.get("MHA_DEBUG"):
            raise
        sys.stderr.write(f"mha: internal error: {type(err).__name__}: {err} (MHA_DEBUG=1 shows the traceback)\n")
        return EXIT_INTERNAL
    finally:
        restore_stderr()
