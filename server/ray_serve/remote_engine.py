"""The instances of ``servelab-serve server.backend=ray deployment=disaggregated``: each
prefill and decode engine on whichever machine of the Ray cluster has the resources its
pool asks for, behind this machine's HTTP server.

An ``EngineActor`` starts the instance's engine process on its node, as the local server
starts one (``EngineProcess``), and relays the pipe: one concurrency group sends commands
(in order), another receives the engine's messages. ``RemoteEngineProcess`` is that actor
seen from the server: the handle ``AsyncEngine`` drives like a local engine process. The
KV caches move between the nodes through the ``kv_transfer`` connector
(``torch_distributed``); only the small tickets pass through the server.
"""

from __future__ import annotations

from typing import Any, Sequence

import ray
from omegaconf import DictConfig

from servelab.core.errors import ConfigError
from servelab.server.engine_process import EngineProcess, InstancePlan


@ray.remote(concurrency_groups={"send": 1, "receive": 1})
class EngineActor:
    """One engine process on this actor's node, and its pipe."""

    def __init__(self, plan: InstancePlan, server: DictConfig):
        self.process = EngineProcess.launch_all([plan], server)[0]

    def info(self) -> Any:
        """The engine's ``EngineInfo``."""
        return self.process.info

    @ray.method(concurrency_group="send")
    def send(self, message: Any) -> None:
        """Send a command down the pipe."""
        self.process.conn.send(message)

    @ray.method(concurrency_group="receive")
    def recv(self) -> Any:
        """The engine's next message (``EOFError`` once its process is gone)."""
        return self.process.conn.recv()

    @ray.method(concurrency_group="send")
    def join(self) -> int | None:
        """Wait for the engine process to exit after the stop command; its exit status."""
        self.process.join()
        return self.process.exitcode


class ActorPipe:
    """The server's end of an ``EngineActor``'s pipe: ``send`` returns once the command is
    queued, in order; ``recv`` blocks for the next message and raises ``EOFError`` once
    the engine process or the actor is gone."""

    def __init__(self, actor: Any):
        self.actor = actor

    def send(self, message: Any) -> None:
        """Queue a command (``OSError`` when the actor is gone)."""
        try:
            self.actor.send.remote(message)
        except ray.exceptions.RayActorError as exc:
            raise OSError(f"the engine actor is gone: {exc}") from exc

    def recv(self) -> Any:
        """The next message of the engine."""
        try:
            return ray.get(self.actor.recv.remote())
        except (EOFError, ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            raise EOFError(f"the engine actor's pipe closed: {exc}") from exc

    def close(self) -> None:
        """Nothing to close on this side."""


class RemoteEngineProcess(EngineProcess):
    """An ``EngineActor`` as ``AsyncEngine`` drives an ``EngineProcess``: ``conn``, ``info``,
    ``name``, ``join``, ``stop`` (inherited) and ``exitcode``."""

    def __init__(self, actor: Any, info: Any, name: str):
        self.actor = actor
        self.conn = ActorPipe(actor)
        self.info = info
        self.name = name
        self._exitcode: int | None = None

    @property
    def exitcode(self) -> int | None:
        """The engine process's exit status once joined (-1: the actor was lost)."""
        return self._exitcode

    def join(self) -> None:
        """Wait for the engine process to exit, then end the actor."""
        try:
            self._exitcode = ray.get(self.actor.join.remote())
        except ray.exceptions.RayError:
            self._exitcode = -1
        ray.kill(self.actor)


def launch_on_ray(plans: Sequence[InstancePlan], cfg: DictConfig) -> list[RemoteEngineProcess]:
    """One ``EngineActor`` per plan, each reserving its pool's ``ray_resources`` (and
    ``server.replica_gpus`` GPUs), all started at once; returns once every engine serves.
    A configuration an engine refuses raises ``ConfigError`` (the others are stopped)."""
    from servelab.server.ray_serve.app import config_problems

    actors = []
    for plan in plans:
        pool = cfg.deployment[plan.cfg.role]
        actors.append(EngineActor.options(
            name=f"servelab-{plan.name}", num_cpus=plan.threads, num_gpus=cfg.server.replica_gpus,
            resources=dict(pool.ray_resources)).remote(plan, cfg.server))
    started, failure = [], None
    for plan, actor in zip(plans, actors):
        try:
            started.append(RemoteEngineProcess(actor, ray.get(actor.info.remote()), plan.name))
        except ray.exceptions.RayError as exc:
            problems = config_problems(str(exc))
            failure = failure or (ConfigError(problems) if problems else
                                  RuntimeError(f"the engine actor {plan.name} failed to start: {exc}"))
            ray.kill(actor)
    if failure is not None:
        for process in started:
            process.stop()
        raise failure
    return started
