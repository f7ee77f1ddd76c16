"""The GPU's description: cuDNN's fused attention only where it can run (a device at hand, its
constraints on dtype, head dim, mask and capability), matrix-product convolutions when compiled
deviceless, autotuned compiles, and the doctor's GPU checks."""

from __future__ import annotations

import pytest

from preheat import platforms
from preheat.platforms import _gpu

GPU = platforms.get("gpu")


def _impl(dtype="bfloat16", head_dim=64, masked=False, capability=(9, 0), deviceless=False):
    return GPU.attention(platforms.AttentionLayer(dtype, head_dim, 4096, 77, 10, masked), capability, deviceless).impl


@pytest.mark.parametrize("cudnn", [True, False])
def test_fused_attention_only_where_cudnn_can_run_it(monkeypatch, cudnn):
    monkeypatch.setattr(_gpu, "cudnn_available", lambda: cudnn)
    fused = "cudnn" if cudnn else "xla"
    assert [_impl(), _impl("float16", 80), _impl(head_dim=40), _impl(head_dim=128)] == [fused] * 4
    assert [_impl(head_dim=160), _impl("float32"), _impl(head_dim=60), _impl(masked=True),
            _impl(capability=(7, 5)), _impl(capability=None), _impl(deviceless=True)] == ["xla"] * 7


def test_convolutions_are_matrix_products_only_in_a_deviceless_compile():
    layer = platforms.ConvLayer(16, 64, 64, 320, 320, 3)
    assert GPU.conv_form(layer) == "conv" and GPU.conv_form(layer, deviceless=True) == "taps"
    assert GPU.groupnorm_form() == "two_pass"


def test_the_doctor_s_gpu_checks_are_named():
    from preheat.doctor.checks import CHECKS

    ids = {c.id for c in CHECKS}
    assert GPU.doctor_checks and set(GPU.doctor_checks) <= ids
    assert platforms.get("cpu").doctor_checks == ()
