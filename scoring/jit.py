"""Compiled kernels for the request path, through numba, typed for mypy.

A routing decision prices every backend of a model in a handful of formulas over 64 rows: numpy spends
~1 us of call overhead per operation on arrays that small, ~300 operations a decision, and the work
itself is a few flops a row. `kernel` compiles a function of scalar loops (numba's nopython mode) and
keeps its Python signature for the type checker. Kernels take float64 arrays and plain numbers only.

Compiling takes ~15 s the first time; numba caches the machine code on disk beside the module (or in
`NUMBA_CACHE_DIR`), so a process that starts later loads it in about a second. The gateway compiles
before it serves (`scoring.cost_policy.compile_kernels`): otherwise the first request would wait for
it, and the event loop with it. Where no cache directory is writable, kernels compile in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np

F = TypeVar("F", bound=Callable[..., Any])

KERNELS: list[Any] = []  # every kernel and ufunc made here (tests check what the warm-up compiled)


def kernel(function: F) -> F:
    """`function` compiled in nopython mode, cached on disk; division by zero gives inf or NaN as
    numpy's does, not an exception."""
    try:
        compiled = numba.njit(function, cache=True, nogil=True, error_model="numpy")
    except RuntimeError:  # no writable cache location (a read-only install without NUMBA_CACHE_DIR)
        compiled = numba.njit(function, nogil=True, error_model="numpy")
    KERNELS.append(compiled)
    return cast(F, compiled)


def ufunc(function: Callable[..., float]) -> Callable[..., np.ndarray]:
    """`function`, of scalars, as a numpy ufunc compiled for the argument types it is called with
    (numba's `vectorize`): it broadcasts over arrays as numpy's own ufuncs do."""
    vectorize: Callable[..., Callable[[Callable[..., float]], Any]] = numba.vectorize
    try:
        compiled = vectorize(cache=True)(function)
    except RuntimeError:
        compiled = vectorize()(function)
    KERNELS.append(compiled)
    return cast(Callable[..., np.ndarray], compiled)
