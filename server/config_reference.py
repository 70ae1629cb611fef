"""docs/configuration.md's tables of keys, written from the one place each key is declared: OPTIONS
(server/options.py) for the server and engine keys, SpeculativeConfig's fields (engine/config.py) for the
speculative ones. tests/test_config_reference.py checks that the file holds exactly these tables.

    python -m server.config_reference                          # print the tables
    python -m server.config_reference docs/configuration.md    # rewrite them in place
"""
from __future__ import annotations

import sys
from typing import Any

from engine.config import speculative_fields
from server.options import OPTIONS, PARSER_TYPES, SERVER_KEYS, YAML_ALIASES, Option

HEADER = "| key | type | default | what it does and constraints |\n|---|---|---|---|"
METAVAR_TYPES = {"PATH": "path", "SECONDS": "float, seconds"}


def _row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(rows: list[str]) -> str:
    return "\n".join([HEADER, *rows])


def option_type(option: Option) -> str:
    if option.type:
        return option.type
    if option.choices:
        return " \\| ".join(f"`{choice}`" for choice in option.choices)
    return METAVAR_TYPES.get(option.metavar or "") or PARSER_TYPES[option.parse]


def _option_row(option: Option) -> str:
    aliases = [alias for alias, key in YAML_ALIASES.items() if key == option.key]
    key = f"`{option.key}`" + "".join(f" (YAML alias `{alias}`)" for alias in aliases)
    return _row(key, option_type(option), option.default, option.doc or option.help)


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _speculative_row(name: str, field) -> str:
    meta = field.metadata
    return _row(f"`{name}`", meta["type"], meta["default"] or _shown(field.default), meta["doc"])


def reference_tables() -> dict[str, str]:
    """Each section heading of docs/configuration.md with the table that follows it."""
    engine = [o for o in OPTIONS if o.key not in SERVER_KEYS and o.key != "speculative"]
    return {"## Server keys": _table([_option_row(o) for o in OPTIONS if o.key in SERVER_KEYS]),
            "## Engine keys": _table([_option_row(o) for o in engine]),
            "## Speculative keys": _table([_speculative_row(name, f) for name, f in speculative_fields()])}


def rewrite(text: str) -> str:
    """The document with the first table under each heading replaced by the generated one."""
    lines = text.split("\n")
    for heading, table in reference_tables().items():
        start = lines.index(heading)
        while not lines[start].startswith("|"):
            start += 1
        end = start
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        lines[start:end] = table.split("\n")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if not argv:
        print("\n\n".join(f"{heading}\n\n{table}" for heading, table in reference_tables().items()))
        return
    with open(argv[0]) as f:
        text = f.read()
    with open(argv[0], "w") as f:
        f.write(rewrite(text))


if __name__ == "__main__":
    main(sys.argv[1:])
