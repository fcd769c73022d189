"""How a mixture of experts' tokens spread over its experts: the (token, expert) pairs each
routed expert of each sparse layer received, and what that means for the ranks that hold
them under expert parallelism."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ExpertLoad:
    """``pairs[layer]``: the (token, expert) pairs routed to each expert of decoder layer
    ``layer`` (a tuple of one count per routed expert, checkpoint order); ``ranks``: the
    expert-parallel ranks that hold them, consecutive equal ranges (1: every rank holds
    every expert)."""

    pairs: dict[int, tuple[int, ...]]
    ranks: int = 1

    def __sub__(self, earlier: ExpertLoad) -> ExpertLoad:
        """The pairs routed since ``earlier`` (a load of the same layers, read before)."""
        return ExpertLoad({layer: tuple(now - then for now, then in zip(counts, earlier.pairs.get(layer, counts)))
                           for layer, counts in self.pairs.items()}, self.ranks)

    def per_expert(self) -> list[int]:
        """Pairs per expert, summed over the layers."""
        return [sum(column) for column in zip(*self.pairs.values())] if self.pairs else []

    def per_rank(self) -> list[int]:
        """Pairs per expert-parallel rank, summed over the layers."""
        experts = self.per_expert()
        size = len(experts) // self.ranks if experts else 0
        return [sum(experts[r * size:(r + 1) * size]) for r in range(self.ranks)] if experts else []

    def imbalance(self) -> float | None:
        """How much longer the busiest holder works than an even split would take, layer by
        layer: the mean over layers of max / mean pairs, per rank under expert parallelism,
        else per expert (1.0: perfectly even); None before any pair."""
        ratios = []
        for counts in self.pairs.values():
            size = len(counts) // self.ranks
            loads = [sum(counts[r * size:(r + 1) * size]) for r in range(self.ranks)] if self.ranks > 1 else counts
            if sum(loads):
                ratios.append(max(loads) * len(loads) / sum(loads))
        return sum(ratios) / len(ratios) if ratios else None

    def summary(self) -> dict:
        """``metrics.json``'s ``system.experts``: pairs per expert and per rank (summed over
        layers), the imbalance, and the layers counted."""
        return {"pairs_per_expert": self.per_expert(), "pairs_per_rank": self.per_rank(),
                "imbalance": self.imbalance(), "layers": sorted(self.pairs)}
