"""The ``moepack`` Typer app and the plumbing every command shares.

Adding a command: write it in its own module under cli/ with the ``command`` decorator from
here, and import that module in cli/main.py (importing registers it)::

    from .app import command, console

    @command()
    def inspect(path: str = typer.Argument(..., help="...")) -> None:
        ...

``command`` turns the errors a user can cause (``MoepackError``, ``ValueError``, ``OSError``)
into one line on stderr and exit status 2; ``moepack --verbose ...`` adds the error's notes after
it (e.g. the other source readers' reasons when none reads a checkpoint), one ``note:`` line each;
``moepack --debug ...`` shows the traceback instead.
"""

from __future__ import annotations

import functools
from typing import Callable

import typer
import typer.core
from rich.console import Console

from moepack.errors import MoepackError

EXIT_USER_ERROR = 2
# Errors that mean "the input or the options are wrong", not "moepack has a bug".
USER_ERRORS: tuple[type[BaseException], ...] = (MoepackError, ValueError, OSError)


class _OneLineBadValues(typer.core.TyperGroup):
    """The app's group: an option value click cannot parse (``--tp 1.5``, ``--threads x``) is one
    line naming the option, the value and the rule, exit status 2, as every other bad value
    (no usage box)."""

    def invoke(self, ctx):
        words = [*getattr(ctx, "_protected_args", ()), *ctx.args]  # the command line, before click consumes it
        try:
            return super().invoke(ctx)
        except typer.BadParameter as e:  # typer's click (typer vendors click from 0.22 on)
            if type(e).__name__ == "MissingParameter" or state.debug:  # a missing argument keeps its usage box
                raise
            typer.echo(f"moepack: error: {_bad_value_line(e, words)}", err=True)
            raise typer.Exit(EXIT_USER_ERROR) from None


def _bad_value_line(e, words: list[str]) -> str:
    """``--tp 1.5: input should be a valid integer, ...``: the option as given, its value (found
    in the command line ``words``) and click's rule."""
    rule = e.message[:1].lower() + e.message[1:] if e.message else "not a valid value"
    opts = [*getattr(e.param, "opts", ()), *getattr(e.param, "secondary_opts", ())]
    for i, w in enumerate(words):
        for o in opts:
            if w == o and i + 1 < len(words):
                return f"{o} {words[i + 1]}: {rule}"
            if o.startswith("--") and w.startswith(o + "="):
                return f"{o} {w[len(o) + 1:]}: {rule}"
    return e.format_message()


app = typer.Typer(
    cls=_OneLineBadValues,
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
    verbose: bool = False


state = _State()


@app.callback()
def _main(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback of an error instead of one line."),
    verbose: bool = typer.Option(False, "--verbose", help="After an error's line, its notes (e.g. why each other source "
                                                          "reader does not read the checkpoint)."),
) -> None:
    state.debug = debug
    state.verbose = verbose
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


def check_range(option: str, value, lo, hi, what: str):
    """``value`` of ``option`` when it is a finite number in ``lo..hi``; else a ``ValueError``
    naming the option, the value and the range (``what``: what the option sets)."""
    import math

    kind = "an integer" if isinstance(lo, int) and isinstance(hi, int) else "a finite number"
    ok = isinstance(value, int) if kind == "an integer" else isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(value, bool) or not ok or not lo <= value <= hi:
        rule = f"must be positive and at most {hi}" if kind == "an integer" and lo == 1 else f"must be {kind} in {lo}..{hi}"
        raise ValueError(f"{option} {value}: {rule} ({what})")
    return value


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
                if state.verbose:
                    for note in getattr(e, "__notes__", ()):
                        typer.echo(f"moepack: note: {' '.join(str(note).split())}", err=True)
                raise typer.Exit(EXIT_USER_ERROR) from None

        app.command(*args, **kwargs)(wrapper)
        return wrapper

    return decorate
