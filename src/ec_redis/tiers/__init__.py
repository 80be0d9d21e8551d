"""The three cache tiers: device (GPU), host (CPU) and Redis, behind one small protocol."""

from ec_redis.tiers.base import Tier
from ec_redis.tiers.cpu import HostTier
from ec_redis.tiers.gpu import DeviceTier
from ec_redis.tiers.redis_tier import RedisTier

__all__ = ["DeviceTier", "HostTier", "RedisTier", "Tier"]
