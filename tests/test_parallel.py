"""rlmetrics.integrations.parallel.submitter: exactly one rank per data-parallel group submits, with the
data-parallel size as world_size, against a brute-force enumeration of every rank's coordinates;
explicit sizes against a numpy layout of the rank order; real DeviceMeshes in 4 gloo processes."""

import itertools
import pickle
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from rlmetrics.integrations.parallel import Submitter, submitter

MESHES = [
    (("dp",), (4,)),
    (("dp", "tp"), (2, 4)),
    (("tp", "dp"), (2, 3)),
    (("dp", "pp", "tp"), (2, 3, 2)),
    (("pp", "dp", "cp", "tp"), (2, 2, 2, 2)),
    (("dp", "cp", "tp"), (3, 2, 2)),
    (("dp", "sp"), (4, 2)),
    (("pp", "dp", "sp", "tp"), (3, 2, 2, 2)),
]


class FakeMesh:
    """What submitter reads of a torch DeviceMesh: dim names, the array of global ranks, this
    process's coordinate (DeviceMesh lays ranks out row-major: the last dim fastest)."""

    def __init__(self, names, shape, me=None):
        self.mesh_dim_names = names
        self.mesh = np.arange(int(np.prod(shape))).reshape(shape)
        self._me = me

    def get_coordinate(self):
        if self._me is None:
            return None
        return [int(c) for c in np.argwhere(self.mesh == self._me)[0]]


def expected(names, shape, pp_stage="last"):
    """{rank: Submitter} by enumerating every coordinate (row-major, as np.arange(...).reshape)."""
    out = {}
    dp_axes = [i for i, n in enumerate(names) if n == "dp"]
    dp_size = int(np.prod([shape[i] for i in dp_axes]))
    for rank, coord in enumerate(itertools.product(*(range(s) for s in shape))):
        ok = True
        for name, size, c in zip(names, shape, coord):
            if name == "pp":
                ok = ok and c == {"last": size - 1, "first": 0}.get(pp_stage, pp_stage)
            elif name != "dp":
                ok = ok and c == 0
        dp_rank = int(np.ravel_multi_index([coord[i] for i in dp_axes], [shape[i] for i in dp_axes]))
        out[rank] = Submitter(ok, dp_size, dp_rank)
    return out


def check_groups(names, shape, answers):
    """Exactly dp ranks submit, one per dp group (the ranks of one dp coordinate), each with
    world_size == dp, and their dp_ranks are 0..dp-1 once each."""
    dp = int(np.prod([s for n, s in zip(names, shape) if n == "dp"]))
    submitting = [a for a in answers.values() if a.submits]
    assert len(submitting) == dp
    assert sorted(a.dp_rank for a in submitting) == list(range(dp))
    assert {a.world_size for a in answers.values()} == {dp}
    # a dp group: the ranks of one dp_rank; each holds exactly one submitter
    for g in range(dp):
        group = [a for a in answers.values() if a.dp_rank == g]
        assert len(group) == len(answers) // dp and sum(a.submits for a in group) == 1


@pytest.mark.parametrize(("names", "shape"), MESHES, ids=lambda x: "x".join(map(str, x)))
def test_mesh_against_enumeration(names, shape):
    want = expected(names, shape)
    got = {r: submitter(FakeMesh(names, shape, me=r)) for r in want}
    assert got == want
    assert {r: submitter(FakeMesh(names, shape), rank=r) for r in want} == want
    check_groups(names, shape, got)


@pytest.mark.parametrize("stage", ["first", 1, "last"])
def test_pp_stage(stage):
    names, shape = ("pp", "dp", "tp"), (3, 2, 2)
    got = {r: submitter(FakeMesh(names, shape), rank=r, pp_stage=stage) for r in range(12)}
    assert got == expected(names, shape, stage)
    check_groups(names, shape, got)
    pp_of = {r: r // 4 for r in range(12)}
    assert {pp_of[r] for r, a in got.items() if a.submits} == {{"first": 0, "last": 2}.get(stage, stage)}


def layout(order, sizes):
    """{rank: {dim: coordinate}} from numpy: the fastest-first order reversed is a row-major shape."""
    dims = order.split("-")
    ranks = np.arange(int(np.prod([sizes[d] for d in dims]))).reshape([sizes[d] for d in reversed(dims)])
    return {int(ranks[idx]): dict(zip(reversed(dims), idx)) for idx in np.ndindex(ranks.shape)}


SIZES = [
    dict(dp=4),
    dict(dp=2, tp=4),
    dict(dp=2, pp=3, tp=2),
    dict(dp=3, cp=2, tp=2),
    dict(dp=2, sp=2),
    dict(dp=2, tp=2, sp=2, cp=2, pp=2),
]


@pytest.mark.parametrize("order", ["tp-sp-cp-dp-pp", "dp-tp-sp-cp-pp", "pp-cp-sp-tp-dp"])
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_sizes_against_layout(sizes, order):
    full = dict(dict.fromkeys(("tp", "sp", "cp", "pp"), 1), **sizes)
    world = int(np.prod(list(full.values())))
    coords = layout(order, full)
    assert sorted(coords) == list(range(world))
    model = {k: v for k, v in full.items() if k != "dp"}
    got = {r: submitter(rank=r, world_size=world, order=order, **model) for r in range(world)}
    assert got == {r: submitter(rank=r, dp=full["dp"], order=order, **model) for r in range(world)}
    for r, a in got.items():
        c = coords[r]
        want = c["tp"] == c["sp"] == c["cp"] == 0 and c["pp"] == full["pp"] - 1
        assert a == Submitter(want, full["dp"], c["dp"]), (r, c)
    dims = [d for d in order.split("-") if full[d] > 1 or d == "dp"]
    check_groups(dims, [full[d] for d in dims], got)


def test_megatron_and_fsdp_layouts():
    """Megatron's default: tp fastest, then cp, dp, pp slowest; verl FSDP Ulysses: (dp, sp), sp fastest."""
    # 8 ranks, tp=2, pp=2: ranks 4 and 6 (tp 0, the last stage) submit, dp ranks 0 and 1
    assert [r for r in range(8) if submitter(rank=r, world_size=8, tp=2, pp=2).submits] == [4, 6]
    assert submitter(rank=6, world_size=8, tp=2, pp=2) == Submitter(True, 2, 1)
    fsdp = [submitter(rank=r, world_size=8, sp=4).submits for r in range(8)]
    assert fsdp == [True, False, False, False] * 2
    assert submitter(FakeMesh(("dp", "sp"), (2, 4)), rank=4) == submitter(rank=4, world_size=8, sp=4)


def test_roles_map_other_dim_names():
    mesh = FakeMesh(("dp_replicate", "dp_shard", "ulysses"), (2, 2, 2))
    roles = {"dp_replicate": "dp", "dp_shard": "dp", "ulysses": "sp"}
    got = {r: submitter(mesh, rank=r, roles=roles) for r in range(8)}
    assert got == expected(("dp", "dp", "sp"), (2, 2, 2))
    check_groups(("dp", "dp", "sp"), (2, 2, 2), got)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            dict(rank=0, world_size=6, tp=4),
            ValueError,
            r"world_size=6 is not a multiple of tp\*sp\*cp\*pp = 4$",
        ),
        (dict(rank=0, world_size=8, dp=3, tp=2), ValueError, r"= 6, not world_size=8"),
        (dict(rank=8, world_size=8, tp=2), ValueError, r"rank 8 is out of range for a world of 8 ranks"),
        (dict(rank=-1, world_size=8), ValueError, r"rank must be >= 0"),
        (dict(rank=0, world_size=8, tp=0), ValueError, r"tp must be >= 1"),
        (dict(rank=0, world_size=8, tp=2.0), TypeError, r"tp must be an int"),
        (dict(rank=0), TypeError, r"needs dp= or world_size="),
        (dict(world_size=8), TypeError, r"needs a mesh or the global rank="),
        (dict(rank=0, world_size=8, tp=2, order="dp-pp"), ValueError, r"leaves out tp, whose size is not 1"),
        (dict(rank=0, world_size=8, order="tp-ep-dp"), ValueError, r"order names 'ep'"),
        (dict(rank=0, world_size=8, order="tp-tp-dp"), ValueError, r"names a dim twice"),
        (dict(rank=0, world_size=8, pp=2, pp_stage=2), ValueError, r"pp_stage=2 is out of range for 2"),
        (dict(rank=0, world_size=8, pp=2, pp_stage="middle"), ValueError, r"pp_stage must be 'last'"),
        (dict(rank=0, world_size=8, roles={"a": "dp"}), TypeError, r"roles= names the dims of a mesh"),
    ],
)
def test_sizes_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        submitter(**kwargs)


@pytest.mark.parametrize(
    ("mesh", "kwargs", "error", "match"),
    [
        (FakeMesh(("dp", "ep"), (2, 2)), {}, ValueError, r"mesh dim 'ep' has no parallel role.*roles="),
        (FakeMesh(("dp", "tp"), (2, 2)), dict(rank=4), ValueError, r"rank 4 is not in the mesh \(.*0\.\.3"),
        (FakeMesh(("dp", "tp"), (2, 2)), {}, ValueError, r"this process is not in the mesh"),
        (FakeMesh(None, (2, 2)), {}, ValueError, r"the mesh has no dim names"),
        (FakeMesh(("dp", "tp"), (2, 2), me=0), dict(tp=2), TypeError, r"takes its sizes from the mesh"),
        (FakeMesh(("a", "b"), (2, 2), me=0), dict(roles={"a": "tp", "b": "tp"}), ValueError, r"role 'tp'"),
        (FakeMesh(("a", "b"), (2, 2), me=0), dict(roles={"a": "ep"}), ValueError, r"roles maps to \['ep'\]"),
    ],
)
def test_mesh_errors(mesh, kwargs, error, match):
    with pytest.raises(error, match=match):
        submitter(mesh, **kwargs)


# ------------------------------------------------------------- real DeviceMeshes, 4 gloo processes

REAL = [
    (("dp", "tp"), (2, 2)),
    (("tp", "dp"), (2, 2)),
    (("pp", "dp", "tp"), (2, 1, 2)),
    (("dp", "cp", "sp"), (1, 2, 2)),
    (("dp", "sp"), (4, 1)),
]


def _worker(rank: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=4, timeout=timedelta(seconds=60)
    )
    try:
        out = {}
        for names, shape in REAL:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            out[names] = (submitter(mesh), [submitter(mesh, rank=r) for r in range(4)])
    finally:
        dist.destroy_process_group()
    (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(out))


@pytest.mark.torch
@pytest.mark.slow
def test_real_device_mesh(tmp_path):
    pytest.importorskip("torch.distributed.device_mesh")
    import subprocess

    subprocess.run([sys.executable, __file__, str(tmp_path)], check=True, timeout=240)
    outs = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(4)]
    for names, shape in REAL:
        want = expected(names, shape)
        assert {r: outs[r][names][0] for r in range(4)} == want
        for r in range(4):
            assert outs[r][names][1] == [want[q] for q in range(4)]
        check_groups(names, shape, want)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(sys.argv[1],), nprocs=4, join=True)
