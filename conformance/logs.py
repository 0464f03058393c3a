"""Framework log lines the command line did not ask for, kept off its output:
a filter process on file descriptor 2 for absl's C++ lines, Python loggers
set to errors. Shared by every command line of the project (`mha`, the
module commands) and the worker processes they start."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

# -- framework logging the CLI did not ask for ------------------------------------------
#
# The CLI's output is ours. TensorFlow, XLA (JAX) and onnxruntime log from C++
# through absl straight to file descriptor 2, in glog's format ("I0000
# 00:00:1795606567.396789 5509 port.cc:153] oneDNN custom operations are on
# ..."; on CPUs without AVX-512 also "E0000 ... oneDNN supports DT_HALF only on
# platforms with AVX-512"). absl writes every message to stderr until
# absl::InitializeLog() is called, which TensorFlow never does, so neither
# TF_CPP_MIN_LOG_LEVEL nor any Python setting reaches those lines (abseil-cpp
# PRs #1718 and #1957 propose honouring the threshold before initialisation).
# The CLI therefore filters its own fd 2: `quiet_framework_logging` puts a pipe
# there, read by a small process that drops absl's lines and forwards the rest.
# A process rather than a thread, so what a dying framework wrote just before an
# abort still reaches the terminal. Fatal ("F") lines always pass; MHA_DEBUG=1
# keeps everything. The continuation lines of a multi-line message would pass,
# but those TensorFlow writes (its CPU-feature notice) go through its own
# logger, which TF_CPP_MIN_LOG_LEVEL=3 silences at the source. Worker processes (`mha check --jobs`) inherit both the
# pipe and QUIET_ENV, so their lines are filtered and their Python loggers quieted.

QUIET_ENV = "MHA_QUIET_FRAMEWORK_LOGS"  # set by the CLI; inherited by its worker processes

# The filter process's source: stdin (the pipe) -> stdout (the real stderr).
# A partial line that could be the start of an absl line waits for the rest at
# most 50 ms, so progress bars (no newline) and prompts pass at once.
_FILTER = r"""
import os, re, select, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for mha, which still writes after it

class Finish(Exception):
    pass

def finish(signum, frame):  # mha is done writing: drain what the pipe holds, then exit (see restore)
    raise Finish

signal.signal(signal.SIGUSR1, finish)
LINE = re.compile(rb"[IWE]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^\]\n]*:\d+\] ")  # seconds: epoch before InitializeLog
BANNER = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
out, pending, passthrough, alive = sys.stdout.buffer, b"", False, True

def write(data):
    global alive
    if alive and data:
        try:
            out.write(data)
            out.flush()
        except OSError:  # our stderr is gone: keep draining so mha never sees EPIPE
            alive = False

def dropped(line):
    return LINE.match(line) is not None or line.startswith(BANNER)

finishing = False
while True:
    try:
        if pending and not finishing and not select.select([0], [], [], 0.05)[0]:
            write(pending)
            pending, passthrough = b"", True
            continue
        if finishing and not select.select([0], [], [], 0)[0]:
            break  # everything written before the signal has been read
        chunk = os.read(0, 65536)
    except Finish:
        finishing = True
        continue
    if not chunk:
        break
    data, pending = pending + chunk, b""
    while data:
        end = data.find(b"\n") + 1
        if passthrough or end:
            line, data = (data[:end], data[end:]) if end else (data, b"")
            if passthrough or not dropped(line):
                write(line)
            passthrough = not end
        elif data[:1] in b"IWE":
            pending, data = data, b""
        else:
            write(data)
            data, passthrough = b"", True
if pending and not dropped(pending):
    write(pending)
"""


def import_keras():
    """keras, on the TensorFlow backend unless keras was already imported (the conventions tables' Keras
    probes); TensorFlow's C++ log kept to warnings."""
    if "keras" not in sys.modules:
        os.environ.setdefault("KERAS_BACKEND", "tensorflow")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    return keras


def quiet_python_loggers() -> None:
    """Under the CLI (QUIET_ENV set), framework loggers already imported
    report errors only. Called after each framework import."""
    if not os.environ.get(QUIET_ENV):
        return
    if "absl.logging" in sys.modules:  # absl-py's logger must be created by absl itself
        sys.modules["absl.logging"].set_verbosity(logging.ERROR)
    for name in ("tensorflow", "jax", "flax", "keras"):
        if name in sys.modules:
            logging.getLogger(name).setLevel(logging.ERROR)
    if "onnxruntime" in sys.modules:
        try:
            sys.modules["onnxruntime"].set_default_logger_severity(3)  # 3 = ERROR
        except Exception:  # noqa: BLE001 - an onnxruntime without the call still runs
            pass


def quiet_framework_logging():
    """For the CLI's process (and its workers): framework log lines off.
    Returns a function that restores fd 2 and the environment and waits for
    the filter to drain; call it before exiting. Filters nothing under
    MHA_DEBUG=1, in a process whose parent already filters, when sys.stderr is
    not fd 2 (pytest's capture, an embedding program) or off POSIX."""
    if os.environ.get("MHA_DEBUG") or os.environ.get(QUIET_ENV):
        quiet_python_loggers()
        return lambda: None
    saved = {name: os.environ.get(name) for name in ("TF_CPP_MIN_LOG_LEVEL", QUIET_ENV)}
    # TensorFlow's own C++ logger honours this: all but fatal off, as the filter does
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ[QUIET_ENV] = "1"
    quiet_python_loggers()
    filter_process, original = _start_filter() or (None, None)

    def restore() -> None:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if filter_process is None:
            return
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(original, 2)  # closes this process's write end of the pipe
        os.close(original)
        # The filter sees EOF once every process holding the pipe has exited. One may outlive this call:
        # multiprocessing's resource tracker (started with `mha check`'s worker pool, it ends with this
        # process), which held the exit 5 s here. Everything written so far is in the pipe, so a filter
        # still waiting after a moment (by then long started, its signal handler set) is told to drain it
        # and exit.
        try:
            filter_process.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            try:
                filter_process.send_signal(signal.SIGUSR1)
                filter_process.wait(timeout=5)
            except (subprocess.TimeoutExpired, OSError):  # the filter ends with the last holder of the pipe
                pass

    return restore


def _start_filter():
    """(filter process, saved fd of the real stderr) with fd 2 now the pipe, or None."""
    try:
        if os.name != "posix" or sys.stderr is None or sys.stderr.fileno() != 2:
            return None
    except (AttributeError, OSError, ValueError):  # a replaced sys.stderr without a file descriptor
        return None
    sys.stderr.flush()
    original = os.dup(2)
    try:
        filter_process = subprocess.Popen([sys.executable, "-I", "-S", "-c", _FILTER], stdin=subprocess.PIPE,
                                          stdout=original, stderr=original)
    except OSError:
        os.close(original)
        return None
    os.dup2(filter_process.stdin.fileno(), 2)
    filter_process.stdin.close()  # fd 2 is now the pipe's only write end in this process
    return filter_process, original
