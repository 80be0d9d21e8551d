"""ec_redis: a GPU -> CPU -> Redis tiered encoder cache for vLLM's Encoder-Cache connector."""

from ec_redis.cache import TieredCache
from ec_redis.config import CacheConfig
from ec_redis.errors import BlobError, ConfigError, ECRedisError, TensorError
from ec_redis.keys import ModelIdentity

__all__ = [
    "BlobError",
    "CacheConfig",
    "ConfigError",
    "ECRedisError",
    "ModelIdentity",
    "TensorError",
    "TieredCache",
]
__version__ = "0.1.0"
