"""One description per platform (cpu, gpu, tpu) of every choice preheat makes differently on it.

The rest of preheat asks the seam, never ``jax.default_backend()`` or a device's platform:

==========================  =====================================================================
question                    asked as
==========================  =====================================================================
a layer's attention         ``current().attention(AttentionLayer(...), capability, deviceless())``
a convolution's form        ``current().conv_form(ConvLayer(...))`` (``PREHEAT_CONV`` overrides)
GroupNorm's statistics      ``current().groupnorm_form()`` (``PREHEAT_GROUPNORM`` overrides)
the key's device fields     ``device_fields(mesh_size, target)``, ``mesh_fields(mesh)``
the deviceless target       ``compiling_for(platform, capability)``, ``traced_target()``, ``deviceless()``
a stage on the host's CPU   ``host_device()``, ``on_host()``, ``host_fields()``, ``host_compute_dtype()``
offloaded weights' memory   ``offload_memory()``: pinned host memory the device streams from
does a compile autotune     ``autotunes_here()``; a platform's ``autotunes``
doctor's platform checks    a platform's ``doctor_checks`` (ids in ``preheat.doctor.checks``)
how to name the device      ``describe_device()``, ``accelerator_label()``, ``key_device_label(fields)``
==========================  =====================================================================

The compile target decides every trace-time choice (``current()``: the platform ``compiling_for``
names during a deviceless compile, else the running backend's), so a builder traces the program a
pod would trace for itself. A test selects a ``FakePlatform`` with ``selected``. Modules: ``_base``
(the description's base class and the values choices are made from), ``_cpu``, ``_gpu``, ``_tpu``
(one platform each; ``_libtpu``: libtpu as a TPU key reads it), ``_select`` (which platform is asked),
``_devices`` (the running machine's devices), ``_fake``.
"""

from __future__ import annotations

from preheat.platforms._base import Attention, AttentionLayer, ConvLayer, Platform
from preheat.platforms._cpu import CpuPlatform, cpu_features, cpu_flags, host_compute_dtype
from preheat.platforms._devices import (accelerator_label, autotunes_here, describe_device, device_fields,
                                        devices_of, host_device, host_fields, key_device_label, key_runtime,
                                        mesh_fields, offload_memory)
from preheat.platforms._fake import FakePlatform
from preheat.platforms._gpu import (GpuPlatform, cuda_versions, cudnn_available, device_gpu_fields, gpu_fields,
                                    local_description, parse_description)
from preheat.platforms._select import (PLATFORMS, compiling_for, current, deviceless, get, local, on_host,
                                       selected, traced_target)
from preheat.platforms._libtpu import libtpu_init_args, libtpu_version, slice_description
from preheat.platforms._tpu import TpuPlatform, chip_fields, flash_choice

__all__ = [
    # the description and its values
    "Platform", "AttentionLayer", "Attention", "ConvLayer", "CpuPlatform", "GpuPlatform", "TpuPlatform",
    "FakePlatform", "PLATFORMS", "chip_fields", "flash_choice",
    # which platform is asked
    "get", "current", "local", "selected", "compiling_for", "traced_target", "deviceless", "on_host",
    # the running machine's devices and the key's device fields
    "describe_device", "accelerator_label", "devices_of", "device_fields", "mesh_fields", "key_device_label",
    "key_runtime", "autotunes_here", "cpu_features", "cpu_flags", "host_device", "host_fields", "host_compute_dtype",
    "offload_memory",
    # GPU descriptions (XLA's target descriptions, the CUDA plugin's versions)
    "parse_description", "gpu_fields", "cuda_versions", "cudnn_available", "local_description",
    "device_gpu_fields",
    # libtpu (LIBTPU_INIT_ARGS as a VM's libtpu reads it) and a TPU slice described
    "libtpu_version", "libtpu_init_args", "slice_description",
]
