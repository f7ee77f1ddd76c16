"""Shared fixtures and helpers for the server and integration tests.

The model is a tiny random-weight class-conditional UNet built with preheat's own Flax code
(no torch import), shaped like the built-in digits model: 16x16x1, classes 0..9, null class
10, defaults dpmpp_2m / 4 steps / guidance 2. Its compile cache lives in the session's
private PREHEAT_HOME, which server processes are given too (``server_env``), so they start hot.
No test result depends on what that cache holds (a test that needs a clean one gets its own).

Nothing here waits on a wall-clock window to decide an outcome: batching is held with
``Core.pause``/``resume`` or a :class:`GatedPipe`, and the bounded waits (:func:`wait_until`)
only fail on a hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from preheat.server import process

from tests._support.shared_folders import built_once

REPO = Path(__file__).resolve().parents[2]
DEFAULTS = {"sampler": "dpmpp_2m", "steps": 4, "guidance": 2.0}


@built_once  # written once per run, copied to each caller (tests/_support/shared_folders.py)
def write_tiny_model(out: Path, seed: int = 0) -> Path:
    """Random weights drawn with numpy into the abstract (shape-only) model: no eager Flax init."""
    import numpy as np
    from flax import nnx

    from preheat.models.loading import build_abstract, save_unet
    from preheat.models.unet2d import UNet2DConfig
    from preheat.train.digits import DIGITS_SCHEDULER

    cfg = UNet2DConfig(sample_size=16, in_channels=1, out_channels=1, block_out_channels=(8, 16), layers_per_block=1,
                       down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                       norm_num_groups=4, attention_head_dim=8, num_class_embeds=11)
    rng = np.random.default_rng(seed)
    _, abstract = build_abstract(cfg)
    filled = []
    for path, var in nnx.to_flat_state(abstract):
        shape = tuple(var.shape)
        if len(shape) >= 2:
            value = rng.standard_normal(shape) / np.sqrt(np.prod(shape[:-1]))
        elif str(path[-1]) == "scale":
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = 0.1 * rng.standard_normal(shape)
        filled.append((path, var.replace(value.astype(np.float32))))
    save_unet(cfg, nnx.from_flat_state(filled), out / "unet")
    (out / "scheduler").mkdir(parents=True, exist_ok=True)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(DIGITS_SCHEDULER))
    (out / "model_index.json").write_text(json.dumps(
        {"_class_name": "DDPMPipeline",
         "preheat": {"null_class": 10, "labels": [str(i) for i in range(10)], "defaults": DEFAULTS}}))
    return out


def _private_env(base: Path) -> dict[str, str]:
    return {"PREHEAT_HOME": str(base / "preheat-home"), "PREHEAT_RUNPOD_VOLUME": str(base / "no-runpod-volume"),
            "PREHEAT_WORKSPACE": str(base / "no-workspace")}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("server-model"))


@pytest.fixture(scope="session")
def pipe(model_dir: Path, session_cache_root: None) -> Any:
    import preheat

    return preheat.load(model_dir)  # conftest's session fixture has set the private cache root


@pytest.fixture(scope="session")
def server_env(tmp_path_factory: pytest.TempPathFactory, session_cache_root: None) -> dict[str, str]:
    """The environment of a server process on ``model_dir`` (``ServerProcess(..., env=server_env)``):
    the session's cache root, where ``pipe`` and earlier server processes wrote the programs they
    compiled, so it starts hot (a test body's own root is empty: every server compiled its warm-up
    anew, 3-4x its hot start here). What a test proves never depends on what that root holds."""
    return _private_env(tmp_path_factory.getbasetemp())


def wait_until(predicate: Any, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll ``predicate`` until true; an AssertionError only when it never becomes true (a hang)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class GatedPipe:
    """The real pipeline, but generate() and run() wait for ``gate`` (to hold a batch 'running')."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def hold(self) -> None:
        """Close the gate; ``entered`` is then set by the next engine call (not by warm-up's)."""
        self.entered.clear()
        self.gate.clear()

    def _enter(self) -> None:
        self.entered.set()
        assert self.gate.wait(120)
        if self.fail:
            raise RuntimeError("device lost\nsecond line")

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self._enter()
        return self._pipe.generate(*args, **kwargs)

    def run(self, request: Any, **kwargs: Any) -> Any:
        """A server batch: its requests, validated at parse time, concatenated."""
        self._enter()
        return self._pipe.run(request, **kwargs)


def local_webhooks() -> Any:
    """Webhooks allowed to the tests' receivers on 127.0.0.1 (and nowhere else private)."""
    from preheat.server.webhooks import WebhookPolicy

    return WebhookPolicy(allow=("127.0.0.1",))


class ServerThread:
    """uvicorn serving ``app`` on a free 127.0.0.1 port, in a daemon thread, with the settings
    ``preheat serve`` uses (``preheat.server.serve.uvicorn_config``)."""

    def __init__(self, app: Any, header_timeout_s: Optional[float] = None) -> None:
        import uvicorn

        from preheat.server.serve import HEADER_TIMEOUT_S, bind_socket, uvicorn_config

        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        timeout = HEADER_TIMEOUT_S if header_timeout_s is None else header_timeout_s
        self.server = uvicorn.Server(uvicorn_config(app, log_level="warning", header_timeout_s=timeout))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@contextlib.contextmanager
def serving(core: Any, header_timeout_s: Optional[float] = None, **app_kwargs: Any) -> Iterator[ServerThread]:
    from preheat.server.app import create_app

    server = ServerThread(create_app(core, **app_kwargs), header_timeout_s=header_timeout_s)
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def served_core(config: Any, pipe: Any = None, setup_s: float = 900.0) -> Iterator[tuple[Any, ServerThread]]:
    """A Core for ``config`` (on ``pipe``, or loading the model itself), set up (warm-up done) and
    served on 127.0.0.1: (the core, its server); closed after."""
    from preheat.server.core import Core

    core = Core(config, pipe=pipe).start()
    try:
        assert core.wait_setup(setup_s) and core.setup.status == "succeeded", core.setup.logs
        with serving(core) as srv:
            yield core, srv
    finally:
        core.close()


@contextlib.contextmanager
def started_server(config: Any, pipe: Any, setup_s: float = 600.0) -> Iterator[ServerThread]:
    """A Core for ``config`` on ``pipe``, set up (warm-up done), served on 127.0.0.1; closed after."""
    with served_core(config, pipe, setup_s) as (_, srv):
        yield srv


def wait_status(client: Any, want: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get("/health-check").json()
        if body["status"] == want:
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"health-check never said {want}: {body}")
        time.sleep(0.05)


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample's value from Prometheus text (0.0 when absent)."""
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+\-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


class ServerProcess(process.ServerProcess):
    """``python -m preheat.server ARGS`` on a free 127.0.0.1 port, on the CPU, started (its port known)."""

    def __init__(self, args: list[str], env: Optional[dict[str, str]] = None) -> None:
        super().__init__([*args, "--port", "0", "--host", "127.0.0.1", "--log-level", "warning"],
                         env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})), cwd=REPO)
        try:
            self.wait_port(120)
        except RuntimeError:
            self.kill()
            raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def session_cache_root(tmp_path_factory):
    """Session fixtures (the pipeline, cores warming up in threads) run outside the per-test
    private cache root of tests/conftest.py; give them the same root for the whole session."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _private_env(tmp_path_factory.getbasetemp()).items():
            mp.setenv(key, value)
        yield


def runpod_jobs(core: Any, *jobs: dict) -> list[dict]:
    """Each Runpod ``job`` through ``preheat.integrations.runpod.handler``, served by ``core``."""
    import asyncio

    import preheat.integrations.runpod as rp

    rp.get_core(core)
    try:
        return [asyncio.run(rp.handler(job)) for job in jobs]
    finally:
        rp._core = None


def openai_image(body: dict) -> Any:
    """The one image of an OpenAI images response (b64_json PNG) as uint8 HWC."""
    from preheat.server.images import decode_data_url

    (item,) = body["data"]
    return decode_data_url("data:image/png;base64," + item["b64_json"])


def cli_on(monkeypatch: pytest.MonkeyPatch, folder: Path, pipe: Any) -> None:
    """`preheat sample FOLDER --cache off` gets the pipeline this test loaded from FOLDER with
    cache="off": one load and compile per family here (the CLI's own load of a folder is
    tests/families/test_stable_diffusion.py's, tests/test_random_models.py's and test_lora.py's)."""
    import preheat

    def load(model: Any, **options: Any) -> Any:
        assert Path(model) == folder and options["cache"] == "off" and options["backend"] == "jax", (model, options)
        return pipe

    monkeypatch.setattr(preheat, "load", load)


def cli_family(monkeypatch: pytest.MonkeyPatch, tmp_dir: Path, folder: Path, pipe: Any, *size: str) -> str:
    """`preheat sample FOLDER --prompt ... --report R` on ``pipe`` (:func:`cli_on`): the family its
    report names (``size``: ``--width``/``--height`` flags, where the default size is not served)."""
    import json

    from click.testing import CliRunner

    from preheat.cli import main

    cli_on(monkeypatch, folder, pipe)
    out, report = tmp_dir / "a.png", tmp_dir / "r.json"
    result = CliRunner().invoke(main, ["sample", str(folder), "--prompt", "a red fox", "--steps", "2", "--n", "1",
                                       *size, "--cache", "off", "--out", str(out), "--report", str(report)])
    assert result.exit_code == 0, result.output
    return json.loads(report.read_text())["family"]
