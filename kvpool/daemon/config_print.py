"""``kvpool serve --print-config``: the effective daemon config as TOML that ``--config``
reads back, every option in its table with a comment saying where its value came from
(default, file, env, flag) and what it does. With nothing set, this is the example config
(docs/kvpool.example.toml; tests/unit/test_config_print.py keeps the two equal)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Mapping
from typing import Any

from kvpool.core.config import DaemonConfig
from kvpool.daemon.config_loader import OPTIONS, Option, default_help

HEADER = """\
# kvpool daemon configuration (kvpool serve --config FILE.toml).
# Every option, with its effective value; each key is its flag's name with underscores and
# its environment variable is KVPOOL_ + the same name in capitals (--host-name, KVPOOL_HOST_NAME,
# [cluster] host_name). Precedence: flag > environment > this file > default.
# Sizes are bytes here; the file also accepts strings such as "512MiB" or "2GiB".
"""

#: the tables, in the order they are printed
SECTIONS = ("", "store", "tiers", "cluster")


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string for every value an option takes


def _value(config: DaemonConfig, opt: Option) -> Any:
    obj: Any = config
    for part in opt.path.split("."):
        obj = getattr(obj, part)
    return obj


def render_config(config: DaemonConfig, sources: Mapping[str, str]) -> str:
    out = [HEADER]
    for section in SECTIONS:
        options = [opt for opt in OPTIONS if opt.section == section]
        if section:
            out.append(f"\n[{section}]")
        for opt in options:
            out.append(f"# {opt.flag} / {opt.env} ({sources.get(opt.path, 'default')})")
            text = f"{opt.help} {default_help(opt)}"
            out.extend(f"#   {line}" for line in textwrap.wrap(text, width=94, break_on_hyphens=False))
            out.append(f"{opt.key.rpartition('.')[2]} = {toml_value(_value(config, opt))}")
    return "\n".join(out) + "\n"
