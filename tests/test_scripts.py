"""The Lua loader and the header contract: includes, cycles, shebang, key and argument order."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from service.keys import Keys
from service.scripts import SCRIPT_NAMES, LuaScript, expand, header_names, lua_dir
from service.settings import Settings
from service.store import QuestionStore


def write(tmp: Path, name: str, text: str) -> None:
    path = tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_include_is_inlined_once_even_when_named_twice(tmp_path: Path) -> None:
    write(tmp_path, "includes/a.lua", "local function a() end")
    write(tmp_path, "includes/b.lua", '--@include "a"\nlocal function b() end')
    write(tmp_path, "main.lua", '--@include "a"\n--@include "b"\nreturn 1')
    source = expand("main", tmp_path)
    assert source.count("local function a()") == 1
    assert source.index("function a") < source.index("function b") < source.index("return 1")


def test_include_cycle_is_refused_with_its_path(tmp_path: Path) -> None:
    write(tmp_path, "includes/a.lua", '--@include "b"')
    write(tmp_path, "includes/b.lua", '--@include "a"')
    write(tmp_path, "main.lua", '--@include "a"')
    with pytest.raises(ValueError, match="main -> a -> b -> a"):
        expand("main", tmp_path)


def test_missing_include_fails_loudly(tmp_path: Path) -> None:
    write(tmp_path, "main.lua", '--@include "nowhere"')
    with pytest.raises(FileNotFoundError):
        expand("main", tmp_path)


def test_sha_is_computed_over_the_expanded_text() -> None:
    script = LuaScript.load("answer")
    assert "--@include" not in script.source
    assert "local function finish" in script.source
    assert (
        hashlib.sha1(script.source.encode()).hexdigest()
        == hashlib.sha1(expand("answer").encode()).hexdigest()
    )


def test_shebang_is_kept_for_redis_and_stripped_for_fakeredis() -> None:
    assert LuaScript.load("create").source.startswith("#!lua")
    stripped = LuaScript.load("create", shebang=False).source
    assert not stripped.startswith("#!")
    assert stripped.splitlines()[0] == "--[["


def test_header_numbering_gaps_are_refused() -> None:
    with pytest.raises(ValueError, match="numbered"):
        header_names("    KEYS[1] a  (HASH)\n    KEYS[3] c  (HASH)\n", "KEYS")


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_every_script_names_keys_and_arguments_in_order(name: str) -> None:
    script = LuaScript.load(name)
    assert script.key_names, name
    assert script.arg_names, name
    assert len(set(script.key_names)) == len(script.key_names)
    assert len(set(script.arg_names)) == len(script.arg_names)


def test_keys_by_name_follow_the_header_order_and_allow_optional_tail() -> None:
    script = LuaScript.load("create")
    names = script.key_names
    named = {n: f"key:{i}" for i, n in enumerate(names)}
    assert script.keys(named) == [f"key:{i}" for i in range(len(names))]
    without_last = {n: k for n, k in named.items() if n != names[-1]}
    assert len(script.keys(without_last)) == len(names) - 1
    with pytest.raises(KeyError, match="misses a key"):
        script.keys({n: k for n, k in named.items() if n != names[0]})
    with pytest.raises(KeyError, match="takes no keys"):
        script.keys({**named, "bogus": "x"})


def test_arguments_must_be_exactly_the_header_names() -> None:
    script = LuaScript.load("expire")
    with pytest.raises(KeyError, match="missing"):
        script.args({"id": "x"})


def test_transition_wrappers_pass_every_header_key_in_one_slot() -> None:
    store = QuestionStore.__new__(QuestionStore)
    store.keys = Keys("qs")
    for name, named in (
        ("answer", store._tap_keys("3" + "a" * 24)),
        ("cancel", store._tap_keys("3" + "a" * 24)),
        ("expire", store._transition_keys("3" + "a" * 24)),
    ):
        script = LuaScript.load(name)
        assert set(named) == set(script.key_names), name
        keys = script.keys(named)
        assert {k.split("{")[1].split("}")[0] for k in keys} == {"b3"}


def test_lua_dir_holds_every_script() -> None:
    for name in SCRIPT_NAMES:
        assert (lua_dir() / f"{name}.lua").is_file()


def test_every_redis_call_takes_its_key_from_keys() -> None:
    """Directly, or through a key table (`k.question`) whose every entry is set from KEYS."""
    call = re.compile(r"redis\.call\('(\w+)'(?:,\s*([^,)]+))?")
    table_entry = re.compile(r"(?:\bk\.|[{,]\s*)(\w+)\s*=\s*([^,}\n]+)")
    for name in SCRIPT_NAMES:
        source = LuaScript.load(name).source
        code = "\n".join(line for line in source.split("]]", 1)[1].splitlines() if not line.startswith("--"))
        for command, first in call.findall(code):
            if command != "TIME":
                assert first.startswith(("KEYS[", "k.")), f"{name}.lua: {command} {first}"
        for entry, value in table_entry.findall(code):
            if entry in TABLE_KEYS:
                assert value.startswith("KEYS["), f"{name}.lua: k.{entry} = {value}"
        used = set(re.findall(r"\bk\.(\w+)", code))
        assert used <= TABLE_KEYS, f"{name}.lua: {used - TABLE_KEYS}"


TABLE_KEYS = {"question", "marker", "deadlines", "purge", "channel", "outbox", "stats"}


def test_settings_prefix_reaches_every_key() -> None:
    keys = Keys(Settings(key_prefix="zz").key_prefix)
    assert keys.for_question("0" * 25).question.startswith("zz:{b0}:")
    assert keys.principal("alice").startswith("zz:{dir}:")
