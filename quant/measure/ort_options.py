"""The options of an ONNX Runtime session that computes (a reference, a drift, SQNR or bias
correction pass), as opposed to one whose speed is the figure (``quant.measure.latency`` keeps ORT's
defaults there, as a user's application would).

Why not ORT's defaults: each intra-op thread spins while it waits for work, and a conversion
builds several targets at once (``edge-un convert --parallel``, Celery workers on one host), each
process with as many threads as there are cores. Spinning threads then take cores from the other
builds' threads. BERT-base's fp32 model, 40 samples, batch 1, on 2 cores (measured once, side
by side): alone 6.0 s spinning, 5.8 s not; two processes at once 13.2 s each spinning, 10.3 and
12.0 s not, 10.3 s each on one thread. Not spinning costs nothing alone. And a session takes
as many threads as the cores other work leaves it when it starts
(``quant.measure.host_load.CoresLeft``): a build alone keeps every core, one beside other builds
does not oversubscribe them.

ORT's own calibrator (``quantize_static``) makes its session itself, with the defaults; it runs
once per target (``quant.ort.quantize.Preprocessed``).
"""

from __future__ import annotations

import onnxruntime as ort

from .host_load import cores_left


def computing_options(threads: int = 0, *, optimize: bool = True) -> ort.SessionOptions:
    """Options for a session whose results, not its speed, are used: ``threads`` intra-op
    threads (0: the cores other work leaves this process now,
    ``quant.measure.host_load.cores_left``), threads that sleep rather than spin between ops, ORT's
    warnings only; ``optimize`` False runs the graph as written (no fusion: a QDQ model's exact
    arithmetic, ``quant.measure.exact``)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or cores_left()
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return options
