"""Each framework's runner for `mha bench`, one module each (numpy, torch, tf,
jax), over what they share (runner: Runner, Path_, Unsupported, the window
and decode families' helpers). conformance.bench.runners names them (RUNNERS);
each imports its framework only when called.
"""
