"""Render the job.toml reference from the pydantic models, so the docs and the code never disagree.

`python -m supervisor.cli.configdoc` prints the Markdown that docs/configuration.md embeds between the
`<!-- config-reference -->` markers; a test fails when they drift apart.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from supervisor.config import Config

__all__ = ["render_reference"]


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "-"
    if value is None:
        return "unset"
    if isinstance(value, (str, Path)):
        return f'`"{value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`".replace("PosixPath(", "").replace("')", "'")


def render_reference() -> str:
    out: list[str] = []
    for section, field in Config.model_fields.items():
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        out.append(f"`[{section}]`\n")
        out.append("| key | default | meaning |")
        out.append("| --- | --- | --- |")
        fields = sorted(model.model_fields.items(), key=lambda kv: not kv[1].is_required())  # required first
        for name, f in fields:
            desc = (f.description or "").replace("|", "\\|")
            out.append(f"| `{name}` | {_default(f)} | {desc} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render_reference(), end="")
