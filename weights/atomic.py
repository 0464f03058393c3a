"""Atomic file writes: the destination is the old file or the new one, never a mix.

The bytes go to a temporary file beside the destination, are fsynced, and are
then moved into place with one rename (or one hard link when the destination
must not be replaced, so two writers cannot both think they created it).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, overwrite: bool = False) -> None:
    path = Path(path)
    if not overwrite and path.exists():
        raise FileExistsError(f"{path} exists; pass overwrite=True (CLI: --overwrite) to replace it")
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise FileNotFoundError(f"directory {directory} does not exist (writing {path})")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if overwrite:
            os.replace(tmp_name, path)
        else:
            try:
                os.link(tmp_name, path)  # fails if path appeared meanwhile
            except FileExistsError:
                raise FileExistsError(
                    f"{path} exists; pass overwrite=True (CLI: --overwrite) to replace it"
                ) from None
            os.unlink(tmp_name)
    except BaseException:
        # Ctrl-C or any error: leave no temporary file behind.
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
