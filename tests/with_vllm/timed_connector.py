"""KVStoreConnector with a slowed store read and a timeline of the engine's steps, for
the async-load overlap test. Loaded by vLLM by module path (``kv_connector:
TimedKVConnector``, ``kv_connector_module_path: timed_connector``).

Extra config: ``test_read_delay_s`` (seconds each store read of a load sleeps
first: a slow store, or a far node) and ``test_timeline`` (a JSON file the
worker rewrites with its events: ``[t, what, detail]``, t from
``time.monotonic()``): ``forward`` (a step that ran the model), ``submitted``
(start_load_kv handed a request's load over), ``step_returned`` (that
start_load_kv returned), ``read_done`` (the read ended, on the load thread),
``reported`` (get_finished gave the request to vLLM).
"""

from __future__ import annotations

import json
import threading
import time

from kvstore.client.integrations.vllm.connector import KVStoreConnector


class TimedKVConnector(KVStoreConnector):
    """The connector, slowed and watched (see the module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._delay_s = float(extra.get("test_read_delay_s", 0.0))
        self._timeline_path = extra.get("test_timeline")
        self._events: list = []
        self._events_lock = threading.Lock()

    def _event(self, what: str, detail: str = "") -> None:
        with self._events_lock:
            self._events.append([time.monotonic(), what, detail])
            if self._timeline_path:
                with open(self._timeline_path, "w") as f:
                    json.dump(self._events, f)

    def _read_blocks(self, keys, dests):
        time.sleep(self._delay_s)
        try:
            return super()._read_blocks(keys, dests)
        finally:
            self._event("read_done", str(len(keys)))

    def start_load_kv(self, forward_context, **kwargs):
        if getattr(forward_context, "attn_metadata", None) is not None:
            self._event("forward")
        loads = [p.req_id for p in self._get_connector_metadata().requests if p.load_blocks]
        for req_id in loads:
            self._event("submitted", req_id)
        super().start_load_kv(forward_context, **kwargs)
        if loads:
            self._event("step_returned")

    def get_finished(self, finished_req_ids):
        sending, recving = super().get_finished(finished_req_ids)
        for req_id in recving or ():
            self._event("reported", req_id)
        return sending, recving
