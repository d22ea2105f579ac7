"""The edge targets: their profiles (``profiles``), the rules an artifact must satisfy
(``rules``), what every builder gets (``builder``) and the int16 fallback both builders climb
(``fallback_ladder``). The profiles' names are importable from here; the drift bars are
``quant.measure.bars``."""

from .profiles import (
    ETHOS_U_OPS,
    INT8_RECIPES,
    ORT_CPU_OPS,
    PROFILES,
    SIGNED_MIN_MACS,
    TARGET_NAMES,
    TIDL_OPS,
    VX_DELEGATE_OPS,
    ActivationType,
    ArtifactKind,
    Builder,
    Fallback,
    Int8Recipe,
    TargetProfile,
    WeightType,
    get_profile,
    parse_targets,
    resolve_targets,
)

__all__ = [
    "ETHOS_U_OPS",
    "INT8_RECIPES",
    "ORT_CPU_OPS",
    "PROFILES",
    "SIGNED_MIN_MACS",
    "TARGET_NAMES",
    "TIDL_OPS",
    "VX_DELEGATE_OPS",
    "ActivationType",
    "ArtifactKind",
    "Builder",
    "Fallback",
    "Int8Recipe",
    "TargetProfile",
    "WeightType",
    "get_profile",
    "parse_targets",
    "resolve_targets",
]
