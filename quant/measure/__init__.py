"""Measurements every builder shares: the drift of an int8 file against the fp32 model and where
it arises (``drift``), ONNX models run as written (``exact``, ``graph_walk``, ``ort_options``),
latency and the host's load while timing. Imports no builder (``quant.ort``, ``quant.tflite``)."""
