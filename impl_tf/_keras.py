"""Keras on the TensorFlow backend, or a clear ImportError.

Every module of impl_tf imports keras through here. The backend is chosen
when keras is first imported: we ask for TensorFlow (KERAS_BACKEND), and
refuse to run on another one rather than silently computing with it.
"""

from __future__ import annotations

import os
import sys

_keras_was_imported = "keras" in sys.modules
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up chatter on stderr

import keras  # noqa: E402

if keras.backend.backend() != "tensorflow":
    _why = (
        "keras was imported before impl_tf" if _keras_was_imported
        else f"KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}"
    )
    raise ImportError(
        f"impl_tf needs Keras on the TensorFlow backend, but keras is running on {keras.backend.backend()!r} "
        f"({_why}); set KERAS_BACKEND=tensorflow before keras is first imported"
    )

import tensorflow as tf  # noqa: E402

__all__ = ["keras", "tf"]
