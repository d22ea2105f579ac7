"""The ``metadata_props`` keys under which torch's ONNX exporters record each node's module.

The dynamo exporter stores the module stack as two Python list literals (module paths, module
classes); older torch versions stored one "/"-joined string of "path: class" pairs.

Imports nothing, and importing it loads no torch (``converters/__init__`` loads its other
modules on first use): ``quant.sources`` reads these keys in every target's builder process.
"""

NAME_SCOPES = "pkg.torch.onnx.name_scopes"
CLASS_HIERARCHY = "pkg.torch.onnx.class_hierarchy"
NAMESPACE = "namespace"  # "': Model/blocks.0: Block/blocks.0.attn: Attention/softmax: aten...'"
# onnxscript's optimizer (the dynamo exporter runs it) records on a folded constant the values
# it was computed from, as a list literal: a lookup at constant indices names its table there.
FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"
