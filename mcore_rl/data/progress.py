"""Which prompts a run has used up, and which it hands out next.

Prompts are numbered by their position in the dataset's seeded order (epoch after epoch). A prompt is consumed
once its group was trained on or dropped (stale, or constant rewards under dynamic sampling). In sync mode groups
are consumed in order; asynchronous rollout finishes them out of order, so the state is a watermark (every
position below it is consumed) plus the consumed positions above it. Checkpoints save exactly this; a resumed run
hands out the unconsumed positions in order, so no prompt is trained twice and the data order is kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class DataProgress:
    position: int = 0  # every position below is consumed
    after: set[int] = field(default_factory=set)  # consumed positions above ``position``
    _issued: int = field(default=-1, repr=False)  # the last position handed out by ``issue`` in this process

    def consume(self, positions: Iterable[int]) -> None:
        self.after.update(p for p in positions if p >= self.position)
        while self.position in self.after:
            self.after.remove(self.position)
            self.position += 1

    def issue(self, count: int) -> list[int]:
        """The next ``count`` positions neither consumed nor handed out before (by this process)."""
        out, p = [], max(self._issued + 1, self.position)
        while len(out) < count:
            if p not in self.after:
                out.append(p)
            p += 1
        self._issued = out[-1] if out else self._issued
        return out

    def meta(self) -> dict:
        return {"data_position": self.position, "data_consumed_after": sorted(self.after)}

    @classmethod
    def from_meta(cls, meta: dict) -> DataProgress:
        return cls(meta["data_position"], set(meta.get("data_consumed_after", ())))
