"""Names shared by the conformance modules: collectives, ops, dtypes, shapes, tolerances."""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass

import numpy as np

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
               "scatter", "gather", "reduce", "barrier")
REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "scatter", "gather", "reduce")
OPS = ("sum", "prod", "max", "min", "avg")
DTYPES = ("float32", "float64", "int64")
OUT_MODES = ("none", "numpy", "empty", "strided", "inplace")
LAYOUTS = ("plain", "empty", "strided")
INPLACE_COLLECTIVES = ("all_reduce", "broadcast", "reduce")   # result shape == input shape

#: Named per-rank input shapes. Collectives that split a dimension round it up to a
#: multiple of the group size (see :func:`fit_shape`).
SHAPES = {
    "scalar": (),            # 0-d: all_reduce, reduce, broadcast only
    "one": (1,),             # fewer elements than members
    "odd": (5,),
    "2d": (3, 7),
    "3d": (2, 3, 5),
    "empty": (0, 3),         # zero-size
    "medium": (33, 17),      # past any small-message inline path, below 64 KiB in f64
    "large": (40000,),       # 320 KB in float64: arena / rendezvous paths
}

_RTOL = {np.dtype("float16"): 1e-2, np.dtype("float32"): 1e-6, np.dtype("float64"): 1e-12,
         np.dtype("complex64"): 1e-6, np.dtype("complex128"): 1e-12}
_FILL = 77                  # what out= buffers hold before the call


