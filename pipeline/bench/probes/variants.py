"""Kernel tuning variants from the command line: "base" (the engine's KernelTuning) or FIELD=VALUE pairs
joined by commas, e.g. `rope_in_gemv=0,block_rows=16` or `rows_small_tile=64/16/128/4/5` (a tuple); the same
pairs for the tier controller's AdaptiveConfig."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

from pipeline.engine.adaptive import AdaptiveConfig
from pipeline.engine.kernels.tuning import DEFAULT_TUNING, KernelTuning

BASE = "base"
HELP = f'"{BASE}" or FIELD=VALUE[,FIELD=VALUE...] of KernelTuning (a tuple as 64/16/128/4/5)'
FieldValue = int | bool | float | str | tuple[int, ...]  # the types of KernelTuning's and AdaptiveConfig's fields
Config = TypeVar("Config", KernelTuning, AdaptiveConfig)


def parse_value(text: str, current: FieldValue) -> FieldValue:
    """A field's value in the type of its current one: 0/1 or false/true for flags, a/b/c for tuples."""
    if isinstance(current, bool):
        if text.lower() not in ("0", "1", "false", "true"):
            raise ValueError(f"{text!r}: a flag takes 0, 1, false or true")
        return text.lower() in ("1", "true")
    if isinstance(current, tuple):
        return tuple(int(part) for part in text.split("/"))
    return type(current)(text)


def parse_variant(variant: str, base: KernelTuning = DEFAULT_TUNING) -> KernelTuning:
    """The tuning a variant names (see the module's docstring); raises ValueError with the fields on a bad one."""
    return base if variant == BASE else parse_fields(variant, base)


def parse_fields(text: str, base: Config) -> Config:
    """`base` (a frozen dataclass) with the FIELD=VALUE pairs of `text` replaced; ValueError naming the fields
    on a bad pair."""
    fields = {f.name for f in dataclasses.fields(base)}
    changes: dict[str, Any] = {}  # each value of its field's type (parse_value), by the field's name
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in fields or not value:
            raise ValueError(f"{item!r}: write FIELD=VALUE with FIELD one of {', '.join(sorted(fields))}")
        changes[name] = parse_value(value, getattr(base, name))
    return dataclasses.replace(base, **changes)


def parse_variants(parser: argparse.ArgumentParser, names: list[str]) -> dict[str, KernelTuning]:
    """Each named variant's tuning, by name; a bad one is the parser's usage error."""
    try:
        return {name: parse_variant(name) for name in names}
    except ValueError as exc:
        parser.error(str(exc))


def format_variant(tuning: KernelTuning, base: KernelTuning = DEFAULT_TUNING) -> str:
    """The variant that parse_variant reads back as `tuning`."""
    changed = [f.name for f in dataclasses.fields(KernelTuning) if getattr(tuning, f.name) != getattr(base, f.name)]
    if not changed:
        return BASE

    def text(value: object) -> str:
        if isinstance(value, tuple):
            return "/".join(map(str, value))
        return str(int(value) if isinstance(value, bool) else value)

    return ",".join(f"{name}={text(getattr(tuning, name))}" for name in changed)
