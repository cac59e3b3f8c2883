"""vLLM KV events for the blocks KVStoreConnector keeps in kvstore (medium STORAGE).

A KV-aware router (llm-d, Dynamo) learns where KV lives from engines' KV events.
vLLM publishes its own (GPU, CPU) and whatever its connector hands it through
``take_events()`` on the scheduler side; this module makes the connector's:

    BlockStored   a block the connector saved is in kvstore (the master applied
                  its STORED): the engine's own block hash, parent hash, token
                  ids and block size, as vLLM's block pool reports its GPU blocks
    BlockRemoved  kvstore let such a block go: evicted (by any node's pressure, an
                  admin) or removed by any client

Both come from the store's own event log (WatchEvents, :mod:`kvstore.client.events`),
not from this process's puts: a block counts as stored when the store says so,
and a block evicted because another engine filled a node is reported too::

    scheduler: build_connector_meta --planned(req, blocks)--> pending[key] = BlockStored
    store log: KEY_STORED key  -> pending -> queue (BlockStored), saved[key] = engine hash
               KEY_EVICTED / KEY_REMOVED key in saved -> queue (BlockRemoved)
    vLLM:      take_events() drains the queue each step; its publisher sends them

Keys are rank 0's (the scheduler's view); with tensor parallelism a block is
stored once its rank-0 object is. A plan whose block never lands (a failed or
"already present" put) is dropped after ``PENDING_S``; the blocks remembered for
removals are bounded (``max_blocks``, oldest forgotten first). Events lost by the
store's log (a master restart: :class:`~kvstore.client.events.Lost`) are logged;
the blocks stored before it are not reported removed if they went meanwhile.

Thread safety: ``planned``/``track``/``take`` run on vLLM's scheduler thread, the
log is read on a thread of its own; one lock guards the tables.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Iterable

from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvstore.client.events import EventWatcher, Lost
from kvstore.client.integrations.vllm.keys import EngineIdentity, request_keys
from kvstore.rpc import ClientCredentials

log = logging.getLogger("vllm.kvstore_connector.kv_events")

#: A planned save whose STORED has not come this long is forgotten (seconds).
PENDING_S = 600.0
#: Blocks remembered for their BlockRemoved by default.
MAX_BLOCKS = 1 << 18


def enabled(vllm_config) -> bool:
    """Whether vLLM publishes KV events (``kv_events_config.enable_kv_cache_events``)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and cfg.enable_kv_cache_events)


class ConnectorKVEvents:
    """The scheduler side's KV events (see the module doc).

    Args:
        master: the kvstore master (any shard).
        identity: the engine's namespace (rank 0's keys).
        block_size: tokens per block.
        creds: a ``metrics`` or ``admin`` token (the store's log is theirs).
        medium: the events' ``medium`` (vLLM's STORAGE).
        locality: the events' ``locality``: LOCAL (default: this engine can load the
            block, which is what a router routes on; Dynamo drops STORAGE events that
            are not LOCAL), REMOTE, or None (unset).
        max_blocks: blocks remembered for their BlockRemoved.

    Raises:
        Unavailable: the store's log could not be opened in time.
    """

    def __init__(self, master: str, identity: EngineIdentity, block_size: int,
                 creds: ClientCredentials, medium: str = MEDIUM_STORAGE,
                 locality: str | None = "LOCAL", max_blocks: int = MAX_BLOCKS,
                 timeout_s: float = 5.0):
        self.identity = identity
        self.block_size = block_size
        self.medium = medium
        self.locality = locality
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._requests: dict[str, Any] = {}                  # req id -> vLLM Request
        self._pending: dict[str, tuple[float, BlockStored]] = {}   # key -> (planned at, event)
        self._saved: OrderedDict[str, Any] = OrderedDict()   # key -> engine block hash
        self._out: deque = deque()
        self.counts = {"stored": 0, "removed": 0, "lost": 0}
        self._watcher = EventWatcher(master, creds=creds, timeout_s=timeout_s)
        self._watcher.wait_ready(timeout_s)        # saves planned from now on are seen
        self._thread = threading.Thread(target=self._follow, name="kvstore-kv-events",
                                        daemon=True)
        self._thread.start()

    # ---- vLLM's scheduler thread ----
    def track(self, request) -> None:
        """A new request (its block hashes are read when its saves are planned)."""
        with self._lock:
            self._requests[request.request_id] = request

    def untrack(self, req_id: str) -> None:
        with self._lock:
            self._requests.pop(req_id, None)

    def planned(self, req_id: str, tokens: list[int], lora_name: str, cache_salt: str,
                blocks: Iterable[int]) -> None:
        """Blocks (indices into the request's tokens) the worker is told to save now."""
        with self._lock:
            request = self._requests.get(req_id)
        blocks = list(blocks)
        if request is None or not blocks:
            return
        keys = request_keys(self.identity, tokens[:(max(blocks) + 1) * self.block_size],
                            lora_name, cache_salt)
        hashes = list(request.block_hashes)
        now = time.monotonic()
        events = {keys[b]: self._stored_event(request, hashes, b) for b in blocks
                  if b < len(hashes)}
        with self._lock:
            for key, ev in events.items():
                self._pending[key] = (now, ev)

    def _stored_event(self, request, hashes: list, b: int) -> BlockStored:
        bs = self.block_size
        lora = getattr(request, "lora_request", None)
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(hashes[b])],
            parent_block_hash=maybe_convert_block_hash(hashes[b - 1]) if b else None,
            token_ids=list(request.all_token_ids[b * bs:(b + 1) * bs]), block_size=bs,
            lora_id=lora.adapter_id if lora is not None else None, medium=self.medium,
            lora_name=lora.name if lora is not None else None,
            extra_keys=_extra_keys(request, b * bs, (b + 1) * bs), group_idx=0,
            locality=self.locality,
            session_id=getattr(request, "session_id", None))

    def take(self) -> list:
        """The events since the last call, in the order the store applied them."""
        with self._lock:
            out = list(self._out)
            self._out.clear()
            if self._pending:
                old = time.monotonic() - PENDING_S
                for key in [k for k, (t, _) in self._pending.items() if t < old]:
                    del self._pending[key]
        return out

    # ---- the store's log, on its own thread ----
    def _follow(self) -> None:
        try:
            for ev in self._watcher.events():
                if isinstance(ev, Lost):
                    self._lost(ev.reason)
                    continue
                self._apply(ev.kind, ev.key)
        except Exception as exc:  # noqa: BLE001 - the engine goes on without events
            self._lost(f"{type(exc).__name__}: {exc}")

    def _lost(self, reason: str) -> None:
        self.counts["lost"] += 1
        log.warning("kvstore's event log: events lost (%s); KV events of STORAGE blocks may "
                    "be missing", reason)

    def _apply(self, kind: str, key: str) -> None:
        with self._lock:
            if kind == "STORED":
                planned = self._pending.pop(key, None)
                if planned is None:
                    return
                event = planned[1]
                self._saved[key] = event.block_hashes[0]
                if len(self._saved) > self.max_blocks:
                    self._saved.popitem(last=False)
                self._out.append(event)
                self.counts["stored"] += 1
            else:                                     # EVICTED, REMOVED
                block_hash = self._saved.pop(key, None)
                if block_hash is None:
                    return
                self._out.append(BlockRemoved(block_hashes=[block_hash], medium=self.medium,
                                              group_idx=0, locality=self.locality))
                self.counts["removed"] += 1

    def close(self) -> None:
        self._watcher.close()
        self._thread.join(timeout=5)


def _extra_keys(request, start: int, end: int):
    """vLLM's per-block extra keys (LoRA, multimodal, cache salt) as its events carry
    them; None when this vLLM cannot say."""
    try:
        from vllm.v1.core.kv_cache_utils import (generate_block_hash_extra_keys,
                                                 to_event_extra_keys)
        keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
        return to_event_extra_keys([keys])
    except Exception:  # noqa: BLE001 - an older or newer vLLM: the events go without them
        return None


def for_connector(vllm_config, master: str, identity: EngineIdentity, block_size: int,
                  extra: dict) -> ConnectorKVEvents | None:
    """The scheduler side's KV events when vLLM publishes KV events and the extra config
    does not say ``"kv_events": false``; None otherwise, or when the store's log cannot
    be watched (logged: the engine runs on, without STORAGE events).

    The token: ``kv_events_token_file`` of the extra config, else ``$KVSTORE_EVENTS_TOKEN``,
    else the connector's own (a ``client`` token is refused by a cluster with ``--auth``).
    """
    import os

    if not enabled(vllm_config) or not extra.get("kv_events", True):
        return None
    try:
        token_file = extra.get("kv_events_token_file")
        creds = ClientCredentials.resolve(os.environ.get("KVSTORE_EVENTS_TOKEN"),
                                          token_file=token_file)
        return ConnectorKVEvents(master, identity, block_size, creds,
                                 locality=extra.get("kv_events_locality", "LOCAL"),
                                 max_blocks=int(extra.get("kv_events_max_blocks", MAX_BLOCKS)),
                                 timeout_s=float(extra.get("timeout_s", 5.0)))
    except Exception as exc:  # noqa: BLE001 - never fail the engine for its events
        log.error("kvstore KV events are off: the store's event log cannot be watched "
                  "(%s: %s); a metrics or admin token is needed on a cluster with --auth",
                  type(exc).__name__, exc)
        return None
