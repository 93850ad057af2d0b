"""Readers of what the tracker sinks wrote, with each tracker's own format code: TensorBoard's
EventAccumulator, the W&B transaction log parsed with wandb's protobufs, SwanLab's DataStoreReader,
MLflow's client. Lists keep file order and duplicates (a step written twice shows twice)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def one(root: Path, pattern: str) -> Path:
    found = sorted(Path(root).glob(pattern))
    assert len(found) == 1, found
    return found[0]


# ---------------------------------------------------------------------------------- TensorBoard
def tensorboard_accumulator(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    return acc


def read_tensorboard(log_dir) -> dict[str, dict[int, float]]:
    acc = tensorboard_accumulator(log_dir)
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_steps(log_dir) -> dict[str, list[int]]:
    """Every scalar event's step, by tag."""
    acc = tensorboard_accumulator(log_dir)
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_texts(log_dir) -> dict[str, list[tuple[int, str]]]:
    """Every text summary (TensorBoard's text plugin): ``(step, text)`` by tag, as TensorBoard's
    plugin reader keeps them (the legacy reader keeps those a restart's START drops)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {
        tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
        for tag in acc.PluginTagToContent("text")
    }


# ------------------------------------------------------------------------------------------ W&B
def wandb_records(run_file) -> list:
    """The records of a ``.wandb`` file: a leveldb-log framed stream of wandb ``Record`` protobufs."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = Path(run_file).read_bytes()
    assert data[:4] == b":W&B"
    block, pos, buf, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # cut by a crash
            break
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = Record()
            record.ParseFromString(buf)
            buf = b""
            records.append(record)
    return records


def wandb_run_files(out, run_id) -> list[Path]:
    """The run files of every session of the W&B run ``run_id`` under ``out/wandb``, oldest first: a
    session's folder is ``offline-run-<time>-<id>``, ``-<id>-1`` when it started in the same second
    as the one before."""
    files = out.glob(f"wandb/*-{run_id}*/run-{run_id}.wandb")
    mine = [f for f in files if re.fullmatch(rf".*-{re.escape(run_id)}(-\d+)?", f.parent.name)]
    return sorted(mine, key=lambda f: f.parent.name)


def wandb_rows(run_files) -> list[tuple[int, dict]]:
    """``(step, {key: value})`` of every history record of the files, in order."""
    rows = []
    for run_file in run_files:
        for record in wandb_records(run_file):
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items}
                rows.append((record.history.step.num, row))
    return rows


def read_wandb(run_file) -> dict[int, dict]:
    return dict(wandb_rows([run_file]))


def wandb_alerts(run_files) -> list[tuple[str, str, str]]:
    """``(title, text, level)`` of every alert record of the files."""
    return [
        (r.alert.title, r.alert.text, r.alert.level)
        for f in run_files
        for r in wandb_records(f)
        if r.WhichOneof("record_type") == "alert"
    ]


def wandb_config(run_file) -> dict:
    """The run config of a ``.wandb`` file (its ``run`` record; W&B's own ``_wandb`` key left out)."""
    (run,) = [r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run"]
    return {i.key: json.loads(i.value_json) for i in run.config.update if i.key != "_wandb"}


# -------------------------------------------------------------------------------------- SwanLab
def swanlab_records(run_file) -> list:
    """The records of a ``.swanlab`` file (none when a killed process left it empty: SwanLab writes
    its header with the first flush)."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    if Path(run_file).stat().st_size == 0:
        return []

    reader = DataStoreReader()
    reader.open(str(run_file))
    records = []
    try:
        for raw in reader:
            record = Record()
            record.ParseFromString(raw)
            records.append(record)
    finally:
        reader.close()
    return records


def swanlab_scalars(run_files) -> dict[str, list[tuple[int, float]]]:
    """``(step, value)`` of every scalar record of the files, by key."""
    series: dict[str, list] = {}
    for run_file in run_files:
        for record in swanlab_records(run_file):
            if record.HasField("scalar"):
                series.setdefault(record.scalar.key, []).append(
                    (record.scalar.step, record.scalar.value.number)
                )
    return series


def read_swanlab(run_file) -> dict[str, dict[int, float]]:
    return {key: dict(points) for key, points in swanlab_scalars([run_file]).items()}


def swanlab_texts(run_files) -> dict[str, list[tuple[int, str]]]:
    """``(step, text)`` of every text record of the files (the text is a file under the run's
    ``media/``), by key."""
    texts: dict[str, list] = {}
    for run_file in run_files:
        media = Path(run_file).parent / "media"
        for record in swanlab_records(run_file):
            if record.HasField("media"):
                for item in record.media.value.items:
                    (path,) = media.rglob(item.filename)
                    texts.setdefault(record.media.key, []).append((record.media.step, path.read_text()))
    return texts


def swanlab_config(run_file) -> dict:
    """The run config of a ``.swanlab`` file: the YAML file its config ``save`` record names (what
    ``swanlab sync`` uploads), ``{key: {"value": ..., "sort": ..., "desc": ...}}``, as ``{key: value}``."""
    import yaml
    from swanlab.proto.swanlab.save.v1.save_pb2 import SAVE_TYPE_CONFIG

    (path,) = {
        r.save.source_path
        for r in swanlab_records(run_file)
        if r.HasField("save") and r.save.type == SAVE_TYPE_CONFIG
    }
    path = Path(path)
    if not path.exists():  # a session moved since (set aside by a rebuilt run): its own files/
        path = Path(run_file).parent / "files" / path.name
    return {key: item["value"] for key, item in yaml.safe_load(path.read_text()).items()}


# --------------------------------------------------------------------------------------- MLflow
def mlflow_history(uri, run_id, key) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return [(m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key)]


def read_mlflow(uri, run_id, key) -> dict[int, float]:
    return dict(mlflow_history(uri, run_id, key))


# ---------------------------------------------------------------------------------- MLflow server
def mlflow_server(folder: Path, port: int | None = None):
    """A real ``mlflow server`` on loopback over a sqlite store in ``folder``: ``(process, uri)``
    once it answers (a port taken between the probe and the server's bind: another port, unless
    ``port`` is given: a server restarted where its clients look)."""
    mlflow = Path(sys.executable).parent / "mlflow"
    given = port
    for _ in range(3):
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        proc = subprocess.Popen(
            [
                str(mlflow),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{folder / 'server.db'}",
                "--default-artifact-root",
                str(folder / "artifacts"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # no job runners: MLflow 3 starts 7 huey consumers beside the server (about 40 s of CPU
            # on a 2-core machine at each start, for jobs no test runs)
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            start_new_session=True,  # a group of its own: a signal must reach the server's worker too
        )
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                return proc, f"http://127.0.0.1:{port}"
            except (urllib.error.URLError, OSError):
                time.sleep(0.25)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        port = None if given is None else port
    raise RuntimeError("mlflow server did not start")
