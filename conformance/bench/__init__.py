"""`mha bench`: what attention costs in each framework, as ratios measured in one run.

Not conformance: nothing here judges agreement, only speed and memory.

For every backend and shape it times our implementation (forward, eager and
compiled, and forward+backward), the framework's fastest native paths, and
one large float32 matmul in that framework; every time is then a ratio:

  % of matmul rate   FLOPs / time / (the framework's 2048^3 matmul rate),
                     FLOPs = 4*B*T*D^2 + 4*B*S*D^2 (projections, 8*B*T*D^2 when
                     T = S) + 4*B*N*T*S*H (attention, the full T*S even when
                     causal: a causal path that skips hidden key blocks can
                     pass 100%); forward+backward counts 3x the forward FLOPs.
  x native           time / the fastest native path of the same framework,
                     pass and mode (eager against eager, compiled against
                     compiled; NumPy has only eager).

Method
- Each backend runs in its own worker process (conformance.bench.worker,
  started by conformance.bench.command): frameworks do not share thread pools
  or allocators, a crash or an out-of-memory kill is reported as that
  backend's failure, and peak memory is the worker's own.
- A measurement: one first call (timed: for compiled paths it includes the
  compile; `compile_s` = first call - median), one more warm-up call when the
  first took under 2 s, then up to --repeats timed calls (at least 3, fewer
  once --max-seconds of a path's timing has passed). Median, min, max,
  quartiles.
- Pairs: each timed call of a path comes right after one timed run of the
  large matmul (measure_paired), and % of matmul is the median of the pairs'
  ratios. The project's machines are shared VMs whose speed drifts by tens
  of percent within minutes (CPU steal); a path and its matmul see the same
  drift. The paths themselves are timed one after another, each in its own
  steady state (measure_paired says why not round robin), a minute or so
  apart, so x native divides the two paths' paired ratios
  (add_native_ratios), in which a drift between them cancels.
- Peak memory, one more call after the timed ones: NumPy with tracemalloc
  (NumPy reports its array buffers to it); TensorFlow with its allocator's
  counters (tf.config.experimental.get_memory_info, CPU too: its oneDNN CPU
  allocator pools large blocks, so RSS would not move); torch and JAX as
  growth of the process's peak resident set: malloc_trim(0), "5" written to
  /proc/self/clear_refs (resets VmHWM), then VmHWM after the call minus VmRSS
  before it. GPU: the framework's own peak-allocation counter.
- Long sequences (T >= LONG_T): each implementation's chunked path if it has
  one (chunk_size= in NumPy, Keras and JAX; torch through SDPA); causal shapes
  (gpt2) time the chunked paths too; weights are never requested. A path
  whose (B, N, T, S) float32 arrays would not fit in --mem-limit is skipped
  with that reason instead of run.
- Sweep (T = S = 128 ... 16384, B 1, D 512, N 8): forward only, one path of
  ours and one native per backend; a path stops after the first point whose
  median exceeds --budget seconds.
- Window and decode (only when named in --shapes): window times
  each chunked path under a fixed window (causal, window_left 4095, T = S
  8192 ... 65536) for flat time per query token and peak memory; decode
  times one GQA token after a cache of P = 8192 ... 65536 keys beside one
  read of that cache in the same framework (targets.window_targets,
  targets.decode_targets say how each is judged).

Modules: shapes (the shapes and chunk sizes), measure (paired timing, peak
memory), runners (RUNNERS: each framework's paths, matmul and memory
counter, one module each in frameworks/), worker
(one backend in its own process), targets (what each figure is judged
against: speed and memory on the named shapes, the window and decode
families' own), report (table and plots), sharded (the sequence-sharded
family: torch's ring against one unsharded process, memory and bytes, and its
two targets), latent (a latent layer's decode step, absorbed against expanded over a
per-head cache, its cache bytes and its targets; the paths in frameworks/latent.py), sparse (a DSA decode
step's parts, each against its own bound: read bandwidth and matmul rate of the same run), v4 (a DeepSeek V4
decode step of each layer kind against a dense MQA step over the same history: cache bytes per token, time, x
its bound), command (`mha bench`
itself); scripts holds the timing scripts
behind docs/performance.md's profiles
(`python -m conformance.bench.scripts.NAME`).
"""

from conformance.bench.command import add_parser, run

__all__ = ["add_parser", "run"]
