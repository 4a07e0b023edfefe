"""The adapters an engine knows: those served by name (``--lora-modules``, and loaded or
unloaded at run time), and those loaded on the host, at most ``--max-cpu-loras`` of them
(least recently used out first; read from disk again when a request needs it).

A sequence holds its adapter object from admission to finish, so unloading an adapter or
evicting it from the host cache never takes it from a request in flight: the request
runs to its end with the weights it started with, and new requests for the name get 404.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict

import torch

from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.errors import BadInput
from kvledger.engine.model.lora_adapter import LoraAdapter, load_adapter, max_weights_bytes
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.lora_config import LoraModule, LoRARequest

# Adapters served by name take ids above this, apart from the ids Python API callers pick.
SERVED_ID_BASE = 1_000_000


class UnknownAdapter(BadInput):
    """A request names an adapter that is not served (HTTP 404)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist (no such LoRA adapter is loaded)")
        self.name = name


class LoraRegistry:
    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.model_config = model_config
        self.dtype = dtype  # the slots' (the model's): an adapter's weights must fit it
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        self._lock = threading.Lock()  # the server's loop and the engine thread both read
        self._served: dict[str, LoRARequest] = {}
        self._host: OrderedDict[int, LoraAdapter] = OrderedDict()
        self._ids = itertools.count(1)
        self.requests_total: dict[str, int] = {}  # kvledger's per-adapter request counter
        for module in config.lora_modules:
            self.add(module)

    @property
    def served(self) -> dict[str, LoRARequest]:
        """The adapters served by name, in the order they were added."""
        with self._lock:
            return dict(self._served)

    def lookup(self, name: str) -> LoRARequest:
        """The request for a served adapter; UnknownAdapter when none has that name."""
        with self._lock:
            request = self._served.get(name)
        if request is None:
            raise UnknownAdapter(name)
        return request

    def add(self, module: LoraModule) -> LoRARequest:
        """Serve an adapter under ``module.name``: read and checked now (BadInput naming what
        does not fit), so a bad adapter is refused before any request names it."""
        with self._lock:
            if module.name in self._served:
                raise BadInput(f"LoRA adapter {module.name!r} is already loaded")
            request = LoRARequest(module.name, SERVED_ID_BASE + next(self._ids), module.path)
        self.resolve(request)
        with self._lock:
            if module.name in self._served:
                raise BadInput(f"LoRA adapter {module.name!r} is already loaded")
            self._served[module.name] = request
        return request

    def remove(self, name: str) -> LoRARequest:
        """Stop serving ``name``; requests already admitted keep their weights."""
        with self._lock:
            request = self._served.pop(name, None)
            if request is None:
                raise UnknownAdapter(name)
            self._host.pop(request.lora_int_id, None)
            self.requests_total.pop(name, None)  # no series left behind for a name gone
        return request

    def resolve(self, request: LoRARequest) -> LoraAdapter:
        """The loaded adapter of ``request``: from the host cache, else read and checked."""
        with self._lock:
            adapter = self._host.get(request.lora_int_id)
            if adapter is not None:
                if adapter.request.lora_path != request.lora_path:
                    raise BadInput(f"LoRARequest {request.lora_name!r}: lora_int_id "
                                   f"{request.lora_int_id} is adapter {adapter.name!r} "
                                   f"({adapter.request.lora_path}); give each adapter its "
                                   "own id")
                self._host.move_to_end(request.lora_int_id)
                return adapter
        adapter = load_adapter(request, self._directory(request), self.model_config,
                               self.config.max_lora_rank, self.dtype)
        with self._lock:
            self._host[request.lora_int_id] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        return adapter

    def count(self, name: str) -> None:
        with self._lock:
            if name in self._served:
                self.requests_total[name] = self.requests_total.get(name, 0) + 1

    def _directory(self, request: LoRARequest) -> str:
        from kvledger.engine.checkpoint.hub.adapters import adapter_directory

        return adapter_directory(request.lora_path, self.config.download_dir,
                                 hub_timeout_s=self.config.hub_timeout_s,
                                 max_weights_bytes=max_weights_bytes(
                                     self.model_config, self.config.max_lora_rank))
