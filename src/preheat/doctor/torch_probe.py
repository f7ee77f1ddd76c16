"""The torch probe, run by doctor as ``python -m preheat.doctor.torch_probe`` in a fresh process with
a timeout: imports torch, asks for CUDA and, when there is a GPU, computes on it; prints one line
``PREHEAT_DOCTOR_PROBE=<json>``.

It imports nothing of preheat itself (``-m`` runs only the light package ``__init__``s first, which
import neither JAX nor torch), so what it sees is what a new program would see.
"""


def main() -> None:
    import json, sys, time, warnings
    out = {"ok": False}
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import torch
            out["version"] = torch.__version__
            out["cuda_build"] = torch.version.cuda
            out["hip_build"] = getattr(torch.version, "hip", None)
            out["cuda_available"] = bool(torch.cuda.is_available())
            if out["cuda_available"]:
                n = torch.cuda.device_count()
                out["device_count"] = n
                out["devices"] = [torch.cuda.get_device_name(i) for i in range(n)]
                out["capabilities"] = [list(torch.cuda.get_device_capability(i)) for i in range(n)]
                out["arch_list"] = list(torch.cuda.get_arch_list())
                try:
                    x = torch.ones(8, 8, device="cuda")
                    out["result_ok"] = float((x @ x).sum()) == 512.0
                except BaseException as exc:
                    out["compute_error"] = "%s: %s" % (type(exc).__name__, exc)
            out["ok"] = True
        except BaseException as exc:
            out["error"] = "%s: %s" % (type(exc).__name__, exc)
    out["warnings"] = [str(w.message).strip() for w in caught if str(w.message).strip()][:10]
    out["elapsed_s"] = round(time.perf_counter() - t0, 3)
    sys.stdout.write("PREHEAT_DOCTOR_PROBE=" + json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
