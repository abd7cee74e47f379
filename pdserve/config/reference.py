"""The configuration reference (docs/configuration.md), generated from the declarations.

Every setting is declared once, in :mod:`pdserve.config.settings` (its type, default, range,
description, flag and environment variable); this module renders those declarations as one
Markdown page, ``pdserve config reference`` prints it, and a unit test keeps the committed
page equal to it, so no section or field can go missing from the docs.
"""

from __future__ import annotations

from typing import Any

from pdserve.config.settings import ENV_PREFIX, PdserveConfig, Setting, settings

HEADER = f"""# Configuration reference

Generated from the declarations in `pdserve/config/settings.py` by `pdserve config reference`
(`tests/unit/test_config_reference.py` keeps this page equal to its output): do not edit it by
hand. One YAML file configures every role (`--config FILE`); each setting resolves as
command-line flag > environment variable > file > default. Environment variables are
`{ENV_PREFIX}<SECTION>__<FIELD>` (an empty value means null). `pdserve config schema` prints the
JSON schema, `pdserve config validate FILE` checks a file and `pdserve config show` prints the
effective settings and where each came from. The commands that take a flag are listed in
`pdserve <command> --help`.
"""


def _shown(value: Any) -> str:
    """A default as YAML would spell it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(s: Setting) -> str:
    flag = s.flag_name()
    env = s.env + (f" or {s.env_alias.name}" if s.env_alias else "")
    secret = "SecretStr" in str(s.info.annotation)
    default = "(secret)" if secret and s.default is not None else _shown(s.default)
    cells = (
        f"`{s.field}`",
        f"`{flag}`" if flag else "(file, env)",
        f"`{env}`",
        f"`{_cell(default)}`",
        _cell(s.info.description or ""),
    )
    return "| " + " | ".join(cells) + " |"


def reference_markdown() -> str:
    """The whole reference page (Markdown, ending in a newline)."""
    out = [HEADER]
    current = None
    for s in settings():
        if s.section != current:
            current = s.section
            doc = (PdserveConfig.model_fields[s.section].annotation.__doc__ or "").strip()
            out += ["", f"## `{s.section}`", ""]
            if doc:
                out += [" ".join(doc.split()), ""]
            out += [
                "| key | flag | environment | default | description |",
                "|---|---|---|---|---|",
            ]
        out.append(_row(s))
    return "\n".join(out).rstrip() + "\n"
