"""What the vision tests' module fixtures make once: a tiny vision-language model and mlx-vlm's reference for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from testkit.vision import Once


@pytest.fixture(scope="module")
def once() -> Once:
    """``once(key, make)``: what ``make`` gives, made the first time the module asks for ``key``. A parametrized
    module fixture is made again each time pytest's order (which groups the tests by their servers) comes back to
    one of its values; a model and its reference made through this are made once for the module."""
    made: dict[object, Any] = {}

    def get(key: object, make: Callable[[], Any]) -> Any:
        if key not in made:
            made[key] = make()
        return made[key]

    return get
