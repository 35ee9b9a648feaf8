"""The config reference (`docs/config-reference.md`), generated from the pydantic models themselves.

Every file rlplex reads is one of these models, validated at load, so the reference is the
models' fields (name, type, default, description) walked section by section: it cannot say
other than what the loader accepts. `make docs` writes it; a test fails when the file in the
repository differs from what this module generates, or when a field has no description.

    python -m rlplex.config_reference docs/config-reference.md
"""

from __future__ import annotations

import enum
import sys
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rlplex.config import StrictModel

REFERENCE_FILE = Path("docs") / "config-reference.md"


@dataclass(frozen=True)
class Document:
    """One kind of file (or table) a user writes: its title, what reads it, its model."""

    title: str
    intro: str
    model: type[BaseModel]
    root: str  # the TOML path of the model's own table ("" = the file's top level)


def documents() -> list[Document]:
    from rlplex.control.job.spec import JobSpec
    from rlplex.mainjob.config import MainJobConfig
    from rlplex.multirun.orchestrator.config import OrchestratorConfig
    from rlplex.runners.config import TrainConfig

    return [
        Document(
            "Main job file",
            "`rlplex run FILE` and `rlplex check FILE`: one trainer shared by many LLM runs.",
            MainJobConfig,
            "",
        ),
        Document(
            "A run's config",
            "The `config` of a `[[runs]]` or `[[later_runs]]` entry, or the file of `rlplex runs add --config`. "
            "In a main job, the model and inference fields a run leaves out are the job's.",
            OrchestratorConfig,
            "",
        ),
        Document(
            "Classic training file",
            "`rlplex train FILE`: one agent on gymnasium environments with the runners.",
            TrainConfig,
            "",
        ),
        Document(
            "Control-plane job file",
            "`rlplex job run FILE`: a job of roles under the PrimeMaster.",
            JobSpec,
            "",
        ),
    ]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models_in(arg)]


def _is_list(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_is_list(arg) for arg in typing.get_args(annotation) if arg is not type(None))
    return origin in (list, tuple)


def constraint_text(field: FieldInfo) -> str:
    """The bounds pydantic checks (`Field(ge=1, le=8)`, `min_length`), as `≥ 1, ≤ 8`."""
    marks = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    parts = []
    for item in field.metadata:
        for attribute, mark in marks.items():
            if (value := getattr(item, attribute, None)) is not None:
                parts.append(f"{mark} {value}")
        if (value := getattr(item, "min_length", None)) is not None:
            parts.append(f"length ≥ {value}")
        if (value := getattr(item, "max_length", None)) is not None:
            parts.append(f"length ≤ {value}")
    return ", ".join(parts)


def type_name(annotation: Any) -> str:
    """A type as a TOML writer reads it: `int`, `float or none`, `"local" | "ray"`, `list of str`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "none"
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else _toml(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(type_name(a) for a in args))  # one "table" for a union of tables
    if origin in (list, tuple, set, frozenset):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return "table"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(f'"{member.value}"' for member in annotation)
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "path"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return _toml(value.value)
    if isinstance(value, str | Path):
        return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple | set | frozenset):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def default_text(field: FieldInfo) -> str:
    factory = field.default_factory
    if factory is not None:
        if not (factory in (list, dict, tuple, set) or (isinstance(factory, type) and issubclass(factory, BaseModel))):
            return "this machine's, when the file is loaded"  # e.g. a job's capacity: not the same on every machine
        value = cast(Callable[[], Any], factory)()  # these factories take no argument
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "none"
    if isinstance(value, BaseModel):
        return "(its table's defaults)"
    if isinstance(value, list | tuple) and value and isinstance(value[0], BaseModel):
        return "(entries)"
    return f"`{_toml(value)}`"


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def _heading(path: str, is_list: bool) -> str:
    if not path:
        return "top level"
    return f"`[[{path}]]`" if is_list else f"`[{path}]`"


@dataclass(frozen=True)
class Section:
    path: str  # its TOML path ("" = the top level)
    model: type[BaseModel]
    is_list: bool  # an array of tables, [[path]]
    variant: str = ""  # one model of a tagged union: `name = "ppo"`


def _variant(model: type[BaseModel], discriminator: str | None) -> str:
    field = model.model_fields.get(discriminator or "")
    values = typing.get_args(field.annotation) if field is not None else ()
    return f'{discriminator} = "{values[0]}"' if len(values) == 1 else ""


def sections(model: type[BaseModel], path: str, is_list: bool = False, variant: str = "") -> Iterator[Section]:
    """`model`'s table and every table inside it, in order."""
    yield Section(path, model, is_list, variant)
    for name, field in model.model_fields.items():
        key = field.alias or name
        subs = _models_in(field.annotation)
        discriminator = field.discriminator if isinstance(field.discriminator, str) else None
        if typing.get_origin(field.annotation) is dict:
            key += ".NAME"  # a table of named tables: [roles.NAME]
        for sub in subs:
            tag = _variant(sub, discriminator) if len(subs) > 1 else ""
            yield from sections(sub, f"{path}.{key}" if path else key, _is_list(field.annotation), tag)


def _doc_line(model: type[BaseModel]) -> str:
    doc = (model.__doc__ or "").strip()
    own = doc and doc != (BaseModel.__doc__ or "").strip() and "__doc__" in model.__dict__
    return " ".join(doc.split("\n\n")[0].split()) if own else ""


def missing_descriptions() -> list[str]:
    """`Model.field` of every field in the reference that has no description."""
    missing = []
    for document in documents():
        for section in sections(document.model, document.root):
            model = section.model
            missing += [f"{model.__name__}.{n}" for n, f in model.model_fields.items() if not f.description]
    for name, model in _environments().items():
        missing += [f"env {name}: {model.__name__}.{n}" for n, f in model.model_fields.items() if not f.description]
    return sorted(set(missing))


def _environments() -> dict[str, type[StrictModel]]:
    from rlplex.tasks.registry import environment_settings

    return environment_settings()


def _table(model: type[BaseModel]) -> list[str]:
    lines = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        key = field.alias or name
        kind = ", ".join(part for part in (type_name(field.annotation), constraint_text(field)) if part)
        lines.append(f"| `{key}` | {_cell(kind)} | {_cell(default_text(field))} | {_cell(field.description or '')} |")
    return lines


def render() -> str:
    out = [
        "# Config reference",
        "",
        "Generated from the pydantic models that load each file (`python -m rlplex.config_reference "
        "docs/config-reference.md`, or `make docs`); a test fails when this file is stale. Unknown "
        "keys are errors everywhere, and every error names the file, the field and the value.",
        "",
    ]
    for document in documents():
        out += [f"## {document.title}", "", document.intro, ""]
        first: dict[type[BaseModel], str] = {}  # a model met again in the same file points at its table
        for section in sections(document.model, document.root):
            heading = _heading(section.path, section.is_list)
            heading += f" with `{section.variant}`" if section.variant else ""
            out += [f"### {heading}", ""]
            if section.model in first:
                out += [f"The same fields as {first[section.model]}.", ""]
                continue
            first[section.model] = heading
            if line := _doc_line(section.model):
                out += [line, ""]
            out += [*_table(section.model), ""]
        if document.model.__name__ == "OrchestratorConfig":
            out += _environment_section()
    return "\n".join(out).rstrip() + "\n"


def _environment_section() -> list[str]:
    out = [
        "### A run's `env`",
        "",
        "`env = { name = NAME, ... }`: the other keys are the environment's own settings.",
        "",
    ]
    for name, model in _environments().items():
        out += [f'#### `env.name = "{name}"`', "", *_table(model), ""]
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    target = Path(args[0]) if args else REFERENCE_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render())
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
