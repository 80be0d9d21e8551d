"""One contract, every tier: DeviceTier, HostTier, RedisTier over fakeredis and a real server.

A miss is ``None``; what comes back is bit-exact (dtype, shape, bytes); ``get_many`` keeps
every key's own value; an overwrite serves the newest value. The local tiers also keep to
their byte budget, spill evictions and compact views.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import fakeredis
import pytest
import redis
import torch

from ec_redis.codec import read_header
from ec_redis.config import CacheConfig
from ec_redis.embedded import Flavor
from ec_redis.keys import KeyBuilder, ModelIdentity
from ec_redis.redis_conn import make_client
from ec_redis.tiers.base import Tier
from ec_redis.tiers.cpu import HostTier
from ec_redis.tiers.gpu import DeviceTier
from ec_redis.tiers.redis_tier import RedisTier, RedisTierOptions
from ec_redis.tiers.transfer import Transfer
from tests.conftest import bits, emptied

CHUNK = 64 * 1024
LOCAL_CAPACITY = 8 * 1024 * 1024

ALL_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random *bit patterns* (NaN payloads, -0.0, infinities included), so any conversion
    on the way shows up; bools get valid 0/1 bytes."""
    gen = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def assert_bit_exact(got: torch.Tensor | None, want: torch.Tensor) -> None:
    assert got is not None, "expected a hit, got a miss"
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert bits(got) == bits(want)


def big(seed: int, rows: int = 300) -> torch.Tensor:
    """About 300 KB of bf16 (rows x 512): five 64 KiB chunks in the Redis tier."""
    return random_tensor((rows, 512), torch.bfloat16, seed)


# -- the tiers -------------------------------------------------------------------------------


@dataclass
class TierCase:
    tier: Tier
    local: bool
    spilled: list[tuple[str, torch.Tensor]]


def _redis_tier(client: object) -> RedisTier:
    return RedisTier(
        client, KeyBuilder("t", ModelIdentity("m")), RedisTierOptions(chunk_bytes=CHUNK)
    )


def _make_device(request: pytest.FixtureRequest) -> TierCase:
    spilled: list[tuple[str, torch.Tensor]] = []
    tier = DeviceTier(LOCAL_CAPACITY, on_evict=lambda k, t: spilled.append((k, t)))
    return TierCase(tier, True, spilled)


def _make_host(request: pytest.FixtureRequest) -> TierCase:
    return TierCase(HostTier(LOCAL_CAPACITY, Transfer(torch.device("cpu"))), True, [])


def _make_fake_redis(request: pytest.FixtureRequest) -> TierCase:
    return TierCase(_redis_tier(fakeredis.FakeRedis()), False, [])


def _make_real_redis(request: pytest.FixtureRequest) -> TierCase:
    return _real_server_case(request, "redis")


def _make_real_valkey(request: pytest.FixtureRequest) -> TierCase:
    return _real_server_case(request, "valkey")


def _real_server_case(request: pytest.FixtureRequest, flavor: Flavor) -> TierCase:
    url = emptied(request.getfixturevalue("servers").get(flavor))
    client = make_client(CacheConfig(redis_url=url))  # the production client and packer
    request.addfinalizer(client.close)
    return TierCase(_redis_tier(client), False, [])


MAKERS: dict[str, Callable[[pytest.FixtureRequest], TierCase]] = {
    "device": _make_device,
    "host": _make_host,
    "redis-fake": _make_fake_redis,
    "redis-real": _make_real_redis,
    "valkey-real": _make_real_valkey,
}


@pytest.fixture(
    params=[
        "device",
        "host",
        "redis-fake",
        pytest.param("redis-real", marks=pytest.mark.redis),
        pytest.param("valkey-real", marks=[pytest.mark.redis, pytest.mark.valkey]),
    ]
)
def case(request: pytest.FixtureRequest) -> Iterator[TierCase]:
    made = MAKERS[request.param](request)
    yield made
    made.tier.close()


@pytest.fixture(params=["device", "host"])
def local_case(request: pytest.FixtureRequest) -> TierCase:
    return MAKERS[request.param](request)


# -- the contract ----------------------------------------------------------------------------


def test_a_missing_key_is_a_miss(case: TierCase) -> None:
    tier = case.tier
    assert tier.get("nope") is None
    assert not tier.contains("nope")
    assert tier.get_many(["nope", "nada"]) == {"nope": None, "nada": None}
    tier.delete("nope")  # deleting a missing key is a no-op


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_put_get_is_bit_exact_for_every_dtype(case: TierCase, dtype: torch.dtype) -> None:
    tier = case.tier
    shapes = [(1,), (37,), (3, 17), (2, 3, 5), (2, 1, 3, 4)]
    tensors = {f"{dtype}-{i}": random_tensor(s, dtype, seed=i) for i, s in enumerate(shapes)}
    for key, tensor in tensors.items():
        assert tier.put(key, tensor) is True
    for key, tensor in tensors.items():
        assert_bit_exact(tier.get(key), tensor)


def test_large_tensor_round_trips_bit_exact(case: TierCase) -> None:
    tensor = big(1)
    assert tensor.numel() * 2 > 4 * CHUNK  # several chunks in the Redis tier
    assert case.tier.put("big", tensor)
    assert_bit_exact(case.tier.get("big"), tensor)
    # and a size that lands exactly on a chunk boundary
    exact = random_tensor((CHUNK * 3 // 4,), torch.float32, seed=2)
    assert case.tier.put("exact", exact)
    assert_bit_exact(case.tier.get("exact"), exact)


def test_empty_dimension_round_trips(case: TierCase) -> None:
    tensor = torch.empty((0, 16), dtype=torch.bfloat16)
    assert case.tier.put("empty", tensor)
    assert_bit_exact(case.tier.get("empty"), tensor)


def test_contains_and_delete(case: TierCase) -> None:
    tier = case.tier
    small, large = random_tensor((8, 8), torch.float32, 3), big(4)
    tier.put("small", small)
    tier.put("large", large)
    assert tier.contains("small") and tier.contains("large")
    assert tier.contains_many(["small", "large", "none"]) == {
        "small": True,
        "large": True,
        "none": False,
    }
    tier.delete("large")
    assert tier.get("large") is None
    assert not tier.contains("large")
    assert_bit_exact(tier.get("small"), small)  # deleting one key leaves the others
    tier.delete("small")
    assert tier.get("small") is None and not tier.contains("small")


def test_get_many_keeps_each_keys_own_value(case: TierCase) -> None:
    """Hits and misses interleaved, small and chunked entries with different chunk counts:
    every key gets its own tensor (regression: a later payload in a missing key's slot)."""
    tier = case.tier
    stored = {
        "a-big5": big(10),  # 5 chunks
        "c-small": random_tensor((16, 4), torch.float16, 11),
        "e-big2": big(12, rows=100),  # 2 chunks
        "g-tiny": random_tensor((1,), torch.int64, 13),
        "i-big3": big(14, rows=150),  # 3 chunks
    }
    for key, tensor in stored.items():
        assert tier.put(key, tensor)
    query = ["m-miss0", "a-big5", "b-miss", "c-small", "d-miss", "e-big2", "f-miss"]
    query += ["g-tiny", "h-miss", "i-big3", "a-big5", "z-miss"]
    got = tier.get_many(query)
    assert set(got) == set(query)
    for key in query:
        if key in stored:
            assert_bit_exact(got[key], stored[key])
        else:
            assert got[key] is None, f"{key} should miss"
    # a batch of misses only, then hits only
    assert tier.get_many(["x", "y"]) == {"x": None, "y": None}
    only_hits = tier.get_many(["i-big3", "c-small"])
    assert_bit_exact(only_hits["i-big3"], stored["i-big3"])
    assert_bit_exact(only_hits["c-small"], stored["c-small"])


def test_overwrite_serves_the_newest_value(case: TierCase) -> None:
    tier = case.tier
    versions = [
        big(20),  # chunked
        random_tensor((4, 4), torch.float32, 21),  # small, other dtype and shape
        big(22, rows=200),  # chunked again, fewer chunks than the first
        big(23),  # same shape as the first, other bytes
    ]
    for version in versions:
        assert tier.put("k", version)
        assert_bit_exact(tier.get("k"), version)
        assert_bit_exact(tier.get_many(["k"])["k"], version)


# -- local tiers only ------------------------------------------------------------------------


def test_refused_overwrite_never_serves_the_old_value(local_case: TierCase) -> None:
    tier = local_case.tier
    tier.put("k", random_tensor((16,), torch.float32, 30))
    too_big = torch.zeros(LOCAL_CAPACITY // 4 + 1, dtype=torch.float32)
    assert tier.put("k", too_big) is False
    assert tier.get("k") is None
    assert tier.stats()["bytes"] == 0


def test_byte_budget_is_never_exceeded(local_case: TierCase) -> None:
    capacity = 64 * 1024
    if isinstance(local_case.tier, DeviceTier):
        tier: Tier = DeviceTier(capacity)
    else:
        tier = HostTier(capacity, Transfer(torch.device("cpu")))
    rng = random.Random(7)
    live: dict[str, torch.Tensor] = {}
    for step in range(400):
        key = f"k{rng.randrange(12)}"
        if rng.random() < 0.15:
            tier.delete(key)
            live.pop(key, None)
            continue
        numel = rng.choice([0, 1, rng.randrange(1, 4096), rng.randrange(4096, 20000)])
        tensor = torch.full((numel,), float(step), dtype=torch.float32)
        stored = tier.put(key, tensor)
        assert stored == (numel * 4 <= capacity)
        live.pop(key, None)
        if stored:
            live[key] = tensor
        stats = tier.stats()
        assert stats["bytes"] <= capacity
        # accounting: the byte count is exactly what the present entries hold
        present = {k: tier.get(k) for k in list(live)}
        for k, t in present.items():
            if t is None:
                live.pop(k)  # evicted
            else:
                assert torch.equal(t, live[k])
        assert stats["bytes"] == sum(t.numel() * 4 for t in live.values())
        assert stats["entries"] == len(live)
    assert tier.stats()["evictions"] > 0
    assert tier.stats()["rejected_too_large"] > 0


def test_device_tier_spills_what_it_evicts_in_lru_order() -> None:
    spilled: list[tuple[str, torch.Tensor]] = []
    tier = DeviceTier(3 * 4096, on_evict=lambda k, t: spilled.append((k, t)))
    tensors = {f"k{i}": torch.full((1024,), float(i)) for i in range(5)}
    for key in ("k0", "k1", "k2"):
        assert tier.put(key, tensors[key])
    assert spilled == []
    tier.get("k0")  # k1 is now the least recently used
    tier.put("k3", tensors["k3"])
    assert [k for k, _ in spilled] == ["k1"]
    # the evicted tensor itself: held by reference, no copy on the way in or out
    assert spilled[0][1].data_ptr() == tensors["k1"].data_ptr()
    assert_bit_exact(spilled[0][1], tensors["k1"])
    tier.put("k0", torch.full((1024,), 9.0))  # a replacement is not an eviction
    assert [k for k, _ in spilled] == ["k1"]
    tier.put("k4", torch.full((2048,), 4.0))  # needs two slots: k2 then k3
    assert [k for k, _ in spilled] == ["k1", "k2", "k3"]
    assert_bit_exact(spilled[1][1], tensors["k2"])
    assert_bit_exact(spilled[2][1], tensors["k3"])
    assert tier.get("k1") is None and tier.get("k2") is None
    assert tier.stats()["evictions"] == 3


def test_device_tier_refuses_without_spilling_when_too_large() -> None:
    spilled: list[tuple[str, torch.Tensor]] = []
    tier = DeviceTier(4096, on_evict=lambda k, t: spilled.append((k, t)))
    tier.put("a", torch.zeros(512))
    assert tier.put("huge", torch.zeros(2048)) is False
    assert spilled == []
    assert tier.contains("a")


@pytest.mark.parametrize("view_kind", ["slice", "transpose", "column"])
def test_views_are_compacted_so_the_budget_counts_real_bytes(
    local_case: TierCase, view_kind: str
) -> None:
    base = torch.randn(512, 512)  # 1 MiB of storage
    if view_kind == "slice":
        view = base[100:104]  # contiguous view into the big storage
    elif view_kind == "transpose":
        view = base[:8, :16].t()
    else:
        view = base[:, 3]
    want_bytes = view.numel() * view.element_size()
    expected = view.clone()
    tier = local_case.tier
    assert tier.put("v", view)
    got = tier.get("v")
    assert_bit_exact(got, expected)
    assert got is not None
    assert got.untyped_storage().nbytes() == want_bytes  # the 1 MiB base is not kept alive
    assert got.is_contiguous()
    assert tier.stats()["bytes"] == want_bytes
    base.fill_(0)  # the stored copy does not alias the caller's buffer
    assert_bit_exact(tier.get("v"), expected)


def test_disabled_local_tier_declines_everything() -> None:
    for tier in (DeviceTier(0), HostTier(0, Transfer(torch.device("cpu")))):
        assert tier.put("a", torch.zeros(1)) is False
        assert tier.get("a") is None
        assert tier.stats()["bytes"] == 0


# -- the real server sees what fakeredis sees ------------------------------------------------


@pytest.mark.redis
def test_real_redis_holds_the_chunked_layout(redis_url: str) -> None:
    client = make_client(CacheConfig(redis_url=redis_url))
    try:
        tier = _redis_tier(client)
        tier.put("x", big(40))
        head = tier.keys.head("x")
        raw = redis.Redis.from_url(redis_url)
        keys = sorted(k.decode() for k in raw.keys("*"))
        write_id = read_header(raw.get(head) or b"").write_id
        raw.close()
        assert keys == sorted([head, *KeyBuilder.chunks(head, write_id, 5)])
    finally:
        client.close()
