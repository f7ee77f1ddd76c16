"""`preheat doctor`: name what is wrong with a GPU pod's or a TPU VM's setup, and the exact fix.

``jax.print_environment_info()`` and ``torch.utils.collect_env`` print facts; this package turns the
facts into findings. ``run_checks()`` returns a ``Report`` (a list of ``CheckResult``: status
``ok``/``warn``/``fail``, a one-line finding, and when not ok the command or setting that fixes it).
The click command, ``preheat.cli.doctor``, prints it as a rich table or one JSON object (``--json``).

Where things are:

``runner``       running an external command with a timeout, in its own process group
``smi``          facts from ``nvidia-smi`` and the ``/dev/nvidia*`` device nodes
``tpu_host``     facts of a TPU VM without JAX: PCI ids, device nodes, TPU_* variables, hugepages,
                 libtpu's lockfile and the processes holding a chip
``jax_probe``,   the JAX and torch probes: real modules, run as ``python -m`` in a fresh process
``torch_probe``
``probe``        running a probe and reading its one JSON line back
``dists``        installed distributions and JAX GPU plugins
``context``      the facts shared by checks, and which JAX build fits the driver and GPU
``checks``       the checks, one module per area, registered as ``Check`` objects; ``checks_for``
                 lists those of each platform (cpu, gpu, tpu), told from the host, not from JAX
``report``       gathering the facts and running every check (``run_checks``)
``render``       the rich table

How it is kept safe:

* Nothing here imports JAX or torch. Both are probed in a fresh subprocess (``python -m ...``) with
  a timeout and in its own process group, so a hanging or crashing CUDA plugin cannot hang or kill
  doctor, and XLA/JAX environment variables are read exactly as a new program would read them.
* ``nvidia-smi`` runs under the same timeout. A hung driver shows up as a finding, not a hang.
* Every check runs even when another raises; a check that raises is reported as ``fail`` with its
  error. The command itself never prints a traceback.

Environment variables read by doctor itself:

``PREHEAT_DEV_ROOT``        where to look for ``nvidia*`` device nodes (default ``/dev``).
``PREHEAT_DOCTOR_TIMEOUT``  seconds allowed to each external command (nvidia-smi and the JAX /
                            torch probes). Default: 5 s for nvidia-smi, 20 s for the probes (a
                            first JAX import on a GPU can legitimately take several seconds), 60 s
                            on a TPU VM (the TPU runtime's own start: 9.4 s on a v5e).

Test hooks (used only by tests/doctor; never needed in normal use):

``PREHEAT_DOCTOR_JAX_PROBE``    a command run instead of the built-in JAX probe. It must print one
                                line ``PREHEAT_DOCTOR_PROBE=<json>`` shaped like ``jax_probe``'s.
``PREHEAT_DOCTOR_TORCH_PROBE``  the same for the torch probe (``torch_probe``).
``PREHEAT_DOCTOR_HOST_ROOT``    a folder read in place of ``/`` for ``/sys``, ``/proc`` and ``/tmp``
                                (a fake TPU VM's facts; ``PREHEAT_DEV_ROOT`` stands for ``/dev``).

When a probe hook is set the probe runs even if the package is not installed.
"""

from __future__ import annotations

from preheat.doctor.report import run_checks
from preheat.doctor.results import FAIL, OK, WARN, CheckResult, Report

__all__ = [
    "OK",
    "WARN",
    "FAIL",
    "CheckResult",
    "Report",
    "run_checks",
]
