"""The process's file-descriptor limit: the operator's, raised to its hard limit, and kept. No MLX.

Importing ``mlx_lm.utils`` sets ``RLIMIT_NOFILE`` to 2048 soft and 4096 hard,
whatever systemd's ``LimitNOFILE=`` or the shell gave, and a lowered hard limit
cannot be raised again without privileges. A server that holds one descriptor
per connection then runs out at about 2,000 clients. So the first import of
``mlx_lm.utils`` happens here, with that one call made harmless.
"""

from __future__ import annotations

import resource
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from neuron.log import adopt_library_logger


def raise_soft_limit() -> tuple[int, int]:
    """Raise the soft limit to the hard one (the soft default, 1,024, is for select()-era programs); the limits."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


@contextmanager
def limit_kept() -> Iterator[None]:
    """Within: calls to ``resource.setrlimit`` for ``RLIMIT_NOFILE`` change nothing."""
    setrlimit = resource.setrlimit

    def keep(which: int, limits: Any) -> None:
        if which != resource.RLIMIT_NOFILE:
            setrlimit(which, limits)

    resource.setrlimit = keep
    try:
        yield
    finally:
        resource.setrlimit = setrlimit


def import_mlx_lm() -> None:
    """Import ``mlx_lm.utils`` (and MLX) with the descriptor limit kept; call it before anything else imports it (once
    imported, a call changes nothing). The transformers it imports then logs as this process does
    (``adopt_library_logger``)."""
    with limit_kept():
        import mlx_lm.utils  # noqa: F401
    raise_soft_limit()
    adopt_library_logger("transformers")
