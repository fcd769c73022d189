"""The plugin module named by the ``servelab`` entry point."""

from __future__ import annotations

from servelab.core.hookspecs import hookimpl

SERVELAB_PLUGIN_API = ">=1.0,<2"
"""The servelab plugin API versions this plugin runs on."""


@hookimpl
def servelab_register_schedulers():
    """Register ``scheduler=shortest_prompt_first``."""
    from servelab.core.component import ComponentSpec
    from servelab_spf.scheduler import ShortestPromptFirstConfig, ShortestPromptFirstScheduler

    return [ComponentSpec("scheduler", "shortest_prompt_first", ShortestPromptFirstScheduler,
                          ShortestPromptFirstConfig, "admit the waiting request with the shortest prompt first")]
