"""Chaos: rank actors and the aggregator are killed at seeded random moments of a run on Ray.

W rank actors (one process each, ``rank{r}`` clients of ``rlmetrics.connect("ray", ...)``) compute
for 20 ms (a sleep), then submit arrays drawn from ``default_rng((seed, rank, step))`` (``x/mean``,
``x/min``, ``x/max``, ``x/std``, ``x/total``) and ``ranks/total: 1``. The driver owns the
aggregator, runs the steps one after the other (every rank alive at the step's start gets
``step(s, world_size)``, ``world_size`` being the number of ranks alive then: the survivors' new
world size after a death), reads ``result(s, timeout=RESULT_TIMEOUT_S)`` and logs it to a
``JsonlSink``.

The schedule comes from ``random.Random(seed)``: which steps, which ranks, and when in the step —
``before`` it starts, ``during`` it (after a random delay of at most 50 ms from its start),
``after`` the ranks returned but before the result is read, and for the aggregator also ``read``
(in that step the driver calls ``result`` at once, while the ranks still submit, and a timer thread
kills the aggregator under it, at most 50 ms after the step's start). Ranks die by
``ray.kill(rank)``, the aggregator by ``ray.kill(root, no_restart=False)``. At least two ranks
survive.

Checks, on the JSONL read back: every step is there exactly once; a complete step (the sink writes
no ``meta`` for it) had every rank alive at its start; in a partial step the contributors
(``meta.contributors``) are the ranks alive at its start, less any subset of those killed during
it, and include every rank that survived it; the missing ranks are among the killed ones; a step is
complete exactly when nothing is missing; each incomplete metric received one contribution per
contributor; and the values equal numpy over the contributors' data (nothing lost, nothing counted
twice). ``run_chaos`` returns the failures; the script exits 1 when there is one.

Run: ``python benchmarks/chaos.py [--seed 0] [--steps 200] [--ranks 6] [--out DIR]``.
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import ray
import report

import rlmetrics
from rlmetrics.messages import StepMeta

RESULT_TIMEOUT_S = 15.0  # what a dead rank costs: its last step waits this long, then is partial
RECOVERY_TIMEOUT_S = 10.0  # a restarted aggregator waits at most this long for the ranks' resends
COMPUTE_S = 0.02  # a rank's "training" before it submits: a kill during a step may land before or after
STEP_TIMEOUT_S = 180.0  # bound on one rank's step (it waits for a restarting aggregator)
RANK_PHASES = ("before", "during", "after")
AGGREGATOR_PHASES = ("before", "during", "after", "read")


def rank_data(seed: int, rank: int, step: int) -> np.ndarray:
    """What rank ``rank`` submits at ``step``: sized by rank and step, so weights matter."""
    rng = np.random.default_rng((seed, rank, step))
    return rng.uniform(-1.0, 1.0, size=2 + rank + step % 3) + step


@ray.remote(num_cpus=0, max_restarts=0)
class Rank:
    """One rank: one process, one client."""

    def __init__(self, name: str, rank: int, world_size: int, seed: int) -> None:
        self.rank, self.seed = rank, seed
        self.client = rlmetrics.connect("ray", name=name, world_size=world_size, label=f"rank{rank}")

    def step(self, step: int, world_size: int) -> None:
        """Compute for ``COMPUTE_S``, submit this rank's data of ``step``, wait until it arrived."""
        assert self.client.step == step, (self.client.step, step)
        time.sleep(COMPUTE_S)
        self.client.set_world_size(world_size)
        d = rank_data(self.seed, self.rank, step)
        self.client.submit_metric({"x/mean": d, "x/min": d, "x/max": d, "x/std": d, "x/total": d})
        self.client.submit_metric({"ranks/total": 1.0})
        self.client.wait_submit()
        self.client.flush()


@dataclass(frozen=True)
class Kill:
    step: int
    target: str  # "aggregator" or "rank{r}"
    phase: str
    delay: float  # seconds after the step's start ("during", "read"); unused otherwise


def schedule(seed: int, steps: int, ranks: int, rank_kills: int, aggregator_kills: int) -> list[Kill]:
    """The seeded kill schedule; ``min(rank_kills, ranks - 2)`` ranks die, never in the first or
    last two steps."""
    rng = random.Random(seed)
    window = range(2, steps - 2)
    kills = []
    victims = rng.sample(range(ranks), min(rank_kills, ranks - 2))
    phases = _phases(rng, RANK_PHASES, len(victims))
    for step, r, phase in zip(sorted(rng.sample(window, len(victims))), victims, phases):
        kills.append(Kill(step, f"rank{r}", phase, round(rng.uniform(0, 0.05), 4)))
    phases = _phases(rng, AGGREGATOR_PHASES, aggregator_kills)
    for step, phase in zip(sorted(rng.sample(window, aggregator_kills)), phases):
        kills.append(Kill(step, "aggregator", phase, round(rng.uniform(0, 0.05), 4)))
    return sorted(kills, key=lambda k: (k.step, RANK_PHASES.index(k.phase) if k.phase in RANK_PHASES else 3))


def _phases(rng: random.Random, phases: tuple[str, ...], n: int) -> list[str]:
    """``n`` phases in a seeded order, each used once before any is used again."""
    out: list[str] = []
    while len(out) < n:
        out += rng.sample(phases, len(phases))
    return out[:n]


def run(
    seed: int,
    steps: int,
    ranks: int,
    kills: list[Kill],
    out_dir: Path,
    result_timeout: float = RESULT_TIMEOUT_S,
    recovery_timeout: float = RECOVERY_TIMEOUT_S,
) -> dict:
    """Run the schedule on a fresh local Ray instance; write ``chaos.jsonl`` and ``chaos.json`` (the
    schedule, the world size of every step, timings) to ``out_dir``; return the latter."""
    from rlmetrics.sinks import JsonlSink

    name = f"chaos-{uuid.uuid4().hex[:8]}"
    by_step: dict[int, list[Kill]] = {}
    for k in kills:
        by_step.setdefault(k.step, []).append(k)
    world_sizes, errors, slow = [], [], []
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    t0 = time.perf_counter()
    try:
        root = rlmetrics.get_metric_worker(name=name, recovery_timeout=recovery_timeout)
        ray.get(root.ping.remote())  # the driver owns the aggregator: a rank's death can't take it along
        actors = {f"rank{r}": Rank.remote(name, r, ranks, seed) for r in range(ranks)}
        alive = dict(actors)
        reader = rlmetrics.connect("ray", name=name)

        def read(step: int) -> rlmetrics.StepResult | None:
            t_read = time.perf_counter()
            try:
                return reader.result(step, timeout=result_timeout, finalize=True)
            except Exception as exc:  # noqa: BLE001 - reported; the step is then missing from the JSONL
                errors.append(f"step {step}: result failed: {exc!r}")
                return None
            finally:
                if time.perf_counter() - t_read > 2.0:
                    slow.append(step)

        def kill(k: Kill) -> None:
            if k.target == "aggregator":
                ray.kill(root, no_restart=False)
            else:
                ray.kill(alive.pop(k.target))

        with JsonlSink(out_dir / "chaos.jsonl") as sink:
            for step in range(steps):
                todo = by_step.get(step, [])
                for k in todo:
                    if k.phase == "before":
                        kill(k)
                running = dict(alive)
                world_sizes.append(len(running))
                refs = {r: a.step.remote(step, len(running)) for r, a in running.items()}
                t_step = time.perf_counter()
                # A "read" kill: the driver reads at once, while the ranks still submit, and the
                # aggregator dies under the waiting result() call (from a timer thread).
                timers = [threading.Timer(k.delay, kill, (k,)) for k in todo if k.phase == "read"]
                for t in timers:
                    t.start()
                for k in sorted((k for k in todo if k.phase == "during"), key=lambda k: k.delay):
                    time.sleep(max(0.0, k.delay - (time.perf_counter() - t_step)))
                    kill(k)
                res = read(step) if timers else None
                for r, ref in refs.items():
                    try:
                        ray.get(ref, timeout=STEP_TIMEOUT_S)
                    except ray.exceptions.RayActorError:
                        if r in alive:  # only a rank killed by the schedule may fail
                            errors.append(f"step {step}: live {r} failed")
                    except Exception as exc:
                        errors.append(f"step {step}: {r}: {exc!r}")
                for k in todo:
                    if k.phase == "after":
                        kill(k)
                if not timers:
                    res = read(step)
                for t in timers:
                    t.join()
                if res is not None:
                    sink.log(res, step)
        seconds = time.perf_counter() - t0
        restarts = ray._private.state.actors(actor_id=root._actor_id.hex())["NumRestarts"]
        for actor in (*alive.values(), root):
            ray.kill(actor)
    finally:
        ray.shutdown()
    info = {
        "seed": seed,
        "steps": steps,
        "ranks": ranks,
        "kills": [asdict(k) for k in kills],
        "world_sizes": world_sizes,
        "errors": errors,
        "slow_reads": slow,
        "seconds": seconds,
        "result_timeout": result_timeout,
        "recovery_timeout": recovery_timeout,
        "aggregator_restarts": restarts,
    }
    (out_dir / "chaos.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
    return info


def rank_of(client_id: str) -> int:
    """``rank3@host:pid:id`` → 3."""
    m = re.match(r"rank(\d+)@", client_id)
    if m is None:
        raise ValueError(f"not a rank's client id: {client_id!r}")
    return int(m.group(1))


def expected(seed: int, step: int, ranks: Iterable[int]) -> dict[str, float]:
    """The step's values by numpy over the data of ``ranks``."""
    ranks = sorted(ranks)
    allv = np.concatenate([rank_data(seed, r, step) for r in ranks])
    return {
        "x/mean": allv.mean(),
        "x/min": allv.min(),
        "x/max": allv.max(),
        "x/std": allv.std(),
        "x/total": allv.sum(),
        "ranks/total": float(len(ranks)),
    }


def check(info: dict, records: list[dict]) -> tuple[list[str], dict]:
    """Every failure of the run's guarantees (see the module doc), and counts for the report."""
    seed, steps, ranks = info["seed"], info["steps"], info["ranks"]
    fails = list(info["errors"])
    agg_kills = sum(k["target"] == "aggregator" for k in info["kills"])
    if bool(agg_kills) != bool(info["aggregator_restarts"]):
        fails.append(f"{agg_kills} aggregator kill(s) but {info['aggregator_restarts']} restart(s)")
    seen = [r["step"] for r in records]
    if seen != list(range(steps)):
        fails.append(f"JSONL steps are not 0..{steps - 1} once each: {len(seen)} records")
    dead_at_start: dict[int, set[int]] = {s: set() for s in range(steps)}
    killed_in: dict[int, set[int]] = {s: set() for s in range(steps)}
    for k in info["kills"]:
        if k["target"].startswith("rank"):
            r = int(k["target"][4:])
            killed_in[k["step"]].add(r)
            for s in range(k["step"] + (k["phase"] != "before"), steps):
                dead_at_start[s].add(r)
    counts = {"complete": 0, "partial": 0}
    for rec in records:
        s, meta, got = rec["step"], StepMeta.from_dict(rec.get("meta", {})), rec["metrics"]
        if not 0 <= s < steps:
            continue
        started = set(range(ranks)) - dead_at_start[s]
        survivors = started - killed_in[s]
        killed = set(range(ranks)) - survivors
        # The sink keeps meta for partial steps; a complete step had every rank that started it.
        contributors = {rank_of(c) for c in meta.contributors} if "meta" in rec else started
        if meta.complete and contributors != started:
            fails.append(f"step {s}: complete with contributors {sorted(contributors)} of {sorted(started)}")
        missing = {rank_of(c) for c in meta.missing_ranks}
        complete = meta.complete
        counts["complete" if complete else "partial"] += 1
        where = f"step {s}"
        if not survivors <= contributors <= started:
            fails.append(f"{where}: contributors {sorted(contributors)}, started {sorted(started)}, "
                         f"survivors {sorted(survivors)}")  # fmt: skip
        if not missing <= killed or missing & contributors:
            fails.append(f"{where}: missing ranks {sorted(missing)} not among the killed {sorted(killed)}")
        if complete != (not meta.missing_ranks and not meta.missing_metrics):
            fails.append(f"{where}: complete={complete} but meta {meta}")
        if meta.evicted:
            fails.append(f"{where}: evicted result")
        for name, (received, wanted) in meta.missing_metrics.items():
            if received != len(contributors) or wanted != info["world_sizes"][s]:
                fails.append(
                    f"{where}: {name} received {received} of {wanted}, {len(contributors)} contributed"
                )
        if not contributors:
            fails.append(f"{where}: no contributor")
            continue
        want = expected(seed, s, contributors)
        if got.keys() != want.keys():
            fails.append(f"{where}: names {sorted(got)}")
            continue
        for n, v in want.items():
            if not math.isclose(got[n], v, rel_tol=1e-9, abs_tol=1e-12):
                fails.append(f"{where}: {n} = {got[n]!r}, numpy over ranks {sorted(contributors)}: {v!r}")
    return fails, counts


def run_chaos(
    seed: int,
    steps: int,
    ranks: int,
    rank_kills: int,
    aggregator_kills: int,
    out_dir: Path,
    result_timeout: float = RESULT_TIMEOUT_S,
    recovery_timeout: float = RECOVERY_TIMEOUT_S,
):
    """Schedule, run and check; returns ``(info, failures, counts)``."""
    from rlmetrics.sinks import read_jsonl

    kills = schedule(seed, steps, ranks, rank_kills, aggregator_kills)
    info = run(seed, steps, ranks, kills, out_dir, result_timeout, recovery_timeout)
    fails, counts = check(info, read_jsonl(out_dir / "chaos.jsonl").records)
    return info, fails, counts


def main(argv: list[str] | None = None) -> int:
    p = report.parser(__doc__, "50 steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ranks", type=int, default=6)
    p.add_argument("--rank-kills", type=int, help="default: max(2, steps // 60)")
    p.add_argument("--aggregator-kills", type=int, help="default: max(2, steps // 40)")
    p.add_argument("--result-timeout", type=float, default=RESULT_TIMEOUT_S, help="seconds per result()")
    p.add_argument(
        "--recovery-timeout",
        type=float,
        default=RECOVERY_TIMEOUT_S,
        help="seconds a restarted aggregator waits for the ranks' resends (keep it below --result-timeout)",
    )
    p.add_argument("--out", type=Path, help="directory of chaos.jsonl and chaos.json (default: temporary)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 50
    if args.steps < 8 or args.ranks < 3:
        p.error("need --steps >= 8 and --ranks >= 3")
    rank_kills = max(2, args.steps // 60) if args.rank_kills is None else args.rank_kills
    aggregator_kills = max(2, args.steps // 40) if args.aggregator_kills is None else args.aggregator_kills
    head = report.header("chaos", f"ray {ray.__version__}", f"rlmetrics {rlmetrics.__version__}")
    print(head, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.out or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        info, fails, counts = run_chaos(
            args.seed,
            args.steps,
            args.ranks,
            rank_kills,
            aggregator_kills,
            out_dir,
            args.result_timeout,
            args.recovery_timeout,
        )
    rows = [[k["step"], k["target"], k["phase"], f"{k['delay'] * 1e3:.0f}"] for k in info["kills"]]
    body = report.table(["step", "killed", "when", "delay ms"], rows) + "\n\n" + report.table(
        ["seed", "steps", "ranks", "aggregator restarts", "complete steps", "partial steps",
         "slow reads (> 2 s)", "s"],
        [[args.seed, args.steps, args.ranks, info["aggregator_restarts"], counts["complete"],
          counts["partial"], len(info["slow_reads"]), f"{info['seconds']:.0f}"]],
    )  # fmt: skip
    notes = [
        f"result timeout {args.result_timeout:g} s, recovery timeout {args.recovery_timeout:g} s",
        *[f"FAIL {f}" for f in fails[:20]],
        f"every step logged, each complete and exact or partial naming only killed ranks, values = numpy "
        f"over its contributors: {len(fails)} failure(s) — {report.verdict(not fails)}",
    ]
    report.emit(head, body, notes, args.markdown)
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
