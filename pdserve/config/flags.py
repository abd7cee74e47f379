"""How a setting declares its command-line flag and a second environment variable: markers
attached to a field of :mod:`pdserve.config.settings` with ``Annotated[type, Flag(...)]`` and read by
:func:`pdserve.config.settings.settings`, which the CLI, the config loader and the generated reference
build on. Imports nothing of pdserve."""

from __future__ import annotations

from dataclasses import dataclass

OWN_SECTION = "{section}"
"""In :attr:`Flag.commands`: the subcommand named like the section (the worker roles)."""


@dataclass(frozen=True)
class Flag:
    """The command-line flag of a setting, attached with ``Annotated[type, Flag(...)]``.

    ``name`` is the flag (``--kv-cache-mb``; ``{section}`` is replaced by the section name),
    ``commands`` the subcommands that take it (:data:`OWN_SECTION`: the subcommand named like
    the section), ``sections`` limits a section class used for several sections (the worker
    roles) to some of them. A ``bool`` setting gets ``--name/--no-name``. The flag's help is
    the field's description plus its default, file key and environment variable.
    """

    name: str
    commands: tuple[str, ...]
    sections: tuple[str, ...] | None = None


@dataclass(frozen=True)
class EnvAlias:
    """A second environment variable for a setting, attached with ``Annotated[type,
    EnvAlias("PDSERVE_API_KEY")]``: a short name where a deployment convention expects one.
    ``PDSERVE_<SECTION>__<FIELD>`` outranks it when both are set."""

    name: str
