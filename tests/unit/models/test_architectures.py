"""The architectures' table, its decisions without a model: which layers a split must keep together.

Each architecture's tiny model served as mlx-lm generates it, and the refusals, are tests/e2e/architectures/
test_architectures.py.
"""

from __future__ import annotations

import pytest

from neuron.models import architectures
from testkit.tiny_archs import config


def test_the_tiny_gemma4s_last_layer_stays_with_the_layer_whose_keys_and_values_it_reads() -> None:
    from neuron.launch.stages import SplitError, check_split

    together = architectures.kept_together(config("gemma4_text", 300))
    assert together == [(1, 3)]  # layer 3 (full attention) reads layer 1's
    with pytest.raises(SplitError, match=r"puts layer 3 in stage 1 and layer 1, .* use --pp-layers 1,3"):
        check_split([2, 2], 4, 2, together)
    with pytest.raises(SplitError, match=r"\(3 reads 1's\), and no split into 3 stages"):
        check_split([], 4, 3, together)
