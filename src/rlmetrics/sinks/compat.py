"""Every tracker API outside the trackers' public surface that the sinks use, in one place (:func:`check`)."""

from __future__ import annotations

import importlib
import sqlite3
import struct
import sys
import zlib
from contextlib import closing
from pathlib import Path
from typing import Any

from rlmetrics.extras import require

_HEADER, _BLOCK = 7, 32768  # leveldb log format: 7-byte file and record headers, 32 KiB blocks
_FILE_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)  # magic, W&B's magic number, format version 0


def wandb_last_record(path: Path) -> str | None:
    """The kind of the last whole record of a W&B run file (None: none); ValueError: not W&B's format."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) >= _HEADER and data[:_HEADER] != _FILE_HEADER:
        raise ValueError(f"W&B run file {path} is not of the format this rlmetrics reads")
    Record = require("wandb.proto.wandb_internal_pb2", "trackers").Record
    pos, chunks, last = _HEADER, [], None
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # block trailer
            pos += _BLOCK - pos % _BLOCK
            continue
        checksum, length, kind = struct.unpack_from("<IHB", data, pos)
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        if (
            kind not in (1, 2, 3, 4)
            or len(chunk) < length
            or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != checksum
        ):
            break  # damaged, or cut: the file ends inside this record
        chunks.append(chunk)
        pos += _HEADER + length
        if kind in (1, 4):  # FULL or LAST
            record = Record()
            record.ParseFromString(b"".join(chunks))
            last, chunks = record.WhichOneof("record_type"), []
    return last


def mlflow_dispose(uri: str) -> None:
    """Close this process's connections to the store MLflow opened for ``uri``."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    engine = getattr(SqlAlchemyStore, "_engine_map", {}).get(uri)
    if engine is not None:
        engine.dispose()


def mlflow_store_has_experiment(path: Path) -> bool:
    """Whether the SQLite store ``path`` holds an MLflow experiment (sqlite3.DatabaseError: no database)."""
    with closing(sqlite3.connect(path)) as db:
        if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'experiments'").fetchone():
            return False
        return db.execute("SELECT 1 FROM experiments LIMIT 1").fetchone() is not None


def clearml_no_reporter(Task: Any) -> None:
    """ClearML reports from a thread of this process, not a subprocess (offline: no server)."""
    if hasattr(Task, "_report_subprocess_enabled"):
        Task._report_subprocess_enabled = False


def trackio_folders(folders: dict[str, Path]) -> None:
    """Point the module-level folders of every imported trackio module at ``folders``."""
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "trackio" or name.startswith("trackio.")):
            for attr, path in folders.items():
                if isinstance(getattr(module, attr, None), Path):
                    setattr(module, attr, path)


_NEEDED = {
    "wandb.proto.wandb_internal_pb2": ("Record",),
    "mlflow.store.tracking.sqlalchemy_store": ("SqlAlchemyStore._engine_map",),
    "clearml": ("Task._report_subprocess_enabled",),
    "trackio": ("TRACKIO_DIR",),
}


def check() -> list[str]:
    """The private APIs above that the installed trackers lack (a tracker not installed: none).

    >>> isinstance(check(), list)
    True
    """
    missing = []
    for module, attrs in _NEEDED.items():
        top = module.split(".")[0]
        if importlib.util.find_spec(top) is None:
            continue
        try:
            found: Any = importlib.import_module(module)
        except ImportError:
            missing.append(module)
            continue
        for attr in attrs:
            obj = found
            for part in attr.split("."):
                obj = getattr(obj, part, None)
            if obj is None:
                missing.append(f"{module}.{attr}")
    return missing
