"""What folding did to every norm: the FoldReport."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Action = Literal["folded_forward", "folded_backward", "scale_shift"]


@dataclass(frozen=True)
class NormFold:
    """One norm (one call site): its module path, kind, and what became of it.

    ``folded_forward``: into the Linears/Convs that consume it (``into``);
    ``folded_backward``: into the Linear/Conv that produces its input;
    ``scale_shift``: kept as one per-channel Mul + Add, ``reason`` says why it could not fold.
    """

    name: str
    kind: str
    action: Action
    into: tuple[str, ...] = ()
    reason: str = ""

    def __str__(self) -> str:
        target = f" into {', '.join(self.into)}" if self.into else ""
        why = f" ({self.reason})" if self.reason else ""
        return f"{self.name} [{self.kind}]: {self.action}{target}{why}"


@dataclass(frozen=True)
class FoldReport:
    """Every norm found, what happened to it, and whether the result is free of online norms."""

    norms: tuple[NormFold, ...]
    source: str
    online_norms: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def fully_integer(self) -> bool:
        """No online norm left: every remaining norm is folded or a per-channel Mul + Add."""
        return not self.online_norms

    @property
    def folded(self) -> tuple[NormFold, ...]:
        return tuple(n for n in self.norms if n.action != "scale_shift")

    @property
    def kept(self) -> tuple[NormFold, ...]:
        return tuple(n for n in self.norms if n.action == "scale_shift")

    @property
    def warnings(self) -> tuple[str, ...]:
        """What a person must not miss, naming what stays in the graph: no norm found or none
        folded (a frozen norm in a form not read here stays as exported, silently before),
        per-channel affines kept as Mul + Add, online norms kept."""
        found: list[str] = []
        if not self.norms:
            found.append(
                "no offline norm found, nothing folded: any norm of the model stays in the graph "
                "as it was exported (see the operators)"
            )
        elif not self.folded:
            found.append(f"none of the {len(self.norms)} offline norms folded")
        if self.kept:
            names = ", ".join(n.name for n in self.kept)
            found.append(f"per-channel affine left in the graph as Mul + Add: {names}")
        if self.online_norms:
            found.append(
                f"LayerNorm-type online norms left in the graph: {', '.join(self.online_norms)}"
            )
        return tuple(found)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fully_integer": self.fully_integer, "warnings": self.warnings}

    def __str__(self) -> str:
        lines = [
            f"{self.source}: {len(self.norms)} offline norms, {len(self.folded)} folded, "
            f"{len(self.kept)} kept as scale-and-shift"
            + ("" if self.fully_integer else f"; NOT fully integer, online: {self.online_norms}")
        ]
        lines += [f"  {n}" for n in self.norms]
        lines += [f"  note: {note}" for note in self.notes]
        lines += [f"  WARNING: {warning}" for warning in self.warnings]
        return "\n".join(lines)
