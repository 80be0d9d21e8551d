"""The vLLM Encoder-Cache connector (the only package of ec_redis that imports vLLM).

Load it with ``"ec_connector": "ECRedisConnector", "ec_connector_module_path":
"ec_redis.connector"``. Importing this module is cheap: no Redis client, no CUDA work.
"""

from ec_redis.connector.connector import ECRedisConnector

__all__ = ["ECRedisConnector"]
