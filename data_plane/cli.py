"""`meridian node` and `meridian model`: the data plane's commands, mounted by the CLI (cli/main.py).

Each command imports what it runs (the node, the checkpoint writers, the weight machinery in
data_plane.weights.commands) when it runs: a CLI start must not load torch. `model push`,
which checks its zone against the providers' regions, is the CLI's (cli/model_push.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from meridian.cli_format import OutputConsole
from meridian.cli_settings import settings_or_exit
from meridian.settings.node import NodeSettings, WeightSettings

node_app = typer.Typer(no_args_is_help=True, help="A data-plane node (runtime + node agent).")
model_app = typer.Typer(no_args_is_help=True, help="Model checkpoints.")

console = OutputConsole()  # piped: wide enough that no table row folds
err_console = Console(stderr=True)


@node_app.command("run")
def node_run(
    model_dir: Annotated[Path | None, typer.Option(help="Checkpoint directory [MERIDIAN_NODE_MODEL_DIR]")] = None,
    model_uri: Annotated[str | None, typer.Option(help="Pull the model from s3://, gs://, https://, file:// into the weight cache [MERIDIAN_NODE_MODEL_URI]")] = None,
    model_name: Annotated[str | None, typer.Option(help="Served model name [MERIDIAN_NODE_MODEL_NAME]")] = None,
    region: Annotated[str | None, typer.Option(help="e.g. aws:us-east-1 [MERIDIAN_NODE_REGION]")] = None,
    node_id: Annotated[str | None, typer.Option(help="[MERIDIAN_NODE_NODE_ID]")] = None,
    host: Annotated[str | None, typer.Option(help="[MERIDIAN_NODE_HOST]")] = None,
    port: Annotated[int | None, typer.Option(help="[MERIDIAN_NODE_PORT]")] = None,
    advertise_url: Annotated[str | None, typer.Option(help="URL routers use [MERIDIAN_NODE_ADVERTISE_URL]")] = None,
    control_plane_url: Annotated[str | None, typer.Option(help="[MERIDIAN_NODE_CONTROL_PLANE_URL]")] = None,
    engine: Annotated[str | None, typer.Option(help="torch or vllm [MERIDIAN_NODE_ENGINE]")] = None,
) -> None:
    """Run a data-plane node: load the model, serve it, register with the control plane."""
    settings = settings_or_exit(NodeSettings, model_dir=model_dir, model_uri=model_uri, model_name=model_name,
                                region=region, node_id=node_id, host=host, port=port,
                                advertise_url=advertise_url, control_plane_url=control_plane_url, engine=engine)
    if settings.model_uri is not None:
        _check_model_uri(settings.model_uri)
    else:
        if settings.model_dir is None:
            err_console.print("[red]a node needs --model-dir or --model-uri[/red]")
            raise typer.Exit(2)
        _check_model_dir(settings.model_dir)
    from data_plane.node import serve

    serve(settings)


def _check_model_uri(uri: str) -> None:
    """Exit 2 with one red line unless some weight origin reads `uri`'s scheme."""
    from data_plane.weights.origins import ORIGINS

    scheme, sep, _ = uri.partition("://")
    if not sep or scheme.lower() not in ORIGINS.names():
        schemes = ", ".join(f"{s}://" for s in ORIGINS.names())
        err_console.print(f"[red]--model-uri {uri!r}: the URI must start with one of {schemes}[/red]",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(2)


def _check_model_dir(model_dir: Path) -> None:
    """Exit 2 with one red line unless `model_dir` is a checkpoint: before anything starts."""
    if not model_dir.is_dir():
        problem = "does not exist" if not model_dir.exists() else "is not a directory"
        err_console.print(f"[red]--model-dir {model_dir} {problem}[/red]", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    if not (model_dir / "config.json").is_file():
        err_console.print(f"[red]--model-dir {model_dir} has no config.json: not a model checkpoint[/red]",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(2)


@model_app.command("make-tiny")
def model_make_tiny(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the checkpoint into")],
    seed: Annotated[int, typer.Option(help="Same seed, same bytes")] = 0,
    overwrite: Annotated[bool, typer.Option(help="Replace a checkpoint already there")] = False,
    engine: Annotated[str, typer.Option(
        help="torch: the smallest model; vllm: head_dim 64, which vLLM's CPU attention needs")] = "torch",
) -> None:
    """Write a tiny Llama-architecture checkpoint (config, safetensors, tokenizer)."""
    from data_plane.model.make_tiny import VLLM_CPU_ARCH, make_tiny_checkpoint

    if engine not in ("torch", "vllm"):
        err_console.print(f"[red]--engine must be torch or vllm, not {engine!r}[/red]")
        raise typer.Exit(2)
    try:
        make_tiny_checkpoint(out_dir, seed=seed, overwrite=overwrite,
                             arch=VLLM_CPU_ARCH if engine == "vllm" else None)
    except FileExistsError:
        err_console.print(f"[red]{out_dir} exists and is not empty; pass --overwrite to replace it[/red]")
        raise typer.Exit(1) from None
    console.print(f"wrote tiny Llama checkpoint to [bold]{out_dir}[/bold] (seed {seed})")


@model_app.command("import-gguf")
def model_import_gguf(
    gguf_file: Annotated[Path, typer.Argument(help="A llama.cpp GGUF file (llama architecture, byte-level BPE)")],
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the checkpoint into")],
    overwrite: Annotated[bool, typer.Option(help="Replace a checkpoint already there")] = False,
) -> None:
    """Convert a GGUF file into a checkpoint a node serves (dequantized safetensors, config, tokenizer, chat template)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from data_plane.model.gguf_import import GgufImportError, import_gguf

    progress = Progress(TextColumn("dequantizing"), BarColumn(), MofNCompleteColumn(), TextColumn("tensors"),
                        TimeElapsedColumn(), console=err_console, transient=True)
    task = progress.add_task("tensors", total=None)
    try:
        with progress:
            import_gguf(gguf_file, out_dir, overwrite=overwrite,
                        on_tensor=lambda done, total: progress.update(task, completed=done, total=total))
    except GgufImportError as e:
        err_console.print(f"[red]{escape(str(e))}[/red]", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except FileExistsError:
        err_console.print(f"[red]{out_dir} exists and is not empty; pass --overwrite to replace it[/red]",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    console.print(f"wrote checkpoint [bold]{escape(str(out_dir))}[/bold] from {escape(str(gguf_file))}")


@model_app.command("make-tiny-lora")
def model_make_tiny_lora(
    base_dir: Annotated[Path, typer.Argument(help="Checkpoint the adapter is for (from `model make-tiny`)")],
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the adapter into")],
    seed: Annotated[int, typer.Option(help="Same seed, same bytes")] = 0,
    rank: Annotated[int, typer.Option(min=1, help="LoRA rank")] = 8,
    overwrite: Annotated[bool, typer.Option(help="Replace an adapter already there")] = False,
) -> None:
    """Write a tiny PEFT LoRA adapter (all seven projections) for a tiny checkpoint."""
    from data_plane.lora.make_tiny import make_tiny_lora
    from data_plane.model.loader import CheckpointError

    try:
        make_tiny_lora(base_dir, out_dir, seed=seed, rank=rank, overwrite=overwrite)
    except FileExistsError:
        err_console.print(f"[red]{out_dir} exists and is not empty; pass --overwrite to replace it[/red]")
        raise typer.Exit(1) from None
    except CheckpointError as e:
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(1) from None
    console.print(f"wrote tiny LoRA adapter for {base_dir} to [bold]{out_dir}[/bold] (seed {seed}, rank {rank})")


@model_app.command("pull")
def model_pull(
    uri: Annotated[str, typer.Argument(help="s3://…, gs://…, https://…, file://… or peer://host:port/<digest>")],
    cache_dir: Annotated[Path | None, typer.Option(help="[MERIDIAN_WEIGHTS_CACHE_DIR]")] = None,
) -> None:
    """Fill the node cache with a model (verified, resumable, in parallel ranges)."""
    from data_plane.weights import commands

    commands.pull(uri, settings_or_exit(WeightSettings, cache_dir=cache_dir), console)


@model_app.command("cache")
def model_cache(
    cache_dir: Annotated[Path | None, typer.Option(help="[MERIDIAN_WEIGHTS_CACHE_DIR]")] = None,
) -> None:
    """List the models in the node cache."""
    from data_plane.weights import commands

    console.print(commands.cache_table(settings_or_exit(WeightSettings, cache_dir=cache_dir)))
