"""preheat.cache.executables: a pipeline's executables in memory, one owner; the retune's swap
happens only where the served executable still is."""

from __future__ import annotations

from preheat.cache.executables import Executables


def test_put_get_drop_and_the_signatures_in_order() -> None:
    held = Executables()
    held.put("b", 1)
    held.put("a", 2)
    assert held.get("b") == 1 and held.get("c") is None and "a" in held and len(held) == 2
    assert held.signatures() == ["b", "a"]
    held.drop("b")
    held.drop("b")  # absent: nothing to do
    assert held.signatures() == ["a"] and "b" not in held


def test_replace_swaps_only_what_is_still_served() -> None:
    served, newer, autotuned = object(), object(), object()
    held = Executables()
    held.put("s", served)
    assert held.replace("s", served, autotuned) and held.get("s") is autotuned
    held.put("s", newer)  # a newer put meanwhile: the retune must not undo it
    assert not held.replace("s", autotuned, served) and held.get("s") is newer
