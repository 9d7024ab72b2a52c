"""base.jsonsafety's walk: the place it names, the depth it allows, the text it refuses."""

import pytest

from base.jsonsafety import UnsafeJSON, check, loads


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"messages": [{"role": "user", "content": "ok \ud800"}]}, "messages[0].content"),
        ({"a": {"b": ["x", "y", "\udfff"]}}, "a.b[2]"),
        (["ok", ["fine", "\ud83d"]], "[1][1]"),
    ],
)
def test_a_lone_surrogate_is_named_where_it_is(body, path):
    with pytest.raises(UnsafeJSON) as caught:
        check(body, depth=64)
    assert caught.value.path == path
    assert f"'{path}'" in caught.value.message


def test_a_key_with_a_lone_surrogate_names_its_object():
    with pytest.raises(UnsafeJSON) as caught:
        check({"outer": {"k\ud800": 1}}, depth=64)
    assert caught.value.path == "outer"


def test_a_top_level_string_is_checked_too():
    with pytest.raises(UnsafeJSON):
        check("\ud800", depth=64)
    check("plain", depth=64)


def test_valid_text_beyond_ascii_and_long_lists_of_scalars_pass():
    check({"text": "Grüße 😀 中文", "hashes": ["0f" * 8] * 5000, "n": [1, 2.5, None, True]})


def test_depth_counts_containers_only():
    nested: list = []
    inner = nested
    for _ in range(3):  # 4 levels of lists
        inner.append([])
        inner = inner[0]
    inner.append("leaf")  # a scalar adds no level
    check(nested, depth=4)
    with pytest.raises(UnsafeJSON, match="deeper than 3"):
        check(nested, depth=3)


def test_loads_refuses_what_check_refuses():
    with pytest.raises(UnsafeJSON):
        loads(b'{"a": "\\ud800"}')
    assert loads(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}
