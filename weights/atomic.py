"""Atomic file writes: the destination is the old file or the new one, never a mix.

The bytes go to a temporary file beside the destination, are fsynced, and are
then moved into place with one rename (or one hard link when the destination
must not be replaced, so two writers cannot both think they created it).

The temporary file is created with mode 0o666 minus the umask, as open()
would create the destination (tempfile.mkstemp's 0o600 made every weights
file private to its writer); a replaced file keeps its permission bits. Its name is chosen before it is created, so an
interrupt that lands just after the creation still knows what to remove.
A SIGKILL leaves `.NAME.<hex>.tmp` behind (nothing can run); the
destination is still the old file or the new one.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, overwrite: bool = False, durable: bool = True) -> None:
    """durable=False skips the fsyncs, for a cache: a file a crash loses (or leaves empty) is recomputed."""
    path = Path(path)
    if not overwrite and path.exists():
        raise FileExistsError(f"{path} exists; pass overwrite=True (CLI: --overwrite) to replace it")
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise FileNotFoundError(f"directory {directory} does not exist (writing {path})")
    tmp_name = None
    try:
        for _ in range(100):
            candidate = os.path.join(directory, f".{path.name}.{secrets.token_hex(8)}.tmp")
            tmp_name = candidate  # known before the file exists: an interrupt after creation can remove it
            try:
                fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
                break
            except FileExistsError:
                tmp_name = None
        else:
            raise FileExistsError(f"could not create a temporary file beside {path}")
        with os.fdopen(fd, "wb") as handle:
            if overwrite:
                _keep_mode(path, handle.fileno())
            handle.write(data)
            if durable:
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
        if tmp_name is not None:
            try:
                os.unlink(tmp_name)
            except FileNotFoundError:
                pass
        raise
    if durable:
        _fsync_directory(directory)


def _keep_mode(path: Path, fd: int) -> None:
    """A replaced file keeps its permission bits (a file made private stays private)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if stat.S_ISREG(mode):
        os.fchmod(fd, stat.S_IMODE(mode))


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
