"""The documentation cannot drift from the code: the README's settings and routes tables, and the
header every Lua script opens with (purpose, From-states, Input, Output, Events)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from service.http.routes import ROUTES
from service.scripts import expand, header_names, lua_dir
from service.settings import setting_docs

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LUA_SCRIPTS = sorted(p.stem for p in (ROOT / "lua").glob("*.lua"))
_CELL_SPLIT = re.compile(r"(?<!\\)\|")
_NOTE = r"(?: \([^)\n]*\))?"  # a section title may carry a note: "Events (only when ...):"


def table_rows(markdown: str, header: list[str]) -> list[list[str]]:
    """The body rows of the first table whose header row is exactly `header`, as stripped cells."""
    lines = markdown.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and cells(line) == header:
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(cells(row))
            return rows
    raise AssertionError(f"README.md has no table with the header {header}")


def cells(line: str) -> list[str]:
    parts = _CELL_SPLIT.split(line.strip())
    return [p.strip().replace("\\|", "|") for p in parts[1:-1]]


def unquote(cell: str) -> str:
    """`x` -> x; an empty cell stays empty."""
    if len(cell) >= 2 and cell.startswith("`") and cell.endswith("`"):
        return cell[1:-1]
    return cell


def test_readme_settings_table_is_setting_docs_exactly() -> None:
    rows = table_rows(README.read_text(), ["Variable", "Default", "Meaning"])
    documented = [(unquote(variable), unquote(default), meaning) for variable, default, meaning in rows]
    assert documented == [tuple(row) for row in setting_docs()]


def test_readme_routes_table_lists_every_registered_route() -> None:
    rows = table_rows(README.read_text(), ["Method", "Path", "Who", "Reply"])
    documented = [(unquote(row[0]), unquote(row[1])) for row in rows]
    assert len(documented) == len(set(documented)), "a route is listed twice"
    registered = {(route.method, route.path) for route in ROUTES}
    assert registered - set(documented) == set(), "routes missing from the README"
    assert set(documented) - registered == set(), "README rows for routes that do not exist"


def test_every_lua_script_is_checked() -> None:
    assert LUA_SCRIPTS, "no lua/*.lua found"
    assert {"create", "answer", "cancel", "expire"} <= set(LUA_SCRIPTS)


def header_of(name: str) -> str:
    text = (lua_dir() / f"{name}.lua").read_text()
    match = re.search(r"--\[\[\n(.*?)\n\]\]", text, re.DOTALL)
    assert match, f"{name}.lua does not open with a --[[ ... ]] header"
    shebang, _, rest = text.partition("\n")
    assert re.fullmatch(r"#!lua( flags=[a-z,-]+)?", shebang), f"{name}.lua: the first line must be #!lua"
    assert rest.startswith("--[["), f"{name}.lua: the header must come first (after #!lua)"
    return match.group(1)


def section(header: str, title: str) -> str:
    """The text of one `Title:` section, up to the next section title at the same indent."""
    match = re.search(rf"^  {title}{_NOTE}:(.*?)(?=^  [A-Z][A-Za-z-]*{_NOTE}:|\Z)", header, re.DOTALL | re.M)
    assert match, f"no '{title}:' section"
    return match.group(1)


@pytest.mark.parametrize("name", LUA_SCRIPTS)
def test_lua_header_documents_purpose_states_input_output_events(name: str) -> None:
    header = header_of(name)
    first = header.strip().splitlines()[0]
    assert re.match(rf"^{name}: \S.{{10,}}", first), f"{name}.lua: first line must be '{name}: purpose'"
    titles = re.findall(rf"^  ([A-Z][A-Za-z-]*){_NOTE}:", header, re.MULTILINE)
    assert titles == ["From-states", "Input", "Output", "Events"], f"{name}.lua sections: {titles}"
    for title in ("From-states", "Output", "Events"):
        assert section(header, title).strip(), f"{name}.lua: '{title}:' is empty"
    inputs = section(header, "Input")
    for kind in ("KEYS", "ARGV"):
        numbered = [int(n) for n in re.findall(rf"^\s+{kind}\[(\d+)\]\s+\S", inputs, re.MULTILINE)]
        assert numbered == list(range(1, len(numbered) + 1)), f"{name}.lua {kind}: {numbered}"
        assert len(header_names(header, kind)) == len(numbered)


@pytest.mark.parametrize("name", LUA_SCRIPTS)
def test_every_key_and_argument_the_script_uses_is_in_its_header(name: str) -> None:
    header = header_of(name)
    body = expand(name).split("]]", 1)[1]  # the script with its includes, without its header
    for kind in ("KEYS", "ARGV"):
        documented = len(header_names(header, kind))
        used = {int(n) for n in re.findall(rf"{kind}\[(\d+)\]", body)}
        assert used <= set(range(1, documented + 1)), f"{name}.lua uses {kind} {sorted(used)}"
