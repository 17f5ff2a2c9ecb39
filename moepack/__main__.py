"""``python -m moepack ...`` is the ``moepack`` command."""

from moepack.cli.main import app

app()
