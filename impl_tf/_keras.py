"""Keras, on the backend it runs on: TensorFlow, JAX or PyTorch.

Every module of impl_tf imports keras through here. Keras fixes its backend
when it is first imported (KERAS_BACKEND): we ask for TensorFlow when nothing
else was asked for, and run on whichever of the three Keras 3 backends keras
is on. The layer and its stages are keras.ops throughout; what only
TensorFlow has (tf.function graphs and XLA, the chunked path's loops, the
in-place cache's variables, GradientTape) lives in tf_only.py and chunked.py,
imported on the TensorFlow backend alone.

`tf` is TensorFlow on the TensorFlow backend; on the others reading it raises
an ImportError that says what needs TensorFlow.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up chatter on stderr

import keras  # noqa: E402

BACKENDS = ("tensorflow", "jax", "torch")
BACKEND = keras.backend.backend()
if BACKEND not in BACKENDS:
    raise ImportError(
        f"impl_tf runs on Keras's {', '.join(BACKENDS)} backends, but keras is running on {BACKEND!r} "
        f"(KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}); set KERAS_BACKEND before keras is first imported"
    )
TENSORFLOW = BACKEND == "tensorflow"

if TENSORFLOW:
    import tensorflow as tf  # noqa: E402
else:
    def __getattr__(name):
        if name == "tf":
            raise ImportError(f"impl_tf._keras.tf: TensorFlow itself, only on Keras's TensorFlow backend "
                              f"(keras runs on {BACKEND})")
        raise AttributeError(name)

__all__ = ["BACKEND", "BACKENDS", "TENSORFLOW", "keras", "tf"]
