"""Redis key layout: model/tenant isolation, injective escaping, cluster hash tags."""

from __future__ import annotations

import hashlib
import re
from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ec_redis.keys import MAX_ITEM_CHARS, KeyBuilder, ModelIdentity, escape_item

KEY_RE = re.compile(r"^[A-Za-z0-9._%:{}-]+$")
QWEN = ModelIdentity("Qwen/Qwen2.5-VL-7B-Instruct", "main", "bfloat16", 3584)


def hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes to pick a slot (CLUSTER KEYSLOT rules)."""
    start = key.find("{")
    if start == -1:
        return key
    end = key.find("}", start + 1)
    if end == -1 or end == start + 1:
        return key
    return key[start + 1 : end]


def builder(identity: ModelIdentity = QWEN, salt: str = "", namespace: str = "ecr") -> KeyBuilder:
    return KeyBuilder(namespace, identity, salt)


def test_pinned_key_is_stable_across_processes_and_releases() -> None:
    head = KeyBuilder("ecr", QWEN, "tenant-42").head("img-1")
    assert head == "ecr:v2:{4df69a4bdca0c4c5da1606cb63d6d796.img-1}"


def test_same_identity_gives_the_same_key() -> None:
    same = ModelIdentity("Qwen/Qwen2.5-VL-7B-Instruct", "main", "bfloat16", 3584)
    assert builder(same, "s").head("item") == builder(QWEN, "s").head("item")
    assert QWEN.fingerprint("s") == same.fingerprint("s")
    assert re.fullmatch(r"[0-9a-f]{32}", QWEN.fingerprint())


@pytest.mark.parametrize(
    "other",
    [
        ModelIdentity("Qwen/Qwen2.5-VL-3B-Instruct", "main", "bfloat16", 3584),
        ModelIdentity("Qwen/Qwen2.5-VL-7B-Instruct", "v2", "bfloat16", 3584),
        ModelIdentity("Qwen/Qwen2.5-VL-7B-Instruct", "main", "float16", 3584),
        ModelIdentity("Qwen/Qwen2.5-VL-7B-Instruct", "main", "bfloat16", 2048),
        ModelIdentity("Qwen/Qwen2.5-VL-7B-Instruct", "main", "bfloat16"),
        ModelIdentity("Qwen/Qwen2.5-VL-7B-Instruct", "main", "bfloat16", 3584, "files:0a1b"),
    ],
    ids=["name", "revision", "dtype", "width", "no-width", "weights"],
)
def test_any_identity_change_gives_another_key(other: ModelIdentity) -> None:
    assert builder(other).head("item-1") != builder(QWEN).head("item-1")
    assert hash_tag(builder(other).head("item-1")) != hash_tag(builder(QWEN).head("item-1"))
    assert builder(other).pattern() != builder(QWEN).pattern()


def test_tenant_salt_separates_tenants() -> None:
    heads = {builder(salt=salt).head("item-1") for salt in ("", "a", "b", "tenant-42")}
    assert len(heads) == 4


def test_identity_fields_cannot_be_shifted_into_each_other() -> None:
    # A naive "name|revision" join would make these two identities collide.
    first = ModelIdentity("model|main", "")
    second = ModelIdentity("model", "main")
    assert first.fingerprint() != second.fingerprint()
    assert ModelIdentity("m", "r").fingerprint("x") != ModelIdentity("m", "rx").fingerprint()
    # nor can the weights be shifted into the tenant salt
    assert ModelIdentity("m", weights="w").fingerprint() != ModelIdentity("m").fingerprint("w")


def test_namespace_and_format_version_prefix_the_key() -> None:
    head = builder(namespace="prod").head("a")
    assert head.startswith("prod:v2:{")
    assert builder(namespace="prod").pattern() == f"prod:v2:{{{QWEN.fingerprint()}.*"


@pytest.mark.parametrize(
    "item",
    [
        "a:b",
        "{tag}",
        "}{",
        "with space",
        "glob*?[x]",
        "100%",
        "line\nbreak",
        "naïve-图像-🙂",
        "path/to/image.png",
        "\\back\\slash",
        "\x00nul",
        "\ud800",  # a lone surrogate still escapes (surrogatepass)
    ],
)
def test_escaped_ids_keep_the_key_structure(item: str) -> None:
    kb = builder()
    head = kb.head(item)
    assert KEY_RE.fullmatch(head), head
    assert head.count("{") == 1 and head.count("}") == 1
    assert hash_tag(head) == f"{kb.fingerprint}.{escape_item(item)}"
    assert head.startswith(kb.prefix) and head.endswith("}")
    for write_id, index in ((1, 1), (0xDEADBEEF, 2), (2**64 - 1, 17)):
        chunk = KeyBuilder.chunk(head, write_id, index)
        assert chunk == f"{head}:{write_id:016x}:c{index}"
        assert KEY_RE.fullmatch(chunk)
        assert hash_tag(chunk) == hash_tag(head)
    assert KeyBuilder.chunks(head, 5, 3) == [KeyBuilder.chunk(head, 5, i) for i in (1, 2, 3)]
    # two writes of one entry never share a chunk key
    assert not set(KeyBuilder.chunks(head, 5, 9)) & set(KeyBuilder.chunks(head, 6, 9))


def test_escape_examples() -> None:
    assert escape_item("img-1.png_x") == "img-1.png_x"
    assert escape_item("a:b") == "a%3Ab"
    assert escape_item("%") == "%25"
    assert escape_item("{}") == "%7B%7D"
    assert escape_item("é") == "%C3%A9"
    assert escape_item(" ") == "%20"


def test_pattern_matches_heads_and_chunks_of_this_model_only() -> None:
    kb = builder()
    glob = re.compile(re.escape(kb.pattern()).replace(r"\*", ".*") + "$")
    head = kb.head("x")
    assert glob.match(head) and glob.match(KeyBuilder.chunk(head, 7, 3))
    assert not glob.match(builder(salt="other").head("x"))


def test_long_ids_are_replaced_by_their_full_sha256() -> None:
    item = "x" * (MAX_ITEM_CHARS + 1)
    digest = hashlib.sha256(item.encode()).hexdigest()
    assert escape_item(item) == "%h" + digest
    assert len(escape_item(item)) == 2 + 64
    assert escape_item("x" * MAX_ITEM_CHARS) == "x" * MAX_ITEM_CHARS  # at the limit: kept
    # Escaping counts: 86 colons escape to 258 characters, over the limit.
    colons = ":" * 86
    assert escape_item(colons) == "%h" + hashlib.sha256(colons.encode()).hexdigest()
    assert escape_item(":" * 85) == "%3A" * 85
    head = builder().head(item)
    assert KEY_RE.fullmatch(head) and head.count("{") == 1


def test_long_ids_sharing_a_prefix_stay_distinct() -> None:
    base = "y" * 1000
    assert escape_item(base + "a") != escape_item(base + "b")


def test_escaped_ids_never_take_the_hashed_form() -> None:
    # '%' is only ever written before two uppercase hex digits; 'h' is not one of them.
    for item in ("h " + "a" * 62, "%h" + "0" * 64, "%" * 10, "h%20"):
        assert not escape_item(item).startswith("%h")


def test_literal_hashed_form_cannot_collide_with_a_long_id() -> None:
    long_id = "z" * 500
    hashed = escape_item(long_id)
    assert hashed.startswith("%h")
    assert escape_item(hashed) != hashed  # its '%' is escaped
    assert escape_item(hashed) == "%25h" + hashed[2:]
    assert builder().head(hashed) != builder().head(long_id)


@pytest.mark.parametrize("bad", ["", None, 7, b"bytes"])
def test_empty_or_non_string_id_raises(bad: object) -> None:
    with pytest.raises(ValueError):
        escape_item(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        builder().head(bad)  # type: ignore[arg-type]


ids = st.text(min_size=1, max_size=120) | st.text(
    alphabet=st.sampled_from("ab:%{}h 2"), min_size=1, max_size=300
)


@settings(max_examples=400, deadline=None, database=None)
@given(ids, ids)
def test_distinct_ids_give_distinct_heads(first: str, second: str) -> None:
    kb = builder()
    if first == second:
        assert kb.head(first) == kb.head(second)
    else:
        assert kb.head(first) != kb.head(second)


@settings(max_examples=300, deadline=None, database=None)
@given(ids)
def test_every_id_yields_a_well_formed_key(item: str) -> None:
    head = builder().head(item)
    assert KEY_RE.fullmatch(head)
    assert head.count("{") == 1 and head.count("}") == 1
    assert len(escape_item(item)) <= MAX_ITEM_CHARS
    assert hash_tag(KeyBuilder.chunk(head, 2**63, 1)) == hash_tag(head)


@settings(max_examples=300, deadline=None, database=None)
@given(st.text(min_size=1, max_size=80))
def test_escaping_is_reversible_so_it_is_injective(item: str) -> None:
    escaped = escape_item(item)
    if not escaped.startswith("%h"):
        assert unquote(escaped, errors="surrogatepass") == item
