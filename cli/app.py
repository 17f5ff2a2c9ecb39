"""The ``moepack`` Typer app and the plumbing every command shares.

Adding a command: write it in its own module under cli/ with the ``command`` decorator from
here, and import that module in cli/main.py (importing registers it)::

    from .app import command, console

    @command()
    def inspect(path: str = typer.Argument(..., help="...")) -> None:
        ...

``command`` turns the errors a user can cause (``MoepackError``, ``ValueError``, ``OSError``)
into one line on stderr and exit status 2; ``moepack --debug ...`` shows the traceback instead.
"""

from __future__ import annotations

import functools
from typing import Callable

import typer
from rich.console import Console

from moepack.errors import MoepackError

EXIT_USER_ERROR = 2
# Errors that mean "the input or the options are wrong", not "moepack has a bug".
USER_ERRORS: tuple[type[BaseException], ...] = (MoepackError, ValueError, OSError)

app = typer.Typer(
    name="moepack",
    help="Fused Mixture-of-Experts layers on CPUs, from packed checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # --debug prints the plain traceback (no locals: tensors)
    context_settings={"help_option_names": ["-h", "--help"]},
)

console = Console()  # stdout: results
err_console = Console(stderr=True)  # stderr: progress, warnings, errors


class _State:
    debug: bool = False


state = _State()


@app.callback()
def _main(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback of an error instead of one line."),
) -> None:
    state.debug = debug
    if debug:  # moepack.hf.quiet_transformers lets transformers' own warnings through
        import os

        os.environ["MOEPACK_DEBUG"] = "1"


def error_line(exc: BaseException) -> str:
    """The first line of an error's message (C++ errors can carry a stack after it)."""
    text = str(exc).strip()
    first = text.splitlines()[0].strip() if text else ""
    if isinstance(exc, MoepackError) or isinstance(exc, ValueError):
        return first or type(exc).__name__
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def command(*args, **kwargs) -> Callable:
    """``app.command`` plus the user-error handling described above."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            try:
                return fn(*a, **kw)
            except USER_ERRORS as e:
                if state.debug:
                    raise
                typer.echo(f"moepack: error: {error_line(e)}", err=True)
                raise typer.Exit(EXIT_USER_ERROR) from None

        app.command(*args, **kwargs)(wrapper)
        return wrapper

    return decorate
