"""The terminal both halves of the CLI print to, and its one-paragraph error exit."""

from __future__ import annotations

import typer
from rich.console import Console

console = Console()
err_console = Console(stderr=True)


def fail(message: str) -> typer.Exit:
    """Print one paragraph to stderr and return the exit to raise (status 2)."""
    err_console.print(f"[bold red]error:[/bold red] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code=2)
