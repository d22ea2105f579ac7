"""Scripts that run inside a converter's own environment (``quant.tflite.toolenv``), by path:
they import only the standard library, numpy and that environment's packages, never ``quant``."""
