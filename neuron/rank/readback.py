"""Reading an array back to the host, typed once: the few values a rank brings back from the device (a token, a
logprob, the sanity all-reduce), every one of them named here so that a stray read is easy to find."""

from __future__ import annotations

from typing import cast

import mlx.core as mx


# mlx types ``tolist`` as any scalar at any depth and ``item`` as possibly complex; these say what a real array of a
# known shape holds, so that reading one on the host is typed once, here.
def ints(a: mx.array) -> list[int]:
    """A 1-d integer array's values on the host."""
    return cast(list[int], a.tolist())


def floats(a: mx.array) -> list[float]:
    """A 1-d real array's values on the host."""
    return cast(list[float], a.tolist())


def scalar(a: mx.array) -> float:
    """A real scalar array's value on the host (an ``int`` for an integer array)."""
    return cast(float, a.item())
