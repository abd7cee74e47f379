"""The sampling defaults a served model brings: what a request that leaves ``temperature``,
``top_p``, ``top_k``, ``min_p`` or ``repetition_penalty`` out is sampled with.

Design origin: vLLM's ``--generation-config auto``, which reads the model folder's
``generation_config.json`` and uses the sampling fields its authors set there as the defaults of
every request (vLLM 0.32's log: "Default vLLM sampling parameters have been overridden by the
model's `generation_config.json`"). Only the fields the file sets
count; ``do_sample`` and ``max_new_tokens`` are not applied (as vLLM, the former; the
latter would cap a chat reply below the context window the OpenAI API promises). With
``model.generation_config: none``, or a folder without the file, OpenAI's defaults hold:
temperature 1, top_p 1, no top_k, no min_p, no repetition penalty.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.errors import ConfigError
from pdserve.protocol import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY

FILE = "generation_config.json"

_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (1e-9, 1.0),
    "top_k": (-1, 1 << 31),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
}
"""The fields taken from the file and the ranges a request may send them in (the request
schema's, :mod:`pdserve.server.chat.schemas`; ``top_k`` 0 or below means off)."""


@dataclass(frozen=True)
class SamplingDefaults:
    """A request's sampling when it leaves a field out. ``top_k`` 0: off; ``source``: where the
    values come from (logged at start-up)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    source: str = "OpenAI's defaults"

    @classmethod
    def from_model(cls, model_path: Path, mode: str = "auto") -> SamplingDefaults:
        """The defaults of the model folder ``model_path`` under ``mode`` (``auto``: its
        ``generation_config.json``'s sampling fields; ``none``: OpenAI's). Raises ConfigError
        for a file that is not JSON, or a field of the wrong type or out of range."""
        file = Path(model_path) / FILE
        if mode == "none" or not file.is_file():
            return cls()
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{file} is not readable JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{file} must hold a JSON object")
        found: dict[str, float | int] = {}
        for name, (low, high) in _RANGES.items():
            value = data.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{file}: {name} must be a number, got {value!r}")
            if name == "top_k":
                if not isinstance(value, int):
                    raise ConfigError(f"{file}: top_k must be an integer, got {value!r}")
                found[name] = max(value, 0)
                continue
            if not low <= value <= high:
                raise ConfigError(f"{file}: {name} {value} lies outside [{low}, {high}]")
            found[name] = float(value)
        if not found:
            return cls()
        return cls(**found, source=str(file))  # type: ignore[arg-type]

    def changed(self) -> dict[str, float | int]:
        """The fields that differ from OpenAI's defaults (empty: none)."""
        base = asdict(SamplingDefaults())
        return {k: v for k, v in asdict(self).items() if k != "source" and v != base[k]}

    def describe(self) -> str:
        """One log line's worth: the changed fields and their source."""
        changed = self.changed()
        if not changed:
            return "sampling defaults: OpenAI's (temperature 1, top_p 1)"
        fields = ", ".join(f"{k} {v}" for k, v in changed.items())
        return (
            f"sampling defaults for requests that leave them out: {fields} (from {self.source}; "
            "--generation-config none: OpenAI's)"
        )


OPENAI_DEFAULTS = SamplingDefaults()
"""OpenAI's defaults: what a request is sampled with when the model brings none."""
