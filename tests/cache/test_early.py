"""Deserialising at process start (``preheat.cache.early``): the last start's keys, per model
folder and load options, load before the model is built; a wrong guess is dropped and the call
loads (or compiles) its own program, with the same pixels."""

from __future__ import annotations

import json

import numpy as np

import preheat
from preheat.cache.early import remembered, startup_id
from preheat.cache.root import resolve_root


def _start(n: int = 2):
    pipe = preheat.load(None, prefetch=[{"n": n, "steps": 2}])
    images = np.asarray(pipe.generate(n, steps=2, seed=1))
    return pipe, images, [e for e in pipe.compiler.events if e["stage"] == "denoise"][-1]


def _records() -> list:
    return sorted((resolve_root().path / "compile" / "recent").glob("*.json"))


def test_the_second_start_deserialises_the_last_starts_executable_early():
    _, cold, event = _start()
    assert event["layer"] == "none" and "early" not in event
    assert len(_records()) == 1 and remembered(resolve_root().path, _records()[0].stem) == [event["key"]]
    _, warm, event = _start()
    assert event["layer"] == "aot" and event.get("early") is True
    np.testing.assert_array_equal(warm, cold)


def test_a_wrong_guess_is_dropped_and_the_call_loads_its_own():
    _, two, first = _start(2)
    _start(1)  # the record now names batch 1's program: batch 2's next start guesses wrong
    [record] = _records()
    assert json.loads(record.read_text())["keys"] != [first["key"]]
    _, again, event = _start(2)
    assert event["layer"] == "aot" and "early" not in event  # loaded as usual, by the prefetch
    np.testing.assert_array_equal(again, two)
    assert remembered(resolve_root().path, record.stem) == [first["key"]]  # and remembered for the next


def test_a_guess_of_missing_or_garbage_keys_costs_nothing():
    _, cold, _ = _start()
    [record] = _records()
    record.write_text(json.dumps({"keys": ["0" * 32, "../../etc", 7]}))
    _, warm, event = _start()
    assert event["layer"] == "aot"
    np.testing.assert_array_equal(warm, cold)
    record.write_text("{torn")
    assert remembered(resolve_root().path, record.stem) == []


def test_the_start_id_names_the_folder_and_options(tmp_path):
    a = startup_id(tmp_path, {"dtype": "float32"})
    assert a == startup_id(tmp_path / "." , {"dtype": "float32"})
    assert a != startup_id(tmp_path, {"dtype": "bfloat16"}) and a != startup_id(tmp_path / "x", {"dtype": "float32"})
