"""What every command shares: error handling, consoles, quiet heavy libraries, and how
numbers, paths and tables are printed (the options they share: options.py)."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import sys
import threading

import typer
from rich.console import Console
from rich.markup import escape

from seqkv_cli.errors import SeqkvError
from seqkv_codecs.errors import CodecError

PIPE_WIDTH = 1000  # no terminal to fit: tables as wide as their content, every number whole


def _width(stream) -> int | None:
    """Rich's own detection in a terminal or under COLUMNS; piped output (CI logs, files)
    would otherwise be cut to 80 columns ("agent…", "184,3…")."""
    if os.environ.get("COLUMNS") or (hasattr(stream, "isatty") and stream.isatty()):
        return None
    return PIPE_WIDTH


console = Console(width=_width(sys.stdout))
err_console = Console(stderr=True, width=_width(sys.stderr))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command was, so that it unwinds as from Ctrl-C: every
    writer's cleanup runs (staging files deleted, locks released) before the exit."""


def _terminate(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def terminate_like_interrupt():
    """SIGTERM handled as SIGINT is, while a command runs: without this its default action
    ends the process at once and leaves what the command staged. Only the main
    thread may set a handler; the previous one is put back (tests run many commands)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:  # None: a handler set outside Python, which cannot be put back; the default
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def handle_errors(func):
    """Turn library errors into one line on stderr and a non-zero exit, never a traceback:
    SeqkvError (exit 2 or its own), an OS refusal nothing below named (a full disk, a quota,
    a read-only mount: exit 2), Ctrl-C ("interrupted", 130) and SIGTERM ("terminated", 143),
    both after the command's own cleanup ran. A model-running command is also declared with
    `options.runs_model`, inside this (its --threads and --device refused here like any
    other error)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        quiet_libraries()
        try:
            with terminate_like_interrupt():
                return func(*args, **kwargs)
        except (SeqkvError, CodecError) as exc:
            err_console.print(f"[bold red]error:[/] {shown(exc)}", highlight=False, soft_wrap=True)
            raise typer.Exit(getattr(exc, "exit_code", 2)) from None
        except OSError as exc:
            err_console.print(f"[bold red]error:[/] {shown(os_error_line(exc))}", highlight=False)
            raise typer.Exit(2) from None
        except Terminated:
            err_console.print("terminated")
            raise typer.Exit(143) from None
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None
        except MemoryError:
            err_console.print("[bold red]error:[/] out of memory")
            raise typer.Exit(3) from None
        except RecursionError:  # last line of defence: deeply nested data in a crafted file
            err_console.print("[bold red]error:[/] input is nested too deeply to read")
            raise typer.Exit(2) from None

    return wrapper


def os_error_line(exc: OSError) -> str:
    """An OSError that reached the command unnamed, as one line: the file, then why."""
    from seqkv_cli.fsutil import describe_os_error

    reason = describe_os_error(exc)
    return f"{exc.filename}: {reason}" if exc.filename is not None else reason


def quiet_libraries() -> None:
    """transformers prints load progress bars and advice; seqkv shows its own progress."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()


# Control characters (ESC starts ANSI/OSC sequences that retitle or recolour a terminal)
# and bidi overrides are shown as \xNN; ids and paths come from files anyone can craft.
_UNPRINTABLE = {
    c: f"\\x{c:02x}" if c < 256 else f"\\u{c:04x}"
    for c in (*range(32), *range(127, 160), *range(0x202A, 0x202F), *range(0x2066, 0x206A))
}


def shown(value: object) -> str:
    """Any path, id or message, safe to print: control characters made visible, Rich
    markup escaped (a "[/x]" in a name would otherwise raise MarkupError)."""
    return escape(str(value).translate(_UNPRINTABLE))


_NEEDS_TRANSLATION = re.compile("[" + "".join(re.escape(chr(c)) for c in _UNPRINTABLE) + "]")


def visible(value: object) -> str:
    """Control characters made visible, for plain (not Rich markup) output."""
    text = str(value)
    return text.translate(_UNPRINTABLE) if _NEEDS_TRANSLATION.search(text) else text


def print_columns(columns: dict[str, list[str]], left: tuple[str, ...] = ()) -> None:
    """A plain aligned table (header, rule, rows) for listings too long for a Rich table,
    which renders about a millisecond a row; cells are already formatted, shown as text."""
    names = list(columns)
    widths = [max([len(n), *(len(c) for c in columns[n])]) for n in names]
    pads = [str.ljust if n in left else str.rjust for n in names]
    lines = ["  ".join(pad(n, w) for n, w, pad in zip(names, widths, pads, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in zip(*(columns[n] for n in names), strict=True):
        lines.append("  ".join(p(c, w) for c, w, p in zip(row, widths, pads, strict=True)))
    console.file.write("\n".join(lines) + "\n")  # Rich's own output: ~0.1 ms a line


def say(message: str) -> None:
    """Status lines go to stderr so that stdout stays clean for data (printed as plain text:
    the paths and ids in them are not markup)."""
    err_console.print(shown(message), highlight=False)


def human_seconds(x: float) -> str:
    """A duration with its significant digits kept: a tiny model's restore is milliseconds,
    which one decimal of seconds would print as "0.0 s"."""
    if x >= 10:
        return f"{x:,.0f} s"
    if x >= 1:
        return f"{x:.1f} s"
    return f"{x * 1000:.3g} ms"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
