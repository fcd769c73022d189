"""The version of servelab's plugin API and the check every plugin passes at load.

A plugin module declares the API versions it works with as a PEP 440 specifier:

    SERVELAB_PLUGIN_API = ">=1.0,<2"

``PLUGIN_API_VERSION`` is MAJOR.MINOR. A minor release only adds (new optional hooks,
contract members with defaults, new fields with defaults at the end of a dataclass), so
a plugin written against 1.0 runs on every 1.x; a major release may change or remove
what plugins use, and a plugin must declare it before servelab loads it.
docs/plugins.md lists what the promise covers.
"""

from __future__ import annotations

from types import ModuleType

PLUGIN_API_VERSION = "1.15"
"""The plugin API this servelab implements."""

DECLARATION = "SERVELAB_PLUGIN_API"
"""The module attribute in which a plugin declares the API versions it supports."""


def api_problem(name: str, plugin: object) -> str | None:
    """Why plugin ``name`` cannot be loaded by this servelab (None when it can): it
    declares no supported range, an unreadable one, or one without ``PLUGIN_API_VERSION``."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    declared = getattr(plugin, DECLARATION, None)
    where = plugin.__name__ if isinstance(plugin, ModuleType) else type(plugin).__name__
    if declared is None:
        next_major = int(PLUGIN_API_VERSION.split(".")[0]) + 1
        return (f"plugin {name!r} ({where}) declares no {DECLARATION}; servelab's plugin API is "
                f"{PLUGIN_API_VERSION}: add {DECLARATION} = \">={PLUGIN_API_VERSION},<{next_major}\" "
                f"once it runs on it")
    try:
        supported = SpecifierSet(declared)
    except (InvalidSpecifier, TypeError):
        return f"plugin {name!r} ({where}) declares {DECLARATION} = {declared!r}, which is not a version specifier"
    if PLUGIN_API_VERSION not in supported:
        return (f"plugin {name!r} ({where}) supports servelab plugin API {declared}, but this servelab's is "
                f"{PLUGIN_API_VERSION}: upgrade the plugin or install a servelab it supports")
    return None
