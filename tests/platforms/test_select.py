"""Which platform answers: the compile target (``compiling_for``), else the running backend, unless a
test selected its own (``selected``); and the target is part of jit's caches."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from preheat import platforms


def test_the_running_backend_answers_when_nothing_is_chosen():
    assert platforms.traced_target() == ("cpu", None) and not platforms.deviceless()
    assert platforms.current() is platforms.PLATFORMS["cpu"] and platforms.local() is platforms.PLATFORMS["cpu"]


def test_the_compile_target_answers_during_a_deviceless_compile():
    with platforms.compiling_for("gpu", [9, 0]):
        assert platforms.traced_target() == ("gpu", (9, 0)) and platforms.deviceless()
        assert platforms.current().name == "gpu"
        assert platforms.local().name == "cpu"  # the devices that run this process are still the CPU's
    with platforms.compiling_for("tpu"):
        assert platforms.current() is platforms.PLATFORMS["tpu"]
    assert platforms.current().name == "cpu"


def test_a_platform_preheat_does_not_describe_gets_the_generic_description():
    other = platforms.get("metal")
    assert other.name == "metal" and type(other) is platforms.Platform
    layer = platforms.AttentionLayer("bfloat16", 64, 4096, 4096)
    assert other.attention(layer).impl is None and other.conv_form(None) == "conv"
    assert other.groupnorm_form() == "two_pass" and not other.autotunes


def test_a_selected_fake_answers_whatever_the_target():
    fake = platforms.FakePlatform(groupnorm="one_pass", conv="im2col")
    with platforms.selected(fake):
        assert platforms.current() is fake and platforms.local() is fake
        with platforms.compiling_for("gpu", (9, 0)):
            assert platforms.current() is fake
    assert platforms.current().name == "cpu"


def test_one_function_traced_for_two_targets_gets_two_programs():
    """The target and the selected platform are part of jit's caches: a trace for one is never reused
    for the other (the GroupNorm form differs: one pass on the CPU, two on a TPU)."""
    seen = []

    @jax.jit
    def f(x):
        seen.append(platforms.current().groupnorm_form())
        return x + 1

    x = jnp.zeros(3)
    f(x)
    with platforms.compiling_for("tpu"):
        f.lower(x)
    with platforms.selected(platforms.FakePlatform(groupnorm="welford")):
        f.lower(x)
    f(x)
    assert seen == ["one_pass", "two_pass", "welford"]
