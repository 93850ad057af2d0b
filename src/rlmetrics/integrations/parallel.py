"""Which rank of a data-parallel group submits the data metrics, and with which ``world_size``:
:func:`submitter`, from a torch ``DeviceMesh`` or from sizes and the global rank, for any framework
(it needs neither verl nor torch). The rule: docs/verl.md, "Where the calls go in verl 0.9.1".

>>> submitter(rank=6, world_size=8, tp=2, pp=2)  # rank = tp + 2 * (dp + 2 * pp): tp 0, dp 1, pp 1
Submitter(submits=True, world_size=2, dp_rank=1)
>>> submitter(rank=1, world_size=8, tp=2, pp=2).submits  # tp coordinate 1
False
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

__all__ = ["MEGATRON_ORDER", "ROLES", "Submitter", "submitter"]

ROLES = ("dp", "tp", "sp", "cp", "pp")
"""The parallel roles a dim can have: data, tensor, sequence (Ulysses), context, pipeline."""

MEGATRON_ORDER = "tp-sp-cp-dp-pp"
"""The default rank layout, fastest dim first: Megatron-core's (without ``ep``), ``sp`` next to ``tp``."""


class Submitter(NamedTuple):
    """Whether a rank submits, the ``world_size`` to submit with (the dp size) and its dp rank."""

    submits: bool
    world_size: int
    dp_rank: int


def submitter(
    mesh: Any = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    dp: int | None = None,
    tp: int = 1,
    sp: int = 1,
    cp: int = 1,
    pp: int = 1,
    order: str | Sequence[str] = MEGATRON_ORDER,
    roles: Mapping[str, str] | None = None,
    pp_stage: int | str = "last",
) -> Submitter:
    """Whether ``rank`` submits the data metrics of its data-parallel group, and with which world size.

    ``mesh``: a torch ``DeviceMesh`` (or anything with ``mesh_dim_names`` and a ``mesh`` of ranks),
    dims named ``dp``, ``tp``, ``sp``, ``cp``, ``pp`` or mapped by ``roles`` (``{"ulysses": "sp"}``);
    ``rank`` defaults to this process. Else the global ``rank``, ``dp`` and/or ``world_size``, the
    other sizes and ``order``, fastest dim first. ``pp_stage``: ``"last"``, ``"first"`` or a number.
    TypeError for a mix of both forms, ValueError for sizes, ranks or names that do not fit.

    >>> submitter(rank=3, world_size=4, sp=2, order="sp-dp")  # verl FSDP + Ulysses: (dp, sp)
    Submitter(submits=False, world_size=2, dp_rank=1)
    >>> submitter(rank=4, world_size=6, tp=2)
    Submitter(submits=True, world_size=3, dp_rank=2)
    >>> submitter(rank=0, world_size=6, tp=4)
    Traceback (most recent call last):
    ...
    ValueError: world_size=6 is not a multiple of tp*sp*cp*pp = 4
    """
    if mesh is not None:
        if dp is not None or world_size is not None or (tp, sp, cp, pp) != (1, 1, 1, 1):
            raise TypeError("submitter(mesh) takes its sizes from the mesh: no dp/world_size/tp/sp/cp/pp")
        names, shape, coord = _from_mesh(mesh, rank, roles or {})
    else:
        if roles is not None:
            raise TypeError("roles= names the dims of a mesh; explicit sizes are named by their role")
        sizes = {"tp": tp, "sp": sp, "cp": cp, "pp": pp}
        names, shape, coord = _from_sizes(rank, world_size, dp, sizes, order)
    return _answer(names, shape, coord, pp_stage)


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value.__index__())
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _role(name: str, roles: Mapping[str, str]) -> str:
    role = roles.get(name, name)
    if role not in ROLES:
        raise ValueError(
            f"mesh dim {name!r} has no parallel role: name dims {', '.join(ROLES)} or map the name with "
            f"roles={{{name!r}: 'dp'}} (or 'tp', 'sp', 'cp', 'pp')"
        )
    return role


def _from_mesh(mesh: Any, rank: int | None, roles: Mapping[str, str]):
    dims = getattr(mesh, "mesh_dim_names", None)
    if not dims:
        raise ValueError("the mesh has no dim names: build it with mesh_dim_names=('dp', 'tp', ...)")
    unknown = set(roles.values()) - set(ROLES)
    if unknown:
        raise ValueError(f"roles maps to {sorted(unknown)}; a role is one of {', '.join(ROLES)}")
    names = [_role(name, roles) for name in dims]
    for role in ROLES[1:]:
        if names.count(role) > 1:
            raise ValueError(f"two mesh dims have the role {role!r}: {list(dims)} with roles={dict(roles)}")
    ranks = mesh.mesh.tolist()
    shape = []
    level = ranks
    for _ in dims:
        shape.append(len(level))
        level = level[0]
    if rank is None:
        coord = mesh.get_coordinate()
        if coord is None:
            raise ValueError("this process is not in the mesh: pass rank= or use a mesh that holds it")
        return names, shape, list(coord)
    rank = _int("rank", rank, 0)
    flat = _flatten(ranks, len(dims))
    if rank not in flat:
        raise ValueError(f"rank {rank} is not in the mesh (it holds ranks {min(flat)}..{max(flat)})")
    return names, shape, _unravel(flat.index(rank), shape)


def _flatten(nested: Any, depth: int) -> list[int]:
    if depth == 0:
        return [int(nested)]
    return [r for item in nested for r in _flatten(item, depth - 1)]


def _unravel(index: int, shape: Sequence[int]) -> list[int]:
    """Row-major coordinates of ``index`` (the last dim fastest, as a DeviceMesh's ranks)."""
    coord = []
    for size in reversed(shape):
        coord.append(index % size)
        index //= size
    return coord[::-1]


def _from_sizes(rank, world_size, dp, sizes: dict[str, int], order):
    if rank is None:
        raise TypeError("submitter() needs a mesh or the global rank= (with dp= or world_size=)")
    rank = _int("rank", rank, 0)
    sizes = {role: _int(role, size, 1) for role, size in sizes.items()}
    model = math.prod(sizes.values())
    if dp is None and world_size is None:
        raise TypeError("submitter(rank=...) needs dp= or world_size=")
    if world_size is not None:
        world_size = _int("world_size", world_size, 1)
        if world_size % model:
            raise ValueError(f"world_size={world_size} is not a multiple of tp*sp*cp*pp = {model}")
    if dp is not None:
        dp = _int("dp", dp, 1)
        if world_size is not None and dp * model != world_size:
            raise ValueError(
                f"dp*tp*sp*cp*pp = {dp}*{sizes['tp']}*{sizes['sp']}*{sizes['cp']}*{sizes['pp']} = "
                f"{dp * model}, not world_size={world_size}"
            )
    else:
        dp = world_size // model
    sizes["dp"] = dp
    total = dp * model
    if rank >= total:
        raise ValueError(f"rank {rank} is out of range for a world of {total} ranks")
    dims = order.split("-") if isinstance(order, str) else list(order)
    for name in dims:
        if name not in ROLES:
            raise ValueError(f"order names {name!r}; the dims are {', '.join(ROLES)} (fastest first)")
    if len(set(dims)) != len(dims):
        raise ValueError(f"order {order!r} names a dim twice")
    missing = [name for name in ROLES if name not in dims and sizes[name] > 1]
    if missing:
        raise ValueError(f"order {order!r} leaves out {', '.join(missing)}, whose size is not 1")
    coord = {}
    rest = rank
    for name in dims:  # fastest first
        coord[name] = rest % sizes[name]
        rest //= sizes[name]
    names = [name for name in dims if sizes[name] > 1 or name == "dp"]
    return names, [sizes[n] for n in names], [coord[n] for n in names]


def _answer(names: list[str], shape: list[int], coord: list[int], pp_stage: int | str) -> Submitter:
    pp_size = math.prod(size for name, size in zip(names, shape) if name == "pp")
    stage = _stage(pp_stage, pp_size)
    submits = True
    dp_rank, dp_size = 0, 1
    for name, size, c in zip(names, shape, coord):
        if name == "dp":
            dp_rank, dp_size = dp_rank * size + c, dp_size * size
        elif name == "pp":
            submits &= c == stage
        else:
            submits &= c == 0
    return Submitter(bool(submits), dp_size, dp_rank)


def _stage(pp_stage: int | str, size: int) -> int:
    if pp_stage == "last":
        return size - 1
    if pp_stage == "first":
        return 0
    if isinstance(pp_stage, str):
        raise ValueError(f"pp_stage must be 'last', 'first' or a stage number, got {pp_stage!r}")
    stage = _int("pp_stage", pp_stage, 0)
    if stage >= size:
        raise ValueError(f"pp_stage={stage} is out of range for {size} pipeline stages")
    return stage
