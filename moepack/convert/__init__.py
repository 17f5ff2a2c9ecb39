"""convert: a Hugging Face checkpoint directory -> a packed directory (docs/ARCHITECTURE.md,
"convert"). The package, in the order a run uses it:

* ``plan.py``    reads the source's headers and config and decides everything (the plan, the
                 carried tensors, what cannot run is refused) before anything is written;
* ``stages.py``  the per-shard work: each layer's packed tensors, the carried tensors, the manifest;
* ``resume.py``  the journal of a run's temporary directory and the key that lets the next run
                 continue it;
* ``run.py``     the run: lock, temporary directory, threads, signals, resume, ``--tp``.

``moepack.convert(src, dst, ...)`` is this package called: the public function and the package
share the name, so the module is callable (``convert`` below) and ``moepack.convert.plan`` etc.
are its parts.
"""

from __future__ import annotations

import inspect
import sys
import types

from .run import convert


class _CallableModule(types.ModuleType):
    """``moepack.convert(...)``: the package called is its ``convert`` function."""

    def __call__(self, *args, **kwargs):
        return convert(*args, **kwargs)


__signature__ = inspect.signature(convert)
sys.modules[__name__].__class__ = _CallableModule

__all__ = ["convert"]
