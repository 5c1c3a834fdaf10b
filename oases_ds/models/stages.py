"""Which transformer layers each pipeline stage holds.

A stage holds a contiguous range of layers; the first stage also holds the
embedding and the last the head and the loss, so only one activation crosses a
stage boundary each way (the residual stream ``x``, ``[b, s, h]``).  The split is
a pure function of layer counts, so the planner can feed it per-layer costs
(:func:`stage_layer_counts` with ``costs``) and the runtime can take an explicit
split from the configuration (``pipeline_layers: [2, 2]``) without either
knowing about the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Stage:
    """Layers ``[start, end)`` of the model, on stage ``index`` of ``stages``.

    Attributes:
        index: this stage, 0-based (0 holds the embedding).
        stages: pipeline stages in all (the last holds the head and the loss).
        start / end: the global indices of its first layer and one past its last.
    """

    index: int
    stages: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.stages:
            raise ValueError(f"stage {self.index} outside 0..{self.stages - 1}")
        if not 0 <= self.start < self.end:
            raise ValueError(f"stage {self.index} holds layers [{self.start}, {self.end}); a stage needs at least one layer")

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.end)

    def holds_layer(self, layer: int) -> bool:
        return self.start <= layer < self.end


def stage_layer_counts(num_layers: int, stages: int, costs: Sequence[float] | None = None) -> list[int]:
    """Layers per stage, first stage first; every stage gets at least one layer.

    Without ``costs``: an even split, the first ``num_layers % stages`` stages one layer
    more (so 5 layers on 2 stages is ``[3, 2]``).  With ``costs`` (one per layer, e.g. the
    planner's forward + backward time of each layer, with the embedding folded into the
    first layer's cost and the head into the last's): the contiguous split whose most
    expensive stage is cheapest, found exactly over prefix sums (a stage's cost is a
    difference of two prefix sums; a dynamic programme over split points); among equally
    good splits the one nearest the even split wins, so equal costs give the even split.

    Raises ``ValueError`` naming the field when there are more stages than layers or the
    costs do not fit.
    """
    if stages < 1:
        raise ValueError(f"pipeline_stages must be >= 1, got {stages}")
    if num_layers < stages:
        raise ValueError(f"pipeline_stages={stages} exceeds model.num_layers={num_layers}; each stage needs at least "
                         f"one layer: use at most {num_layers} stages")
    if costs is None:
        base, extra = divmod(num_layers, stages)
        return [base + (i < extra) for i in range(stages)]
    costs = [float(c) for c in costs]
    if len(costs) != num_layers:
        raise ValueError(f"costs has {len(costs)} entries for model.num_layers={num_layers}; give one cost per layer")
    if any(c < 0 for c in costs):
        raise ValueError("costs must be non-negative (one per layer)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    even = stage_layer_counts(num_layers, stages)
    even_bounds = [sum(even[:k]) for k in range(stages + 1)]
    # best[k][j]: (max stage cost, distance from the even split) of layers [0, j) on k stages; cut[k][j]: last split
    inf = (float("inf"), float("inf"))
    best = [[inf] * (num_layers + 1) for _ in range(stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, stages + 1):
        for j in range(k, num_layers - (stages - k) + 1):
            for i in range(k - 1, j):
                prev = best[k - 1][i]
                if prev == inf:
                    continue
                cand = (max(prev[0], prefix[j] - prefix[i]), prev[1] + abs(j - even_bounds[k]))
                if cand < best[k][j]:
                    best[k][j], cut[k][j] = cand, i
    bounds = [num_layers]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return [b - a for a, b in zip(bounds, bounds[1:])]


def split_stages(num_layers: int, stages: int, layer_counts: Sequence[int] | None = None) -> list[Stage]:
    """The :class:`Stage` of every stage, from explicit ``layer_counts`` (validated:
    one positive count per stage, summing to ``num_layers``) or the even split."""
    if layer_counts is None:
        counts = stage_layer_counts(num_layers, stages)
    else:
        counts = list(layer_counts)
        if len(counts) != stages:
            raise ValueError(f"pipeline_layers has {len(counts)} entries for pipeline_stages={stages}; give one layer "
                             f"count per stage")
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
            raise ValueError(f"pipeline_layers={counts}: every stage needs a positive whole number of layers")
        if sum(counts) != num_layers:
            raise ValueError(f"pipeline_layers={counts} sums to {sum(counts)} but model.num_layers={num_layers}; make "
                             f"the counts add up to {num_layers}")
    out, start = [], 0
    for index, count in enumerate(counts):
        out.append(Stage(index, stages, start, start + count))
        start += count
    return out
