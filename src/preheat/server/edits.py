"""OpenAI's ``POST /v1/images/edits``: a multipart form -> the Cog-style input every route parses.

Fields, as OpenAI names them: ``image`` (a file; or an http(s) URL / data URI as text), ``mask``,
``prompt``, ``n``, ``size``, ``response_format`` (``b64_json``), ``seed``; the served family's
other declared inputs by their Cog names (``strength``, ``negative_prompt`` ...) and the common
inputs a server takes (``num_inference_steps``, ``guidance_scale``, ``scheduler``, ``eta``,
``lora_weights`` ...: ``server.inputs.served_specs``), each typed by its declaration
(``InputSpec.type.from_text``). Other fields OpenAI clients send (``model``,
``quality``, ``user`` ...) are ignored.

The mask. OpenAI's convention is *transparent = edit*: the mask is a PNG whose fully transparent
pixels (alpha 0) are repainted, every other pixel kept. preheat's (diffusers') is *white =
repaint*. So ``mask``'s alpha 0 becomes white (255) and any other alpha black (0)
(``preheat.image_input.transparent_mask``); a mask without transparency is refused (it would
say "keep everything"). With no ``mask``, an ``image`` that has transparent pixels is its own
mask, as OpenAI's ``dall-e-2`` reads it -- when the served model takes a mask; otherwise, and
for an opaque image, the call is image-to-image.
"""

from __future__ import annotations

import base64
from typing import Any, Sequence

from preheat.errors import InputError, InvalidArgumentError

__all__ = ["EDITS_PATH", "edits_input", "edits_openapi"]

EDITS_PATH = "/v1/images/edits"
_OPENAI = ("image", "mask", "prompt", "n", "size", "response_format")


def _png_uri(pixels: Any) -> str:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _data_uri(data: bytes) -> str:
    return "data:application/octet-stream;base64," + base64.b64encode(data).decode()  # read_image reads the header


def _typed(name: str, text: str, kind: Any) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise InputError([(name, f"{text[:100]!r} is not {'an int' if kind is int else 'a number'}")]) from None


async def edits_input(request: Any, specs: Sequence[Any], offered: Sequence[Any] = ()) -> dict[str, Any]:
    """The form of ``request`` -> a Cog-style input (``specs``: the served family's declared
    inputs, ``offered``: those the server takes; () before set-up, when parsing refuses the call
    anyway). An image's transparency is its mask only where a mask is offered. Raises ``InputError``."""
    from preheat.families.inputs import IMAGE_SIZE, Image
    from preheat.image_input import transparent_mask
    from preheat.server.inputs import served_specs

    form = await request.form(max_files=4, max_fields=64)
    raw: dict[str, Any] = {"output_format": "png"}
    files: dict[str, bytes] = {}
    for name in ("image", "mask"):
        value = form.get(name)
        if value is None or isinstance(value, str):
            if value:
                raw[name] = value  # a URL or a data URI: parsed as on the Cog route
            continue
        files[name] = await value.read()
    if "image" not in files and "image" not in raw:
        raise InputError([("image", "required: the image to edit (a file)")])
    takes_mask = any(s.surface_name == "mask" and isinstance(s.type, Image) for s in offered)
    try:
        if "mask" in files:
            mask = transparent_mask(files["mask"], "mask")
            if mask is None:
                raise InputError([("mask", "has no transparent pixels: its fully transparent pixels (alpha 0) are "
                                           "what to edit")])
            raw["mask"] = _png_uri(mask)
        elif "image" in files and "mask" not in raw and takes_mask:
            mask = transparent_mask(files["image"], "image")
            if mask is not None and mask.any():
                raw["mask"] = _png_uri(mask)
    except InvalidArgumentError as err:
        raise InputError([(err.argument or "image", str(err))]) from None
    if "image" in files:
        raw["image"] = _data_uri(files["image"])
    text = {k: v for k, v in form.items() if isinstance(v, str)}
    if text.get("response_format", "b64_json") != "b64_json":
        raise InputError([("response_format", "only b64_json is served (the image comes back in the response)")])
    raw["num_outputs"] = _typed("n", text.get("n", "1"), int)
    if text.get("prompt"):
        raw["prompt"] = text["prompt"]
    size = text.get("size", "auto")
    if size != "auto":
        w, sep, h = size.partition("x")
        if not (sep and w.isdigit() and h.isdigit()) or len(size) > 11:
            raise InputError([("size", f"{size[:32]!r} must be WIDTHxHEIGHT or auto")])
        raw.update(IMAGE_SIZE.inputs((int(w), int(h))))  # the size's fields are its keywords
    typed = {**{s.surface_name: s for s in served_specs()},  # the common inputs (num_outputs is OpenAI's n)
             **{s.surface_name: s for s in specs if not isinstance(s.type, Image) and s.name not in IMAGE_SIZE}}
    for name, value in text.items():
        if name in _OPENAI or name in raw or name not in typed:
            continue
        try:
            raw[name] = typed[name].type.from_text(name, value)
        except InvalidArgumentError as err:
            raise InputError([(name, str(err))]) from None
    return raw


def edits_openapi() -> dict[str, Any]:
    """The route's request body in the OpenAPI document (the form is read by hand, so that a bad
    field is an OpenAI-shaped 422); the served family's fields are added once it is known."""
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
        "title": "ImageEditRequest", "type": "object", "required": ["image"], "properties": {
            "image": {"type": "string", "format": "binary", "description": "The image to edit (PNG, JPEG or WebP)."},
            "mask": {"type": "string", "format": "binary", "description":
                     "A PNG of the image's size whose fully transparent pixels (alpha 0) are repainted; every "
                     "other pixel is kept (mapped to preheat's white = repaint)."},
            "prompt": {"type": "string", "maxLength": 1000},
            "n": {"type": "integer", "minimum": 1, "default": 1},
            "size": {"type": "string", "pattern": "^(auto|[0-9]{1,5}x[0-9]{1,5})$"},
            "response_format": {"type": "string", "enum": ["b64_json"], "default": "b64_json"},
            "seed": {"type": "integer", "minimum": 0},
        }}}}}}
