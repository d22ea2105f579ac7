"""Content checks of uploaded files, before a job is queued: each problem is one clear 4xx.

The format comes from the bytes (:mod:`.sniff`), never from the client's file name or content
type; each format is then read with the project's own safe loader (:mod:`.checkpoints`,
:mod:`.programs`, :mod:`.onnx_checks`, :mod:`.pretrained`). Nothing from a file is ever
unpickled unsafely, and a config's implied model size is checked before anything is built.
Called in a worker thread (CPU bound, reads files).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from quant.errors import one_line

from ...errors import Refusal
from ...settings import DEFAULT_MAX_PARAMETERS
from . import sniff
from .checkpoints import check_checkpoint, implied_parameters
from .files import DATA_FIELD, MIB
from .model_upload import ModelUpload, check_size, reject
from .onnx_checks import check_onnx, read_onnx
from .pretrained import check_pretrained_zip, is_pretrained_archive
from .programs import check_program

__all__ = [
    "DEFAULT_MAX_PARAMETERS",
    "ModelUpload",
    "implied_parameters",
    "inspect_config",
    "inspect_model",
    "inspect_npz",
]

MAX_CONFIG_BYTES = 1 * MIB
FORMATS = (
    "a .safetensors checkpoint, a torch state dict (.pt/.pth, zip format, with a config), a "
    "torch.export program (.pt2), an ONNX model, or a Hugging Face save_pretrained directory "
    "as one .zip"
)


# -- config ----------------------------------------------------------------------------------


def inspect_config(path: Path) -> dict:
    """The uploaded config: a JSON object (at most 1 MB) naming an architecture."""
    size = path.stat().st_size
    if size == 0:
        raise reject(
            "Empty upload",
            "the 'config' upload is empty; send the JSON config",
            Refusal.MALFORMED,
        )
    if size > MAX_CONFIG_BYTES:
        raise reject(
            "Config too large",
            f"the 'config' upload is {size:,} bytes; a config is "
            f"a small JSON object (at most {MAX_CONFIG_BYTES // MIB} MB)",
            Refusal.TOO_LARGE,
        )
    try:
        config = json.loads(
            path.read_bytes().decode("utf-8"), parse_constant=sniff.no_json_constant
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise reject(
            "Bad config",
            f"the 'config' upload is not valid JSON ({one_line(error)}); "
            "send the JSON object the checkpoint was saved with",
        ) from None
    if not isinstance(config, dict):
        raise reject(
            "Bad config",
            f"the 'config' upload must be a JSON object, got a "
            f'{type(config).__name__}: {{"architecture": ..., "arguments": {{...}}}}',
        )
    if not isinstance(config.get("architecture"), str):
        raise reject(
            "Bad config",
            "the 'config' object has no 'architecture' (a string such as \"VisionTransformer\")",
        )
    if not isinstance(config.get("arguments", {}), dict):
        raise reject("Bad config", "the config's 'arguments' must be a JSON object")
    return config


# -- model -----------------------------------------------------------------------------------


def inspect_model(
    path: Path,
    config: dict | None,
    *,
    external: Mapping[str, Path] | None = None,
    max_parameters: int = DEFAULT_MAX_PARAMETERS,
) -> ModelUpload:
    """What the uploaded model is, after checking it can be converted; UploadRejected if not.
    ``external``: the uploaded external data files of an ONNX model by the names it references,
    stored beside ``path``; ``max_parameters``: the service's limit (EDGE_UN_MAX_PARAMETERS)."""
    kind = sniff.sniff(path)
    if kind == "empty":
        raise reject(
            "Empty upload", "the 'model' upload is empty; send the model file", Refusal.MALFORMED
        )
    if kind == "safetensors":
        _no_external(external, "a .safetensors checkpoint")
        header = sniff.read_safetensors_header(path)
        check_size(header.elements, "the checkpoint stores", max_parameters)
        raw = config if config is not None else header.metadata.get("edge_un")
        return check_checkpoint(path, "safetensors", raw, config, max_parameters)
    if kind == "zip":
        names = sniff.check_zip(path, "'model' upload")
        if any(name.rsplit("/", 1)[-1] == "archive_format" for name in names):
            _no_config(config, "a torch.export program (.pt2)")
            _no_external(external, "a torch.export program (.pt2)")
            return check_program(path, max_parameters)
        if is_pretrained_archive(names):
            _no_config(config, "a Hugging Face model directory (its config.json is inside)")
            _no_external(external, "a Hugging Face model directory")
            return check_pretrained_zip(path, names, max_parameters)
        pickles = [name for name in names if name.rsplit("/", 1)[-1] == "data.pkl"]
        if len(pickles) != 1:
            raise reject(
                "Unknown model format",
                f"the 'model' upload is a zip archive but "
                f"neither a torch checkpoint nor a torch.export program; send {FORMATS}",
            )
        _refuse_code(sniff.pickle_globals(sniff.read_member(path, pickles[0])) or [])
        _no_external(external, "a torch state dict")
        if config is None:
            raise reject(
                "Missing config",
                "the model is a torch state dict, which does not "
                "say how to build the model: upload its JSON config as 'config' too, or "
                "save it with edge_un.save_checkpoint (.safetensors, config inside)",
            )
        return check_checkpoint(path, "pt", config, config, max_parameters)
    if kind == "pickle":
        _refuse_code(sniff.pickle_globals(path.read_bytes()[: 64 * MIB]) or [])
        raise reject(
            "Legacy pickle refused",
            "the 'model' upload is a raw pickle (torch's "
            "legacy format or pickle.dump), which is never loaded here: save the state "
            "dict with torch.save (zip format) or edge_un.save_checkpoint",
        )
    onnx_model = read_onnx(path) if kind == "other" else None
    if onnx_model is not None:
        _no_config(config, "an ONNX model")
        return check_onnx(onnx_model, path, external, max_parameters)
    if kind == "other" and path.stat().st_size <= MIB:
        _refuse_code(sniff.pickle_globals(path.read_bytes()) or [])  # protocol 0/1 pickles
    _no_external(external, "not an ONNX model")
    raise reject(
        "Unknown model format",
        f"the 'model' upload is not a model file edge-un reads (by its content); send {FORMATS}",
    )


def _refuse_code(globals_: list[str]) -> None:
    risky = sniff.code_globals(globals_)
    if risky:
        raise reject(
            "Code-execution payload refused",
            f"the 'model' upload is a pickle "
            f"carrying a code-execution payload: loading it would call "
            f"{', '.join(sorted(set(risky))[:5])}; refused without unpickling it. "
            "Upload weights as .safetensors",
        )


def _no_external(external: Mapping[str, Path] | None, what: str) -> None:
    if external:
        raise reject(
            "External data without an ONNX model",
            f"{DATA_FIELD!r} files are the external data (weights) of an ONNX model, and the "
            f"'model' upload is {what}: send the .onnx file as 'model' with them, or send "
            f"the model without {DATA_FIELD!r}",
        )


def _no_config(config: dict | None, what: str) -> None:
    if config is not None:
        raise reject(
            "Config not used",
            f"the model is {what}, which carries its own graph: send it without a 'config'",
        )


# -- calibration / evaluation data -----------------------------------------------------------


def inspect_npz(
    path: Path, field: Literal["calib", "eval"], inputs: Sequence[str] | None = None
) -> None:
    """A readable .npz of numbers: one array per model input, named as the model names it
    ('inputs' for a one-input model), batch first, and optional integer 'labels'. With the
    model's ``inputs`` (when its file says them without running anything) the arrays' names
    are checked against them here; shapes against the model are checked when the job runs."""
    from quant.errors import DataFileError
    from quant.samples import MIN_CALIBRATION_SAMPLES, MIN_EVALUATION_SAMPLES, load_npz

    kind = sniff.sniff(path)
    redo = "write one with numpy.savez(path, <input name>=..., labels=...)"
    if kind == "empty":
        raise reject("Empty upload", f"the {field!r} upload is empty; {redo}", Refusal.MALFORMED)
    if kind == "pickle":
        raise reject(
            "Pickled data refused",
            f"the {field!r} upload is a pickle, which is never "
            f"loaded; {redo} (plain numeric arrays)",
        )
    if kind == "npy":
        raise reject(
            "Bad data file",
            f"the {field!r} upload is a single .npy array, not an "
            f".npz archive of named arrays; {redo}",
        )
    if kind != "zip":
        raise reject("Bad data file", f"the {field!r} upload is not an .npz archive; {redo}")
    names = sniff.check_zip(path, f"{field!r} upload")
    if inputs:
        arguments = ", ".join(f"{name}=..." for name in inputs)
        redo = f"write one with numpy.savez(path, {arguments}, labels=...)"
    specs = _input_specs(path, names, field, redo, inputs)
    purpose = "calibration" if field == "calib" else "evaluation"
    minimum = MIN_CALIBRATION_SAMPLES if field == "calib" else MIN_EVALUATION_SAMPLES
    try:
        load_npz(path, specs, purpose=purpose, minimum=minimum)
    except DataFileError as error:
        line = one_line(error).removeprefix(f"{purpose} data {path.name}: ")
        raise reject("Bad data file", f"the {field!r} upload: {line}") from None
    except MemoryError:
        raise
    except Exception as error:  # numpy's readers raise many types on a damaged member
        raise reject(
            "Bad data file",
            f"the {field!r} upload is not a readable .npz "
            f"({type(error).__name__}: {one_line(error)}); {redo}",
        ) from None


def _input_specs(
    path: Path, names: list[str], field: str, redo: str, inputs: Sequence[str] | None
) -> list[Any]:
    """The InputSpecs the file's own array headers declare, one per array but 'labels' (so
    only the data is checked here), named as the model's ``inputs`` when they are known: each
    input needs its array ('inputs' will do for a one-input model), and no other is allowed."""
    from quant.samples import LABELS_NAME, SINGLE_INPUT_NAME

    arrays = [n.removesuffix(".npy") for n in names if n.endswith(".npy")]
    data = [name for name in arrays if name != LABELS_NAME]
    shown = ", ".join(arrays[:10]) or "none"
    if not inputs:
        if not data:
            raise reject(
                "Bad data file", f"the {field!r} upload has no input array (found: {shown}); {redo}"
            )
        return [_header_spec(path, name, field, redo) for name in data]
    expected = f"the model's input{'s are' if len(inputs) > 1 else ' is'} {', '.join(inputs)}"
    array_of = {name: name for name in inputs if name in data}
    if len(inputs) == 1 and not array_of and SINGLE_INPUT_NAME in data:
        array_of[inputs[0]] = SINGLE_INPUT_NAME
    missing = [name for name in inputs if name not in array_of]
    if missing:
        raise reject(
            "Data does not match the model",
            f"the {field!r} upload has no array {missing[0]!r} (found: {shown}); {expected}; "
            f"{redo}",
        )
    extra = [name for name in data if name not in array_of.values()]
    if extra:
        raise reject(
            "Data does not match the model",
            f"the {field!r} upload has an unexpected array {extra[0]!r} (found: {shown}); "
            f"{expected}; {redo}",
        )
    return [_header_spec(path, array_of[name], field, redo, name) for name in inputs]


def _header_spec(path: Path, name: str, field: str, redo: str, input_name: str = "") -> Any:
    import zipfile

    from quant.samples import InputSpec

    try:
        with zipfile.ZipFile(path) as archive, archive.open(f"{name}.npy") as stream:
            version = np.lib.format.read_magic(stream)
            read = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }.get(version)
            if read is None:
                raise ValueError(f"unsupported .npy version {version}")
            shape, _, dtype = read(stream)
    except Exception as error:
        raise reject(
            "Bad data file",
            f"the {field!r} upload's {name!r} is not a readable .npy "
            f"array ({one_line(error)}); {redo}",
        ) from None
    if dtype.hasobject:
        raise reject(
            "Pickled data refused",
            f"the {field!r} upload's {name!r} is a pickled "
            f"object array, which is never loaded; {redo} (plain numeric arrays)",
        )
    if len(shape) == 0:
        raise reject(
            "Bad data file",
            f"the {field!r} upload's {name!r} is a single number; "
            f"it needs a batch axis first; {redo}",
        )
    dtype_name = dtype.name if dtype.kind in "biuf" else "float32"
    return InputSpec(input_name or name, tuple(shape[1:]), dtype_name)
