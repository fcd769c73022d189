"""What every conformance kit shares: parametrization over the registry and per-component
overrides.

A kit is a pytest test class. Subclass it in a test module and pytest runs its tests for
every registered component of its kind, or for the ``names`` you list::

    class TestMyScheduler(SchedulerConformance):
        names = ("my_scheduler",)
"""

from __future__ import annotations

from typing import Any, ClassVar

BUILTIN_OVERRIDES: dict[tuple[str, str], tuple[str, ...]] = {
    ("decoding", "speculative"): ("decoding.draft_path={draft}",),
}
"""Settings a built-in component needs to run on a kit's tiny checkpoint (``{checkpoint}``
and ``{draft}`` are replaced by the kit's target and draft checkpoint folders)."""


class ConformanceKit:
    """Base of the kits: the ``component`` argument of every test is each name of
    ``names`` (None: every component of ``kind`` in the registry, third-party ones
    included). ``overrides`` maps a component name to the Hydra overrides it needs
    (with ``{checkpoint}``/``{draft}`` placeholders)."""

    kind: ClassVar[str] = ""
    names: ClassVar[tuple[str, ...] | None] = None
    overrides: ClassVar[dict[str, tuple[str, ...]]] = {}

    def pytest_generate_tests(self, metafunc: Any) -> None:
        """Parametrize ``component`` over the kit's names."""
        if "component" in metafunc.fixturenames:
            metafunc.parametrize("component", self.component_names())

    @classmethod
    def component_names(cls) -> tuple[str, ...]:
        """The components this kit checks."""
        if cls.names is not None:
            return tuple(cls.names)
        from servelab.core.engine.registry import get_registry

        return tuple(sorted(get_registry().specs(cls.kind)))

    def component_overrides(self, name: str, checkpoint: str = "", draft: str = "") -> list[str]:
        """``<kind>=<name>`` and the settings that component needs, placeholders filled."""
        needed = self.overrides.get(name, BUILTIN_OVERRIDES.get((self.kind, name), ()))
        return [f"{self.kind}={name}", *(o.format(checkpoint=checkpoint, draft=draft) for o in needed)]
