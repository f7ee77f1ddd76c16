"""GGUF files as city96's FLUX GGUFs lay them out (BFL's transformer keys), written by ``gguf``'s own
writer and quantiser::

    write_gguf(path, tensors, quant) -> {name: GGML type}
"""

from __future__ import annotations

from typing import Any

import numpy as np


def write_gguf(path: Any, tensors: dict[str, np.ndarray], quant: Any) -> dict[str, str]:
    """``tensors`` as a GGUF file: 2-D weights whose rows are blocks of 32 in ``quant`` (a
    ``gguf.GGMLQuantizationType``), other 2-D tensors F16, 1-D ones F32 (as city96's files keep
    biases and norms); returns {name: type}."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="flux")
    types = {}
    for key, value in tensors.items():
        value = np.asarray(value, np.float32)
        if value.ndim == 2 and value.shape[-1] % 32 == 0 and key.endswith(".weight"):
            writer.add_tensor(key, gguf.quants.quantize(value, quant), raw_dtype=quant)
            types[key] = quant.name
        elif value.ndim >= 2:
            writer.add_tensor(key, value.astype(np.float16))
            types[key] = "F16"
        else:
            writer.add_tensor(key, value)
            types[key] = "F32"
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types
