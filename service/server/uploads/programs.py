"""torch.export programs (.pt2), read through ``converters.program`` (its graph signature
from the archive's JSON: nothing is unpickled)."""

from __future__ import annotations

from pathlib import Path

from quant.errors import one_line

from ...settings import DEFAULT_MAX_PARAMETERS
from .model_upload import MIGRATE_ADVICE, ModelUpload, check_size, nonfinite, reject


def check_program(path: Path, max_parameters: int = DEFAULT_MAX_PARAMETERS) -> ModelUpload:
    import torch

    from converters.errors import NotAProgramError
    from converters.fold import find_online_norms
    from converters.program import load_program

    try:
        program = load_program(path)
    except NotAProgramError as error:
        raise reject(
            "Not a readable program",
            one_line(error).replace(path.name, "the 'model' upload", 1),
        ) from None
    parameters = sum(p.numel() for p in program.parameters())
    check_size(parameters, "the program stores", max_parameters)
    tensors = {**program.state_dict, **program.constants}
    for name, tensor in tensors.items():
        floating = isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
        if floating and not torch.isfinite(tensor).all():
            raise nonfinite(name)
    online = find_online_norms(program.graph_module)
    if online:
        raise reject(
            "Online norms (LayerNorm)",
            f"the program has online norms "
            f"({', '.join(online[:3])}), which cannot fold; {MIGRATE_ADVICE}",
        )
    # The user inputs of its graph signature (deserialized from the archive's JSON by
    # converters.program, nothing unpickled): the names its export gives its inputs.
    inputs = tuple(program.graph_signature.user_inputs)
    return ModelUpload("pt2", parameters, None, inputs or None)
