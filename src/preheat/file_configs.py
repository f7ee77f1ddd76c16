"""The config folder a single checkpoint file is read with (``preheat.models.single_file``).

A single ``.safetensors`` file of an original layout (or a FLUX.1 transformer's ``.gguf``) holds
some of a pipeline's components; the rest (configs, tokenizers, and for a transformer-only file its
VAE and text encoders) come from ``config=``: a diffusers folder or source, a folder of only the
components the file lacks, a published model's name, or nothing (the published model inferred from
the file's header). For the
last two, exactly the folders the file lacks are pulled from the published repository through the
weights store, once, and kept beside the shipped configs (``preheat.models.published``).

    single_file_config(file, config)   the folder to read ``file`` with (pulling what it lacks)
    single_file_plan(file, config)     what that would pull: ``preheat pull --dry-run FILE``
    single_file_head(plan, into)       a remote single file's header alone (``pull --dry-run hf://org/repo/f.gguf``)
    converted_folder(model, root, config, variant, check)
                                       the converted diffusers folder both backends load (one
                                       conversion under the cache root, whichever backend asks)
    plain_tensors(file)                refuses a scaled fp8 file for diffusers' loader
    gguf_source(root, config, variant, compile)
                                       a GGUF file as diffusers users load it (the torch backend):
                                       the file and the config folder, its GGML types and the
                                       compile mode checked (``aot`` is refused)
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, NamedTuple, NoReturn

from preheat.errors import FetchError, InvalidArgumentError, ModelError

if TYPE_CHECKING:
    from preheat.models.published import Needed
    from preheat.store import HfPlan

__all__ = ["Converted", "GGUFSource", "converted_folder", "gguf_source", "plain_tensors", "refuse_gguf_aot", "single_file_config",
           "single_file_head", "single_file_plan"]


def _published_needs(file: Path, config: str | Path | None) -> Needed | None:
    """What single ``file`` needs from its published repository when ``config`` is None (the model
    inferred) or names a published model (``published.named``); None when ``config`` is a folder or
    source to read the file with. A GGUF file (a FLUX.1 transformer's) is inferred like a
    safetensors one, from its header; one of no published model is one line asking for ``config``."""
    from preheat.errors import ModelFormatError
    from preheat.models.gguf_file import is_gguf
    from preheat.models.published import file_shapes, infer, named, needed

    as_model = None if config is None or Path(str(config)).exists() else named(config)
    if config is not None and as_model is None:
        return None
    if as_model is None and is_gguf(file):
        shapes = file_shapes(file)  # a torn file, a type preheat does not read: their own one line
        try:
            infer(shapes, str(file))
        except ModelFormatError:
            raise InvalidArgumentError(f"{file} is a GGUF file (a transformer's weights, no configs) of no published "
                                       "model preheat infers: pass config=<the model's diffusers folder>",
                                       argument="config") from None
    return needed(file, as_model)  # a file of no published model: one line naming every model tried


@contextlib.contextmanager
def _fetching(file: Path, needs: Needed) -> Iterator[str]:
    """The published repository's source; a fetch that fails (offline, unreachable, gated, a folder
    it lacks) is one line naming the folders and how to pass ``config=`` instead."""
    source = f"hf://{needs.published.repo}"
    try:
        yield source
    except (FetchError, ModelError) as exc:
        folders = ", ".join(c + "/" for c in needs.components)
        raise FetchError(f"{file} is a {needs.published.title} single file; it needs {folders} from {source}, which "
                         f"could not be fetched ({exc}); or pass config=<a folder holding {folders}, or "
                         f"{needs.hint}>") from None


def single_file_config(file: Path, config: str | Path | None, variant: str | None = None) -> Path:
    """The config folder single ``file`` is read with (``preheat.models.single_file``).

    ``config``: a diffusers folder or source (its configs and tokenizers); a folder holding only
    the components the file lacks (``preheat.models.published.with_components``); a published
    model's name or repository (``published.named``: ``"stable-diffusion-2-1-base"``); or None:
    the model inferred from the file's header. For the last two, exactly the folders the file lacks
    (``published.needed``: its tokenizers; a transformer file's VAE and text encoders too) are
    pulled from the published repository through the weights store, once, and put beside the
    shipped configs.
    """
    from preheat.cache.root import resolve_root
    from preheat.models.published import needed, with_components
    from preheat.store import resolve

    needs = _published_needs(file, config)
    if needs is None:
        configs = Path(resolve(str(config), variant=variant))
        if configs.is_dir() and not (configs / "model_index.json").is_file():  # the lacking folders only
            return with_components(file, configs, resolve_root().path, needed(file))
        return configs
    with _fetching(file, needs) as source:
        fetched = resolve(source, variant=variant, components=needs.components)
    return with_components(file, fetched, resolve_root().path, needs)


def single_file_plan(file: Path, config: str | Path | None = None, variant: str | None = None) -> tuple[HfPlan, Needed]:
    """What ``single_file_config`` would pull for ``file`` (the store's plan: files and bytes, no
    download; ``preheat pull --dry-run FILE``), and why."""
    from preheat.store import plan_pull

    needs = _published_needs(file, config)
    if needs is None:
        raise InvalidArgumentError(f"config={config} is a folder or source to read {file} with: nothing is "
                                   "pulled for it", argument="config")
    with _fetching(file, needs) as source:
        return plan_pull(source, variant=variant, components=needs.components), needs


_FIRST_READ = 1 << 20  # a header's first fetch (a FLUX.1 GGUF's is about 100 KB); each next one 8x as much


def single_file_head(plan: HfPlan, into: Path) -> Path:
    """A stand-in for a one-file hf:// plan's file (``hf://org/repo/flux1-dev-Q8_0.gguf``) under
    ``into``: a sparse file of its size holding its header's bytes (HTTP Range requests, the first
    1 MiB, then 8x more until the header is whole) and zeros after, which ``file_shapes`` and
    ``single_file_plan`` read as the file, so a dry run lists what it lacks without fetching its
    tensors."""
    from preheat.store import fetch_head

    (file,) = [f for f in plan.files if f.path == plan.source.filename]
    head = into / Path(file.path).name
    want = min(file.size, _FIRST_READ)
    while True:
        data = fetch_head(plan, want)
        with open(head, "wb") as out:
            out.write(data)
            out.truncate(file.size)  # sparse: no disk for the tensors
        if len(data) >= file.size or _header_within(head, len(data)):
            return head
        want = min(file.size, want * 8)


def _header_within(path: Path, fetched: int) -> bool:
    """Whether single file ``path``'s header lies in its first ``fetched`` bytes (the rest zeros):
    a safetensors file's length prefix says so; a GGUF file's tensor data starts after it (a header
    cut short reads on into the zeros, past ``fetched``). Without the gguf extra a GGUF header
    cannot be read, so nothing more is fetched: the dry run then lists the file alone, as ``pull``
    stores it."""
    from preheat.models.gguf_file import is_gguf

    if not is_gguf(path):
        with open(path, "rb") as f:
            return 8 + int.from_bytes(f.read(8), "little") <= fetched
    try:
        from gguf import GGUFReader
    except ModuleNotFoundError:
        return True
    try:
        return int(GGUFReader(str(path)).data_offset) <= fetched
    except (ValueError, OSError, IndexError, KeyError):  # cut inside a field: more is needed
        return False


class Converted(NamedTuple):
    """A single file (or ``config=`` folder) as the diffusers folder a backend loads."""

    root: Path  # the converted folder under <cache root>/models/single/ (no variants: its files have default names)
    reading: ContextManager[None]  # around loading it: a misfit names the file, and the conversion is dropped


def converted_folder(model: Any, root: Path, config: str | Path | None, variant: str | None,
                     check: Callable[[Path], None] | None = None) -> Converted | None:
    """``root`` (the resolved ``model``) read as a diffusers folder when it is a single file or a
    ``config=`` is given; None for a folder given without ``config``. Both backends call this, so a
    file is converted once (``preheat.models.single_file.materialize``) and both read that folder.

    ``check(file)`` runs on the single file before anything is pulled or converted: a backend
    that cannot read some files (the torch backend: scaled fp8 ones) refuses them here, in one line.
    """
    from preheat.cache.root import resolve_root
    from preheat.models.single_file import materialize, reading_converted, single_file_path
    from preheat.store import resolve

    single = single_file_path(root)  # a .safetensors or .gguf file (or a one-file snapshot of the store)
    if single is None and config is None:
        return None
    if single is not None and check is not None:
        check(single)
    if single is not None:
        configs = single_file_config(single, config, variant)
    else:
        configs = Path(resolve(str(config), variant=variant))
    converted = materialize(root, configs, resolve_root().path, variant)  # converted once, then reused
    return Converted(converted, reading_converted(model, config if config is not None else configs, converted))


def plain_tensors(file: Path) -> None:
    """Refuse a single file that diffusers' ``from_pretrained`` would misread once renamed (the
    torch backend's ``check``). ComfyUI's scaled fp8 converts to fp8 weights beside their scales,
    which only the JAX engine's loader multiplies back (``preheat.models.scaled_fp8``); diffusers
    has no loader for such files and would take the bare fp8 values as the weights, so the file is
    one line instead. (A GGUF file never gets here: ``gguf_source`` reads it as diffusers does.)
    Reads the header only."""
    from preheat.errors import UnsupportedConfigError
    from preheat.models.scaled_fp8 import MARKER, weight_scales
    from preheat.models.safetensors_files import read_tensors

    with read_tensors([file]) as tensors:
        keys = list(tensors)
    scaled = weight_scales(dict.fromkeys(keys))
    if not scaled and not any(k == MARKER or k.endswith("." + MARKER) for k in keys):
        return
    raise UnsupportedConfigError(f"{file} is a scaled fp8 file ({len(scaled)} weights beside their scale_weight); "
                                 "the torch backend reads single files of plain tensors or GGUF only (diffusers has "
                                 "no loader for scaled fp8): use the JAX backend (backend='jax', --backend jax), "
                                 "which keeps it quantised on the device")


class GGUFSource(NamedTuple):
    """A GGUF transformer file as diffusers users load it: ``from_single_file(file, config=configs,
    quantization_config=GGUFQuantizationConfig(...))`` for the denoiser, ``configs`` for the rest."""

    file: Path  # the .gguf file (a one-file snapshot's file for hf://org/repo/file.gguf)
    configs: Path  # a diffusers folder: the denoiser's config, the VAE, text encoders, tokenizers, scheduler


def gguf_source(root: Path, config: str | Path | None, variant: str | None, compile: str = "none") -> GGUFSource | None:
    """``root`` as a GGUF file for diffusers' GGUF loader (the torch backend), None for anything
    else. Its tensors' GGML types are checked first (the header only): one diffusers cannot
    dequantise is one line naming it, before anything is pulled; so is ``compile="aot"``
    (``_compiles``). ``config`` is what ``single_file_config`` takes (None: the published model
    inferred, what it lacks pulled)."""
    from preheat.models.gguf_file import is_gguf
    from preheat.models.single_file import single_file_path

    single = single_file_path(root)
    if single is None or not is_gguf(single):
        return None
    _compiles(single, compile)
    _diffusers_reads(single)
    return GGUFSource(single, single_file_config(single, config, variant))


def _compiles(file: Path, compile: str) -> None:
    """Refuse the torch compile mode a GGUF denoiser cannot take, in one line (``refuse_gguf_aot``).
    ``inductor`` and ``regional`` trace diffusers' GGUF Linear as it runs (each weight dequantised
    where it is used; the image is the eager one's to a level of 255:
    ``tests/backends/test_torch_gguf.py``)."""
    if compile == "aot":
        refuse_gguf_aot(f"{file} is a GGUF file", "compile",
                        "compile='regional' or 'inductor', which trace the dequantisation, or 'none'")


def refuse_gguf_aot(what: str, option: str, instead: str) -> NoReturn:
    """The one refusal of AOT export for GGUF weights: ``preheat.load(file.gguf, backend="torch",
    compile="aot")`` (``_compiles``, from the file) and ``preheat.torch.compile(pipe, mode="aot")``
    on a denoiser holding diffusers' ``GGUFParameter`` s (``backends.torch.compiled``). ``aot``
    exports the blocks with ``torch.export``, which lifts each weight out as a plain tensor of its
    packed bytes, without the quantisation type diffusers dequantises by, so the first call failed
    inside the export on a shape (``[1, 32] X [34, 192]`` for a Q8_0 weight)."""
    from preheat.errors import UnsupportedConfigError

    raise UnsupportedConfigError(f"{what}: {option}='aot' cannot export its quantised weights (torch.export takes "
                                 "each as a plain tensor of its packed bytes, not the GGUF type diffusers "
                                 f"dequantises by); use {instead}")


def _diffusers_reads(file: Path) -> None:
    """One ``UnsupportedConfigError`` naming the first tensor of a GGML type diffusers' GGUF loader
    has no dequantiser for (``SUPPORTED_GGUF_QUANT_TYPES``, plus the plain F32 and F16)."""
    from preheat.errors import MissingExtraError, ModelFormatError, UnsupportedConfigError

    try:
        from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES
        from gguf import GGMLQuantizationType, GGUFReader
    except ModuleNotFoundError as exc:
        raise (MissingExtraError.of(exc, f"reading the GGUF file {file}") or exc) from None
    try:
        tensors = GGUFReader(str(file)).tensors
    except (ValueError, OSError, IndexError) as exc:  # a bad magic, a torn file
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelFormatError(f"cannot read {file} as GGUF: {reason[:160]}") from None
    readable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *SUPPORTED_GGUF_QUANT_TYPES}
    for tensor in tensors:
        if tensor.tensor_type not in readable:
            names = ", ".join(sorted(t.name for t in readable))
            raise UnsupportedConfigError(f"{file}: {tensor.name} is GGUF type {tensor.tensor_type.name}, which "
                                         f"diffusers' GGUF loader (the torch backend) cannot dequantise; it reads "
                                         f"{names}")
