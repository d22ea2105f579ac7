"""The TFLite targets (imx93, imx8mp): the builder (``target``), its two routes to a float .tflite
(``direct``: the torch program through litert-torch; ``onnx2tf``: the ONNX file through onnx2tf
and TensorFlow; ``routes`` chooses), the flatbuffer edits and per-tensor precision mix made on it,
the LiteRT runner (``litert``), Vela, and the tool environments the converters run in
(``toolenv``, ``tool_sandbox``; the scripts that run inside them are ``tool_scripts/``). Imports
nothing from ``quant.ort``; importing this package loads none of its modules."""
