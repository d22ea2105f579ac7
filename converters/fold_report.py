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

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fully_integer": self.fully_integer}

    def __str__(self) -> str:
        lines = [
            f"{self.source}: {len(self.norms)} offline norms, {len(self.folded)} folded, "
            f"{len(self.kept)} kept as scale-and-shift"
            + ("" if self.fully_integer else f"; NOT fully integer, online: {self.online_norms}")
        ]
        lines += [f"  {n}" for n in self.norms]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)
