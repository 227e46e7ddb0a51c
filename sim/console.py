"""The terminal both halves of the CLI print to, and its one-paragraph error exit."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console()
err_console = Console(stderr=True)


def fail(message: str) -> typer.Exit:
    """Print one paragraph to stderr and return the exit to raise (status 2)."""
    # The message is text: "pip install 'kvsim[tune]'" or a path with brackets is no markup.
    err_console.print(
        f"[bold red]error:[/bold red] {escape(message)}", highlight=False, soft_wrap=True
    )
    return typer.Exit(code=2)


def note(text: str, style: str = "yellow") -> None:
    """Print ``text`` to stderr in ``style``; brackets in it are text, not rich markup."""
    err_console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)


def count_progress(quiet: bool, transient: bool = False) -> Progress:
    """A bar of tasks done / total with the elapsed time, on stderr; off when ``quiet`` or
    stderr is not a terminal."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        disable=quiet or not err_console.is_terminal,
        transient=transient,
    )
