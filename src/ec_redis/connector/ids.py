"""Which item ids name content: vLLM's request-scoped ids and the settings that produce them.

With ``mm_processor_cache_gb == 0`` **and** prefix caching off, vLLM 0.32/0.33 skips content
hashing and names every item without a client uuid ``renderer<rank>-mm-<counter>-<modality>-<i>``
(``vllm/renderers/base.py``, ``_process_mm_uuids``). The counter restarts with the process and
differs between instances, so after a restart, or on another instance, a *different* image
gets the same id. Worse, a request that also carries ``mm_processor_kwargs`` gets a hash of
that counter id, which looks like any content hash. Neither can be told apart from content
reliably, so ec_redis refuses that configuration at start, unless the operator declares that
every item carries a client uuid (``trust_client_uuids``); even then an id of the counter
form is never looked up or stored.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from ec_redis.errors import ConfigError

# An optional tower-LoRA prefix "<lora_name>:" (vllm/v1/engine/input_processor.py), then the
# renderer's counter id.
_COUNTER_ID = re.compile(r"^(?:[^:]*:)?renderer\d+-mm-\d+-[A-Za-z_]+-\d+$")


def is_request_scoped(identifier: str) -> bool:
    """Whether ``identifier`` has the form of vLLM's per-process counter ids."""
    return _COUNTER_ID.match(identifier) is not None


def names_items_by_counter(vllm_config: Any) -> bool:
    """Whether this vLLM configuration names items without a client uuid by a counter."""
    model_config = getattr(vllm_config, "model_config", None)
    mm_config = getattr(model_config, "multimodal_config", None)
    cache_config = getattr(vllm_config, "cache_config", None)
    if mm_config is None or cache_config is None:
        return False
    cache_gb = getattr(mm_config, "mm_processor_cache_gb", None)
    prefix_caching = getattr(cache_config, "enable_prefix_caching", None)
    if not isinstance(cache_gb, (int, float)) or not isinstance(prefix_caching, bool):
        return False  # not a real VllmConfig (e.g. a test double): nothing to detect
    return cache_gb == 0 and not prefix_caching


def check_item_ids(vllm_config: Any, trust_client_uuids: bool) -> None:
    """Refuse to start where item ids would not name content (see the module docstring)."""
    if trust_client_uuids or not names_items_by_counter(vllm_config):
        return
    raise ConfigError(
        "ec_redis: with mm_processor_cache_gb = 0 and enable_prefix_caching = false, vLLM "
        "names multimodal items that have no client uuid by a per-process counter "
        "(renderer<rank>-mm-<n>-...), so a cache would serve one image's embedding for "
        "another after a restart or on another instance. Fix one of: "
        "--mm-processor-cache-gb 4 (any value > 0; vLLM then hashes the content), "
        "--enable-prefix-caching, or, when every multimodal item carries a client uuid "
        "(vLLM's EPD proxy sets one) and no request sends mm_processor_kwargs, "
        "ec_connector_extra_config {'trust_client_uuids': true}"
    )


# Starts every salted cache id, and no id a request may name unsalted: a client uuid that
# starts with it is never cached, so no request can name another tenant's entries.
SALT_MARK = "\x00"


def cache_id(identifier: str, cache_salt: str | None) -> str | None:
    """What an item is cached under: vLLM's identifier for a request without a
    ``cache_salt``; for one with a salt, the identifier in that salt's own namespace (every
    tier, Redis key and announcement), so requests with other salts, or none, never read its
    entries. ``None``: never cached (a request-scoped id, or one starting with SALT_MARK)."""
    if identifier.startswith(SALT_MARK) or is_request_scoped(identifier):
        return None
    if not cache_salt:
        return identifier
    digest = hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{SALT_MARK}{digest}{SALT_MARK}{identifier}"


def request_salt(request: Any) -> str | None:
    """vLLM's per-request ``cache_salt`` (its tenant-isolation key for prefix caching)."""
    salt = getattr(request, "cache_salt", None)
    return salt if isinstance(salt, str) and salt else None
