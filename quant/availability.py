"""Which targets this installation can build: the ONNX targets need ONNX Runtime, the TFLite
ones a converter environment (litert-torch or onnx2tf; neither in the ``edge-un:onnx`` Docker
image) and LiteRT, imx93 also Vela. Looks only at what is installed (nothing is imported or run), so
``edge-un targets`` and an upload's checks stay light. The CLI and the service both choose
their default targets here and refuse a named target that cannot be built, before any work.
"""

from __future__ import annotations

import importlib.util

from .errors import QuantError
from .targets.profiles import PROFILES, TargetProfile, parse_targets
from .tflite import toolenv


class TargetUnavailableError(QuantError):
    """A target named by the user that this installation cannot build."""


def unavailable(profile: TargetProfile) -> str | None:
    """Why this installation cannot build ``profile``'s artifacts, or None if it can."""
    if "onnx_qdq" in profile.artifacts and importlib.util.find_spec("onnxruntime") is None:
        return "needs ONNX Runtime: pip install 'edge-un[export]'"
    if "tflite" in profile.artifacts:
        # either converter builds the target: litert-torch a torch source, onnx2tf any source
        # (quant.tflite.routes); a source the installed one cannot take fails at its build
        reasons = []
        for env in (toolenv.LITERT_TORCH, toolenv.ONNX2TF):
            try:
                env.require()
                break
            except toolenv.ToolEnvMissingError as error:  # names the command that creates it
                reasons.append(str(error))
            except OSError as error:  # e.g. another user's environment
                reasons.append(f"the {env.what} environment at {env.dir()}: {error}")
        else:
            return "; ".join(reasons) + "; the edge-un:onnx Docker image has none"
        if importlib.util.find_spec("ai_edge_litert") is None:
            return "needs LiteRT: pip install 'edge-un[quant]'"
    if "vela" in profile.artifacts and importlib.util.find_spec("ethosu") is None:
        return "needs Vela: pip install 'edge-un[quant]'"
    return None


def missing_targets() -> dict[str, str]:
    """{target name: why not} for every target this installation cannot build."""
    return {p.name: why for p in PROFILES.values() if (why := unavailable(p))}


def targets_to_build(spec: str | None) -> tuple[tuple[TargetProfile, ...], dict[str, str]]:
    """The profiles to build for ``spec`` and {name: why} of the targets left out.

    ``None``/``""``/``"all"``: every target this installation can build (the others left out);
    TargetUnavailableError if none. Named targets: all of them, or TargetUnavailableError for
    the first that cannot be built (UnknownTargetError for an unknown name)."""
    if not spec or spec.strip() == "all":
        missing = missing_targets()
        chosen = tuple(p for p in PROFILES.values() if p.name not in missing)
        if not chosen:
            raise TargetUnavailableError(f"this installation can build no target: {missing}")
        return chosen, missing
    chosen = parse_targets(spec)
    for profile in chosen:
        if why := unavailable(profile):
            raise TargetUnavailableError(f"this installation cannot build {profile.name}: {why}")
    return chosen, {}
