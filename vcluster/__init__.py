"""vcluster: a virtual GPU cluster on one machine — emulate, simulate, plan, check.

The package exports the engines' public names; the command line lives in
``vcluster.cli`` and is imported only by ``python -m vcluster`` / the ``vcluster`` script.
"""

from .runtime import *  # noqa: F401,F403
from .runtime import __all__ as _runtime_all

__all__ = list(_runtime_all)
__version__ = "0.1.0"
