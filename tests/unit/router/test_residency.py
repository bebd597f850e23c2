"""Which models stay resident (``router.residency``): the least recently used idle one makes room, a busy one never
does, and an idle one unloads once its keep_alive has passed."""

from __future__ import annotations

from neuron.router.residency import Resident, expired, make_room, unload_to_fit


def _resident(name: str, busy: int = 0, last_used: float = 0.0, keep_alive: float | None = None) -> Resident:
    return Resident(name, busy, last_used, keep_alive)


def test_under_the_cap_nothing_unloads() -> None:
    assert make_room([_resident("a")], "b", models_max=2) == []
    assert make_room([_resident("a"), _resident("b")], "c", models_max=None) == []


def test_at_the_cap_the_least_recently_used_idle_model_makes_room() -> None:
    resident = [_resident("a", last_used=5.0), _resident("b", last_used=1.0), _resident("c", last_used=3.0)]
    assert make_room(resident, "d", models_max=3) == ["b"]
    assert make_room(resident, "d", models_max=1) == ["b", "c", "a"]


def test_a_busy_model_is_never_chosen_and_none_means_wait() -> None:
    resident = [_resident("a", busy=1, last_used=0.0), _resident("b", last_used=9.0)]
    assert make_room(resident, "c", models_max=2) == ["b"]
    assert make_room([_resident("a", busy=2)], "c", models_max=1) is None


def test_the_wanted_model_itself_is_not_counted_against_the_cap() -> None:
    assert make_room([_resident("a"), _resident("b", last_used=1.0)], "a", models_max=2) == []


def test_an_idle_model_expires_after_its_keep_alive_and_a_busy_one_never() -> None:
    resident = [
        _resident("quick", last_used=0.0, keep_alive=5.0),
        _resident("slow", last_used=0.0, keep_alive=60.0),
        _resident("busy", busy=1, last_used=0.0, keep_alive=1.0),
        _resident("forever", last_used=0.0, keep_alive=None),
    ]
    assert expired(resident, now=10.0) == ["quick"]
    assert expired(resident, now=4.0) == []


def test_a_model_that_fits_beside_the_others_unloads_none() -> None:
    assert unload_to_fit([_resident("a", last_used=1.0)], need=100, free=500) == []


def test_idle_models_unload_least_recently_used_first_until_the_new_one_fits() -> None:
    resident = [
        Resident("a", 0, 3.0, None, held=300),
        Resident("b", 0, 1.0, None, held=100),
        Resident("c", 1, 0.0, None, held=900),  # busy: never
    ]
    assert unload_to_fit(resident, need=200, free=100) == ["b"]
    assert unload_to_fit(resident, need=450, free=100) == ["b", "a"]
    assert unload_to_fit(resident, need=600, free=100) is None
