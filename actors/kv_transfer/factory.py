"""KVConnectorFactory: KV connectors by name, as vLLM's. A connector is registered with the
module and class that implement it (imported when first created); ``kv_connector_module_path``
in the config imports a module that registers more."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from actors.engine.config import EngineConfig
    from actors.kv_transfer.base import KVConnectorBase, KVConnectorRole
    from actors.kv_transfer.config import KVTransferConfig


class KVConnectorFactory:
    _registry: dict[str, Callable[[], type]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"KV connector {name!r} is already registered")

        def loader() -> type:
            return getattr(importlib.import_module(module_path), class_name)
        cls._registry[name] = loader

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def check(cls, config: KVTransferConfig) -> None:
        """ValueError naming the connector when it is not registered (after importing
        ``kv_connector_module_path``)."""
        if config.kv_connector not in cls._registry and config.kv_connector_module_path:
            importlib.import_module(config.kv_connector_module_path)
        if config.kv_connector not in cls._registry:
            raise ValueError(f"unknown kv_connector {config.kv_connector!r}; registered: {', '.join(cls.names())}")
        cls._registry[config.kv_connector]().check_config(config)

    @classmethod
    def check_engine(cls, config: EngineConfig) -> None:
        """The configured connector's check of the whole engine config (None: no connector)."""
        if config.kv_transfer is not None:
            cls.check(config.kv_transfer)
            cls._registry[config.kv_transfer.kv_connector]().check_engine_config(config)

    @classmethod
    def create_connector(cls, config: EngineConfig, role: KVConnectorRole, rank: int = 0) -> KVConnectorBase:
        """The connector's ``role`` side; a worker side serves its engine core's rank ``rank``
        (pipeline stage x tensor-parallel size + tensor-parallel rank)."""
        kv = config.kv_transfer
        if kv is None:
            raise ValueError("no kv_transfer_config: no KV connector to create")
        cls.check(kv)
        connector = cls._registry[kv.kv_connector]()(config, role)
        connector.rank = rank
        return connector


KVConnectorFactory.register_connector("TroupeConnector", "actors.kv_transfer.troupe_connector", "TroupeConnector")
KVConnectorFactory.register_connector("NixlConnector", "actors.kv_transfer.troupe_connector", "NixlConnector")
KVConnectorFactory.register_connector("ExampleConnector", "actors.kv_transfer.storage_connector", "StorageConnector")
KVConnectorFactory.register_connector("SharedStorageConnector", "actors.kv_transfer.storage_connector",
                                      "StorageConnector")
KVConnectorFactory.register_connector("MultiConnector", "actors.kv_transfer.multi_connector", "MultiConnector")
