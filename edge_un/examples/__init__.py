"""Example checkpoints bundled with edge_un: trained on real data, with their split and accuracy.

===============  ==========================================================================
name             regenerate with
===============  ==========================================================================
vit-mnist-un     edge-un train --model vit --preset example --norm un --data mnist --seed 0
                 --threads 1 --out build/vit-mnist-un-trained.safetensors, then
                 edge-un finetune build/vit-mnist-un-trained.safetensors --int8-ready
                 --method decay --weight 1e-3 --seed 0 --threads 1
                 --out edge_un/examples/vit-mnist-un.safetensors
vit-mnist-ln     vit-mnist-un's train command with --norm ln
                 --out edge_un/examples/vit-mnist-ln.safetensors
text-rt-un       edge-un train --model text --preset example --norm un --data rt --seed 0
                 --threads 1 --out build/text-rt-un-trained.safetensors, then
                 edge-un finetune build/text-rt-un-trained.safetensors --int8-ready
                 --method range --target 32 --seed 0 --threads 1
                 --out edge_un/examples/text-rt-un.safetensors
text-rt-ln       text-rt-un's train command with --norm ln
                 --out edge_un/examples/text-rt-ln.safetensors
vit-mnist-ln-    edge-un migrate edge_un/examples/vit-mnist-ln.safetensors --kind un
to-un            --epochs 20 --lr 0.001 --seed 0 --threads 1
                 --out edge_un/examples/vit-mnist-ln-to-un.safetensors
text-rt-ln-      edge-un migrate edge_un/examples/text-rt-ln.safetensors --kind un
to-un            --epochs 1 --lr 0.0005 --seed 0 --labels-only --threads 1
                 --out edge_un/examples/text-rt-ln-to-un.safetensors
===============  ==========================================================================

Each checkpoint's metadata holds ``dataset``, ``split``, ``preprocessing`` (use
:func:`edge_un.data.preprocessor`), ``test_accuracy`` and the exact ``command`` that made it.
The commands take their recipe from :mod:`edge_un.training.presets`: the ViT "example" preset
trains UN with momentum 0.5 (recorded in the file's ``norm_kwargs``), the text one with the
layer's default 0.9. The two trained UN models are then made int8-ready
(:func:`edge_un.finetune.make_int8_ready`, so that their pure int8 files meet the drift bar on
every target): their metadata's ``finetune`` says so (purpose ``int8-ready``, method, weight,
target) and ``source`` holds the training run's recipe, command and accuracy. See also
``README.md`` in this directory.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

NAMES: tuple[str, ...] = (
    "vit-mnist-un", "vit-mnist-ln", "text-rt-un", "text-rt-ln", "vit-mnist-ln-to-un",
    "text-rt-ln-to-un",
)  # fmt: skip


class UnknownExampleError(ValueError):
    """Not the name of a bundled example model."""


def names() -> list[str]:
    """Names of the bundled example models."""
    return list(NAMES)


def path(name: str) -> Path:
    """The ``.safetensors`` file of the bundled example ``name``."""
    if name not in NAMES:
        raise UnknownExampleError(
            f"unknown example model {name!r}; bundled ones are {', '.join(NAMES)}"
        )
    file = Path(str(resources.files(__name__).joinpath(f"{name}.safetensors")))
    if not file.is_file():
        raise FileNotFoundError(f"example {name!r} is not installed ({file} is missing)")
    return file
