"""verify: a packed directory checked against its manifest and, with ``source=``, against the
checkpoint it was converted from (docs/ARCHITECTURE.md, "verify"). The package:

* ``run.py``     the steps: integrity (every tensor's sha256 and value rules), then each layer
                 and the model against the source; the report;
* ``values.py``  the value rules of packed tensors (generic roles here, a scheme's own in
                 ``Scheme.value_rules``), which ``moepack.open`` also applies to the small ones;
* ``layer.py``   one layer: the packed weights against the source's, the kernel's output against
                 the scheme's reference;
* ``model.py``   the model: config, routing, carried tensors against the source;
* ``report.py``  the report's records and the hashing helpers every step uses.

``moepack.verify(dst, ...)`` is this package called: the public function and the package share
the name, so the module is callable (``verify`` below) and ``moepack.verify.values`` etc. are its
parts.
"""

from __future__ import annotations

import inspect
import sys
import types

from .run import verify


class _CallableModule(types.ModuleType):
    """``moepack.verify(...)``: the package called is its ``verify`` function."""

    def __call__(self, *args, **kwargs):
        return verify(*args, **kwargs)


__signature__ = inspect.signature(verify)
sys.modules[__name__].__class__ = _CallableModule

__all__ = ["verify"]
