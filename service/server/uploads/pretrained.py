"""A Hugging Face ``save_pretrained`` directory uploaded as one .zip (the ``model`` field).

The archive is checked like every zip upload (:func:`.sniff.check_zip`: sizes, ratio,
member count, encryption), then more strictly: no member may name a path outside the archive
(absolute, ``..``, a backslash, a drive) or be a symbolic link, whatever it is. Of the one
folder that holds ``config.json`` (the archive's root, or a single folder in it, as ``zip -r
my-vit.zip my-vit`` makes) only ``config.json``, ``*.safetensors`` and the safetensors shard
index are extracted, under their plain names into their own directory; tokenizer files, READMEs and
anything else are never read. ``pytorch_model.bin`` is refused (a pickle), with how to re-save.
The model is then loaded the way the pipeline loads it (``edge_un.load_pretrained``: local
files, safetensors, never remote code) and refused if it has online norms or too many weights.
"""

from __future__ import annotations

import json
import stat
import zipfile
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from quant.errors import one_line

from ...upload_layout import HF_DIRECTORY
from . import sniff
from .model_upload import ModelUpload, check_size, reject

CONFIG_FILE = "config.json"
SHARD_INDEX = "model.safetensors.index.json"
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5")
MAX_CONFIG_BYTES = 4 * 1024 * 1024
RESAVE = (
    "re-save it as safetensors (model.save_pretrained(DIR, safe_serialization=True)) and zip "
    "the directory again"
)
HF_MIGRATE_ADVICE = (
    "the service converts only models whose norms fold into int8 weights: migrate it to UN "
    "first (edge-un migrate DIR --npz train.npz --out DIR-un), zip the result and upload that"
)


def is_pretrained_archive(names: list[str]) -> bool:
    """Whether a zip's members look like a save_pretrained directory (a config.json in it)."""
    return any(PurePosixPath(name).name == CONFIG_FILE for name in names)


def check_pretrained_zip(path: Path, names: list[str], max_parameters: int) -> ModelUpload:
    """Check the archive at ``path`` (members ``names``, already through ``check_zip``), extract
    what a model needs into its own directory beside it (``upload_layout.HF_DIRECTORY``), and check
    the model. UploadRejected if not."""
    folder = _model_folder(path, names)
    wanted = _wanted_members(names, folder)
    target = path.with_name(HF_DIRECTORY)
    target.mkdir()
    _extract(path, wanted, target)
    _check_config(target / CONFIG_FILE)
    parameters = sum(
        sniff.read_safetensors_header(file).elements for file in target.glob("*.safetensors")
    )
    check_size(parameters, "the model's safetensors store", max_parameters)
    return _check_model(target, parameters)


def _model_folder(path: Path, names: list[str]) -> str:
    """The folder (``""`` or ``"name/"``) that holds config.json; every member checked."""
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            problem = _member_problem(info)
            if problem:
                raise reject(
                    "Unsafe archive",
                    f"the 'model' archive's member {info.filename[:80]!r} {problem}; zip the "
                    "model's directory as it is (zip -r model.zip DIR)",
                )
    configs = [name for name in names if PurePosixPath(name).name == CONFIG_FILE]
    folders = sorted({name[: -len(CONFIG_FILE)] for name in configs})
    if len(folders) != 1 or folders[0].count("/") > 1:
        shown = ", ".join(configs[:3])
        raise reject(
            "Not one model",
            f"the 'model' archive has {CONFIG_FILE} at {shown}; zip one save_pretrained "
            "directory, its config.json at the top or in one folder",
        )
    return folders[0]


def _member_problem(info: zipfile.ZipInfo) -> str | None:
    name = info.filename
    if name.startswith("/") or "\\" in name or (len(name) > 1 and name[1] == ":"):
        return "is an absolute path"
    if ".." in PurePosixPath(name).parts:
        return "leads out of the archive (..)"
    if any(ord(char) < 32 for char in name):
        return "has a control character in its name"
    if stat.S_ISLNK(info.external_attr >> 16):
        return "is a symbolic link"
    return None


def _wanted_members(names: list[str], folder: str) -> dict[str, str]:
    """Archive member -> stored file name, for config.json, *.safetensors and the shard index
    directly in ``folder``."""
    inside = {name[len(folder) :]: name for name in names if name.startswith(folder)}
    plain = {rest: name for rest, name in inside.items() if rest and "/" not in rest}
    weights = [rest for rest in plain if rest.endswith(".safetensors")]
    if not weights:
        pickled = [rest for rest in plain if rest in PICKLED_WEIGHTS]
        found = f"it has {pickled[0]}, which edge-un never opens" if pickled else "it has none"
        raise reject(
            "No safetensors weights",
            f"the 'model' archive's directory needs its weights as .safetensors; {found}; {RESAVE}",
        )
    keep = [CONFIG_FILE, *weights] + ([SHARD_INDEX] if SHARD_INDEX in plain else [])
    return {plain[rest]: rest for rest in keep}


def _extract(path: Path, wanted: dict[str, str], target: Path) -> None:
    """Copy each wanted member out, never more bytes than its header declares (which
    ``check_zip`` bounded); a damaged member is a 422."""
    with zipfile.ZipFile(path) as archive:
        for member, name in wanted.items():
            declared = archive.getinfo(member).file_size
            try:
                with archive.open(member) as source, (target / name).open("wb") as sink:
                    copied = _copy_at_most(source, sink, declared)
            except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError) as error:
                raise reject(
                    "Damaged archive",
                    f"the 'model' archive's {name!r} cannot be read ({one_line(error)}); "
                    "upload the complete file",
                ) from None
            if copied != declared:
                raise reject(
                    "Damaged archive",
                    f"the 'model' archive's {name!r} does not hold the size its header says",
                )


def _copy_at_most(source: BinaryIO, sink: BinaryIO, limit: int) -> int:
    copied = 0
    while chunk := source.read(min(1 << 20, limit + 1 - copied)):
        copied += len(chunk)
        if copied > limit:
            return copied
        sink.write(chunk)
    return copied


def _check_config(path: Path) -> None:
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise reject("Bad config", f"the model's {CONFIG_FILE} is over 4 MB; it is not a config")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise reject(
            "Bad config", f"the model's {CONFIG_FILE} is not JSON ({one_line(error)})"
        ) from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise reject(
            "Bad config",
            f"the model's {CONFIG_FILE} has no model_type; save the model with save_pretrained",
        )
    if "auto_map" in config:
        raise reject(
            "Custom code refused",
            f"the model's {CONFIG_FILE} asks for custom code (auto_map), which edge-un never "
            "runs; only models of the transformers library convert",
        )
    if not isinstance(config.get("edge_un"), dict) or not config["edge_un"].get("norm"):
        raise reject(
            "Online norms (LayerNorm)", f"the model keeps its LayerNorms; {HF_MIGRATE_ADVICE}"
        )


def _check_model(directory: Path, parameters: int) -> ModelUpload:
    """Load the model as the pipeline will; its norms must all be offline."""
    import edge_un
    import edge_un.hf
    from converters.graph import ONLINE_NORM_CLASSES

    try:
        model, info = edge_un.load_pretrained(directory)
    except MemoryError:
        raise
    except Exception as error:  # the loader's one line: a missing shard, a mismatched shape
        line = one_line(error).removeprefix(f"{directory.name}: ")
        raise reject("Bad model", f"the model does not load: {line}") from None
    online = [n for n, m in model.named_modules() if isinstance(m, ONLINE_NORM_CLASSES)]
    if online:
        raise reject(
            "Online norms (LayerNorm)",
            f"the model has {len(online)} online norms ({', '.join(online[:3])}); "
            f"{HF_MIGRATE_ADVICE}",
        )
    try:  # what it takes: an image or text classifier's inputs (the converter traces those)
        edge_un.hf.example_inputs(model)
    except edge_un.CheckpointError as error:
        raise reject("Unsupported model", one_line(error)) from None
    # Its inputs are the forward arguments a data file chooses among (input_ids with or without
    # attention_mask): checked against the .npz when the job runs, not here.
    return ModelUpload("hf", parameters, info.norm_kind or None, None)
