"""vLLM general plugin: registers ``ECRedisConnector`` so configs can name it without
``ec_connector_module_path`` (entry point group ``vllm.general_plugins``)."""

from __future__ import annotations

NAME = "ECRedisConnector"


def register() -> None:
    """Called by vLLM in every process that loads plugins; safe to call more than once."""
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    if NAME not in ECConnectorFactory._registry:
        ECConnectorFactory.register_connector(NAME, "ec_redis.connector", NAME)
