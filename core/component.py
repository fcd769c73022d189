"""How a plugin describes one component it provides."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("scheduler", "cache", "attention", "decoding", "model", "eviction", "executor", "cost_model", "router")
"""Component kinds; each but ``model`` and ``eviction`` is a Hydra config group of the same name."""


@dataclass(frozen=True, slots=True)
class ComponentSpec:
    """One registered component.

    ``kind``: one of ``KINDS``. ``name``: the option users select (``scheduler=<name>``;
    for ``model`` the ``architectures`` entry of ``config.json``). ``cls``: the class the
    engine builds. ``config_cls``: its config dataclass (the Hydra schema; None for
    models). ``description``: one line for ``--help`` and the docs.
    """

    kind: str
    name: str
    cls: type
    config_cls: type | None
    description: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ComponentSpec.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
