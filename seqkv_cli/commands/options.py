"""What several commands share: their common options, what the machine options do, and the
progress bars of model work.

Every model-running command takes `--model`, `--threads` and `--device` and is declared with
`runs_model`, which applies the last two for that command only; a command that does not run
a model takes none of them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, TypeVar

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from seqkv_cli.commands._common import err_console

ModelOption = Annotated[
    str | None,
    typer.Option("--model", "-m", help="Model folder, .gguf file or hub id (default: embedded)."),
]
ThreadsOption = Annotated[
    int | None,
    typer.Option(
        "--threads",
        metavar="N",
        help="CPU threads for the model (default: one per core; idle threads yield to other "
        "processes). The portable path gives the same bits with any N.",
    ),
]
DeviceOption = Annotated[
    str,
    typer.Option(
        "--device",
        metavar="auto|cpu|cuda[:N]",
        help="Where the model runs: auto (a CUDA GPU when there is one), cpu or cuda. The "
        "portable path writes and reads the same bytes on either.",
    ),
]
NumericsOption = Annotated[
    str,
    typer.Option(
        help="Canonical numeric path: 'portable' (same bits on any machine, thread count or "
        "device; the default, portable-fx53-v3), 'portable-v2' or 'portable-v1' (the versions "
        "of seqkv 0.3-0.4 and 0.2) or 'legacy' (the earlier fp32 forward: same machine class "
        "only).",
    ),
]

Command = TypeVar("Command", bound=Callable[..., None])


def runs_model(command: Command) -> Command:
    """Declare a command that runs a model: its `--threads` set torch's thread count, and its
    `--device` is where the model (and long entropy streams) go for this command only (tests
    run many commands in one process). The command must take both options; that is checked
    here, when it is declared, not when it runs."""
    signature = inspect.signature(command)
    missing = {"threads", "device"} - set(signature.parameters)
    if missing:
        raise TypeError(f"{command.__name__} runs a model but takes no {sorted(missing)}")

    @functools.wraps(command)
    def wrapper(*args, **kwargs) -> None:
        from seqkv_cli.runtime.devices import using
        from seqkv_cli.runtime.threads import use_threads
        from seqkv_codecs.entropy.placement import on_device

        given = signature.bind(*args, **kwargs)
        given.apply_defaults()
        use_threads(given.arguments["threads"])
        # long entropy streams follow the model onto a GPU (the same bytes,
        # docs/format/ENTROPY_STREAM.md)
        with using(given.arguments["device"]) as dev, on_device(str(dev)):
            return command(*args, **kwargs)

    wrapper.runs_model = True  # the declaration, kept by functools.wraps on the way out
    return wrapper  # type: ignore[return-value]


class TokensPerSecond(ProgressColumn):
    """The measured rate: a slow or busy machine shows itself while the job runs."""

    def render(self, task) -> Text:
        return Text(
            f"{task.speed:,.1f} tokens/s" if task.speed else "", style="progress.data.speed"
        )


def token_progress() -> Progress:
    """Tokens done, tokens/s (a slow or busy machine shows itself) and time left."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TokensPerSecond(),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
    )


def restore_bar(bar: Progress, what: str = "restoring") -> Callable[[int, int], None]:
    """An `Archive.on_tokens` callback that moves a `token_progress` bar (its total is known
    once the restore has planned which tokens it decodes)."""
    task = bar.add_task(what, total=None)
    return lambda done, total: bar.update(task, completed=done, total=total)
