"""The JAX probe, run by doctor as ``python -m preheat.doctor.jax_probe`` in a fresh process with a
timeout: imports JAX, runs a tiny jitted matmul and prints one line ``PREHEAT_DOCTOR_PROBE=<json>``
(backend, devices, whether the result is right, JAX's backend errors and warnings), and the first
device's facts: its memory limit (``memory_stats()["bytes_limit"]``: a TPU chip's usable HBM), and on
a TPU its coordinates (the slice's topology) and the runtime's ``platform_version`` (libtpu's build).

It imports nothing of preheat itself (``-m`` runs only the light package ``__init__``s first, which
import neither JAX nor torch), so what it sees is what a new program would see.
"""


def main() -> None:
    import json, logging, sys, time, warnings
    out = {"ok": False}
    records = []
    class _H(logging.Handler):
        def emit(self, record):
            try:
                records.append(record.getMessage())
            except Exception:
                pass
    logging.getLogger("jax").addHandler(_H(level=logging.WARNING))
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import jax, jax.numpy as jnp
            out["jax_version"] = jax.__version__
            x = jnp.arange(64, dtype=jnp.float32).reshape(8, 8) / 64.0
            value = float(jax.jit(lambda a: (a @ a.T).sum())(x))
            ref = [[(r * 8 + c) / 64.0 for c in range(8)] for r in range(8)]
            expected = sum(sum(a * b for a, b in zip(ref[i], ref[k])) for i in range(8) for k in range(8))
            out["result_ok"] = abs(value - expected) <= 1e-3 * abs(expected)
            out["backend"] = jax.default_backend()
            devices = jax.devices()
            out["device_count"] = len(devices)
            out["devices"] = [getattr(d, "device_kind", str(d)) for d in devices]
            out["ok"] = True
            out["device"] = _device_facts(devices)
        except BaseException as exc:
            out["error"] = "%s: %s" % (type(exc).__name__, exc)
    try:
        from jax._src import xla_bridge as _xb
        out["backend_errors"] = {k: str(v) for k, v in getattr(_xb, "_backend_errors", {}).items()}
    except BaseException:
        pass
    out["warnings"] = [m for m in records if m][:20] + [str(w.message) for w in caught][:10]
    out["elapsed_s"] = round(time.perf_counter() - t0, 3)
    sys.stdout.write("PREHEAT_DOCTOR_PROBE=" + json.dumps(out) + "\n")


def _device_facts(devices):
    """What doctor says about the chips: never fails the probe (each fact is optional)."""
    facts = {}
    first = devices[0]
    try:
        stats = first.memory_stats() or {}
        facts["bytes_limit"] = int(stats["bytes_limit"]) if "bytes_limit" in stats else None
        facts["bytes_in_use"] = int(stats["bytes_in_use"]) if "bytes_in_use" in stats else None
    except BaseException:
        pass
    try:
        facts["platform_version"] = str(first.client.platform_version)[:300]
    except BaseException:
        pass
    coords = [list(getattr(d, "coords", None) or []) for d in devices]
    if all(coords):
        facts["bounds"] = [max(c[i] for c in coords) + 1 for i in range(len(coords[0]))]
    cores = [getattr(d, "core_on_chip", None) for d in devices]
    if all(c is not None for c in cores):
        facts["cores_per_chip"] = max(cores) + 1
    try:
        facts["process_count"] = int(__import__("jax").process_count())
    except BaseException:
        pass
    return facts


if __name__ == "__main__":
    main()
