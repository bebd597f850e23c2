"""How a rank's request fails: with the group still in step, or while joining it."""

from __future__ import annotations


class RankError(RuntimeError):
    """A step or request refused or failed with the group still in step.

    Raised either before any collective (identically on every rank, since every
    rank checks the same request) or after all of them, so no peer is left
    waiting inside a collective. Any other exception means the group is suspect.
    """


class GroupError(RuntimeError):
    """Joining the group failed inside MLX; the message says what to check, the library's words included."""
