"""``KVStore``: the :class:`~rlmetrics.engine.store.Store` of a Ray aggregator, in Ray's internal KV store,
signed with a secret the actor was created with (a state another job wrote is refused: docs/reliability.md,
"Trust model: other jobs on the cluster"); encoded and written in a saver thread, off the event loop.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from rlmetrics.backends.ray import compat
from rlmetrics.engine.store import RefusedState, dump_state

logger = logging.getLogger(__name__)


class KVStore:
    """The saved state of the actor whose state lives under ``key``, signed with ``secret``."""

    def __init__(self, key: bytes, secret: bytes) -> None:
        self.key = key
        self.where = key.decode()
        self._secret = secret
        self._lock = threading.Lock()
        self._next: tuple[dict, Callable[[bool], None]] | None = None  # the newest save not written
        self._encoded: dict[int, str] = {}  # the JSON of saved results by step (dump_state)
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlmetrics-save")

    def load(self) -> dict | None:
        saved = compat.kv_get(self.key)
        if not saved:
            return None
        mac, _, body = saved.partition(b"\n")
        if not hmac.compare_digest(mac, self._sign(body)):
            raise RefusedState(
                f"the saved state under {self.where} is not this aggregator's (its signature does not match)"
            )
        try:
            return json.loads(body)
        except ValueError as exc:
            why = f"the saved state under {self.where} could not be read ({exc!r:.200})"
            raise RefusedState(why) from exc

    def save(self, state: dict, done: Callable[[bool], None]) -> None:
        with self._lock:
            posted, self._next = self._next is not None, (state, done)
        if not posted:
            self._saver.submit(self._write)

    def _write(self) -> None:
        with self._lock:
            (state, done), self._next = self._next, None
        try:
            body = dump_state(state, self._encoded).encode()
            compat.kv_put(self.key, self._sign(body) + b"\n" + body)
        except Exception:  # in the saver thread: nobody else would see it
            logger.exception("saving the aggregator's state failed; the next change saves it again")
            done(False)
            return
        done(True)

    def _sign(self, body: bytes) -> bytes:
        return hmac.new(self._secret, self.key + b"\n" + body, hashlib.sha256).hexdigest().encode()
