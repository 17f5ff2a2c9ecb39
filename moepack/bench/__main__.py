"""``python -m moepack.bench``: the CLI's ``bench`` command."""

from . import main

main()
