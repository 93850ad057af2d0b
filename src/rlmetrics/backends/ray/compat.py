"""Every Ray API outside Ray's public surface that the Ray backend uses, in one place; :func:`check`
says which of them the installed Ray lacks. What each is for: docs/backends.md, "Ray".
"""

from __future__ import annotations

import os
from typing import Any

from rlmetrics.extras import require

ray = require("ray", "ray")
from ray.experimental import internal_kv  # noqa: E402  (after the extra check)

UNAVAILABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
"""What a call raises when its actor died or is restarting."""

_ray_get = getattr(ray.get, "__wrapped__", ray.get)


def kv_get(key: bytes) -> bytes | None:
    return internal_kv._internal_kv_get(key)


def kv_put(key: bytes, value: bytes) -> None:
    internal_kv._internal_kv_put(key, value, overwrite=True)


def remote(method: Any, *args: Any) -> Any:
    """``method.remote(*args)``; ConnectionError instead of starting Ray."""
    if not ray.is_initialized():
        raise ConnectionError("Ray is shut down")
    submit = getattr(type(method)._remote, "__wrapped__", None)
    try:
        return method.remote(*args) if submit is None else submit(method, args, {})
    except ray.exceptions.RaySystemError as exc:  # shut down meanwhile
        raise ConnectionError(f"Ray is shut down: {exc}") from exc


def get(ref: Any, timeout: float | None = None) -> Any:
    """``ray.get(ref, timeout=timeout)``; ConnectionError instead of starting Ray."""
    try:
        return _ray_get(ref, timeout=timeout)
    except ray.exceptions.RaySystemError as exc:
        raise ConnectionError(f"Ray is shut down: {exc}") from exc


def actor_key(handle: Any) -> str:
    """A key of the actor behind ``handle``, the same in every process."""
    return handle._actor_id.hex()


def actor_dead(handle: Any) -> bool:
    """Whether Ray records the actor behind ``handle`` dead for good (False when the GCS cannot say)."""
    try:
        info = ray._private.state.actors(actor_id=actor_key(handle))
    except Exception:  # noqa: BLE001 - no answer is no proof of death: the caller keeps waiting
        return False
    return isinstance(info, dict) and info.get("State") == "DEAD"


def process() -> dict[str, str] | None:
    """Where this process runs, for :func:`gone`: its actor and node ids (hex); None outside an actor."""
    context = ray.get_runtime_context()
    actor = context.get_actor_id()
    return None if actor is None else {"actor": actor, "node": context.get_node_id()}


def gone(processes: dict[str, dict]) -> dict[str, str]:
    """Of ``processes`` (``{client: process()}``), those whose actor Ray records dead or whose node
    lost, as ``{client: why}`` (no answer from the GCS is no proof of death)."""
    out: dict[str, str] = {}
    try:
        dead_nodes = {n["NodeID"] for n in ray.nodes() if not n.get("Alive", True)}
    except Exception:  # noqa: BLE001 - no answer is no proof of death
        dead_nodes = set()
    table: Any = None
    if len(processes) > 16:  # one question for many ranks
        try:
            table = ray._private.state.actors()
        except Exception:  # noqa: BLE001
            table = {}
    for client, proc in processes.items():
        actor, node = proc.get("actor"), proc.get("node")
        if node in dead_nodes:
            out[client] = f"its node {str(node)[:8]} was lost (Ray records it dead)"
            continue
        try:
            info = table.get(actor) if table is not None else ray._private.state.actors(actor_id=actor)
        except Exception:  # noqa: BLE001
            continue
        if isinstance(info, dict) and info.get("State") == "DEAD":
            out[client] = f"its Ray actor {str(actor)[:8]} is dead"
    return out


def init() -> bool:
    """``ray.init()`` as Ray's own calls do (not with ``RAY_ENABLE_AUTO_CONNECT=0``); whether it
    started a local instance (False: it joined a running cluster)."""
    if os.environ.get("RAY_ENABLE_AUTO_CONNECT", "") == "0":  # as ray._private.auto_init_hook reads it
        return False
    ray.init()
    return bool(getattr(getattr(ray._private.worker, "_global_node", None), "head", False))


def job_dead(job_id: str) -> bool:
    """Whether Ray records the job ``job_id`` (hex) ended (False when the GCS cannot say)."""
    try:
        jobs = ray._private.state.state.job_table()
    except Exception:  # noqa: BLE001 - no answer is no proof of an end: the run's data is kept
        return False
    return any(job.get("JobID") == job_id and job.get("IsDead") for job in jobs)


def check() -> list[str]:
    """The private Ray APIs above that the installed Ray does not have (empty: all present)."""
    from ray.actor import ActorHandle, ActorMethod

    missing = [f"ray.experimental.internal_kv.{f}" for f in ("_internal_kv_get", "_internal_kv_put")
               if not callable(getattr(internal_kv, f, None))]  # fmt: skip
    if not hasattr(ray.get, "__wrapped__"):
        missing.append("ray.get.__wrapped__")
    if not hasattr(getattr(ActorMethod, "_remote", None), "__wrapped__"):
        missing.append("ray.actor.ActorMethod._remote.__wrapped__")
    if not isinstance(getattr(ActorHandle, "_actor_id", None), property):
        missing.append("ray.actor.ActorHandle._actor_id")
    if not hasattr(ray._private.worker, "_global_node"):
        missing.append("ray._private.worker._global_node")
    state = getattr(ray._private, "state", None)
    if not callable(getattr(state, "actors", None)):
        missing.append("ray._private.state.actors")
    if not callable(getattr(getattr(state, "state", None), "job_table", None)):
        missing.append("ray._private.state.state.job_table")
    return missing
