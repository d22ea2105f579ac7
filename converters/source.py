"""A model to convert: where it is, and which format it is in, decided once.

The format is a fact about the file that whoever first looks at it establishes: the service's
upload checks from the bytes (its stored files carry no suffix), a person's command line from
the name they gave it (:meth:`ModelSource.from_path`). The loaders then read
``source.format``; nothing downstream guesses again from a file name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from .errors import ConversionError

# safetensors / pt: an edge_un checkpoint (a torch state dict needs a config); pt2: a
# torch.export program; onnx: an fp32 ONNX model; hf: a save_pretrained directory.
ModelFormat = Literal["safetensors", "pt", "pt2", "onnx", "hf"]
MODEL_FORMATS: tuple[ModelFormat, ...] = get_args(ModelFormat)
_BY_SUFFIX: dict[str, ModelFormat] = {
    ".safetensors": "safetensors",
    ".pt": "pt",
    ".pth": "pt",
    ".pt2": "pt2",
    ".onnx": "onnx",
}


@dataclass(frozen=True)
class ModelSource:
    path: Path
    format: ModelFormat
    # What reports call the model (default: the file's name without its suffix); the service
    # passes the name the user uploaded it under, not the one it stored it as.
    name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if self.format not in MODEL_FORMATS:
            raise ConversionError(f"unknown model format {self.format!r}; one of {MODEL_FORMATS}")

    @classmethod
    def from_path(cls, path: str | Path) -> ModelSource:
        """A model a person named: a directory is a Hugging Face model, a file's format is its
        suffix's (anything else is read as a safetensors checkpoint, whose loader then says
        what the file is not)."""
        path = Path(path)
        if path.is_dir():
            return cls(path, "hf")
        return cls(path, _BY_SUFFIX.get(path.suffix.lower(), "safetensors"))

    @property
    def display_name(self) -> str:
        return self.name or self.path.stem
