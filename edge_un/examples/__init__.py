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

Hugging Face ``transformers`` models, each a directory (``config.json`` + ``model.safetensors``)
for :func:`edge_un.load_pretrained`, listed by ``names(hf=True)``, trained from scratch by
``tools/make_hf_examples.py`` (in the repository, run from its root; not part of the
installed package) on the same data, split and preprocessing (needs edge-un[hf]):

===============  ==========================================================================
name             regenerate with
===============  ==========================================================================
hf-vit-mnist-ln  python -m tools.make_hf_examples --model vit --norm ln --seed 0
                 --threads 1 --out edge_un/examples/hf-vit-mnist-ln
hf-vit-mnist-un  the same with --norm un --out edge_un/examples/hf-vit-mnist-un
hf-bert-rt-ln    python -m tools.make_hf_examples --model bert --norm ln --seed 0
                 --threads 1 --out edge_un/examples/hf-bert-rt-ln
hf-bert-rt-un    the same with --norm un --out edge_un/examples/hf-bert-rt-un
===============  ==========================================================================

The ``command`` in their ``config.json`` names the builder's former place in the package,
``edge_un.examples.make_hf``: the same training, moved out of the library.

Their ``config.json`` holds the metadata under ``"edge_un"``; ``load_pretrained`` returns it as
``info.metadata``, so :func:`edge_un.data.checkpoint_split` works on them too.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..errors import InputError

NAMES: tuple[str, ...] = (
    "vit-mnist-un", "vit-mnist-ln", "text-rt-un", "text-rt-ln", "vit-mnist-ln-to-un",
    "text-rt-ln-to-un",
)  # fmt: skip
# Hugging Face transformers models, each a directory (config.json + model.safetensors) for
# edge_un.load_pretrained. Kept apart from NAMES: names() lists the checkpoints every edge-un
# command takes (the CLI's example choices, the service's uploads), and these are not such files.
HF_NAMES: tuple[str, ...] = ("hf-vit-mnist-ln", "hf-vit-mnist-un", "hf-bert-rt-ln", "hf-bert-rt-un")


class UnknownExampleError(InputError):
    """Not the name of a bundled example model."""


def names(*, hf: bool = False) -> list[str]:
    """Names of the bundled edge_un checkpoints; with ``hf=True`` those of the bundled Hugging
    Face model directories instead."""
    return list(HF_NAMES if hf else NAMES)


def path(name: str) -> Path:
    """The ``.safetensors`` file of the bundled example ``name``, or for a Hugging Face example
    (``hf-...``, see :func:`names`) its directory, to pass to :func:`edge_un.load_pretrained`."""
    if name not in NAMES and name not in HF_NAMES:
        raise UnknownExampleError(
            f"unknown example model {name!r}; bundled ones are {', '.join(NAMES)} "
            f"and, for edge_un.load_pretrained, {', '.join(HF_NAMES)}"
        )
    if name in HF_NAMES:
        directory = Path(str(resources.files(__name__).joinpath(name)))
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"example {name!r} is not installed ({directory} is missing)")
        return directory
    file = Path(str(resources.files(__name__).joinpath(f"{name}.safetensors")))
    if not file.is_file():
        raise FileNotFoundError(f"example {name!r} is not installed ({file} is missing)")
    return file
