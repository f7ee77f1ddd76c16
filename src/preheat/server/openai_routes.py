"""OpenAI's image routes: ``POST /v1/images/generations`` (JSON) and ``POST /v1/images/edits``
(multipart: ``preheat.server.edits``), each rewritten into the Cog-style input every route
parses (``server.inputs.parse_input``) and answered in OpenAI's shapes: ``{"created", "data":
[{"b64_json"}]}``, errors as ``{"error": {"message", "type", "param"}}`` naming OpenAI's field
(``n``, ``size``).

Its routes are a table of their own (:data:`routes`), which ``preheat.server.app`` includes in
its own; :func:`describe` adds the served model's inputs to these routes' OpenAPI schema. No
``from __future__ import annotations`` here: FastAPI reads the route annotations.
"""

import time
from typing import Any, Literal, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, create_model

from preheat.errors import InputError, NotAccepting, QueueFull
from preheat.families.inputs import IMAGE_SIZE, Image, InputSpec
from preheat.server.core import SHUT_DOWN, Core
from preheat.server.edits import EDITS_PATH, edits_input, edits_openapi
from preheat.server.guard import openai_error
from preheat.server.inputs import (SEED_MAX, FamilyInputs, JsonFloat, JsonInt, Limits, family_model, json_int,
                                   served_sizes, served_specs)
from preheat.server.routing import Routes, State, refusal, wait_completed

__all__ = ["routes", "ImageGenerationRequest", "ImagesResponse", "images_request_model", "describe",
           "OPENAI_FIELDS"]

OPENAI_FIELDS = {"num_outputs": "n", **dict.fromkeys(IMAGE_SIZE, "size")}  # OpenAI's size says both sides


# ---------------------------------------------------------------- request and response bodies
# No docstrings on these: pydantic would put them in the OpenAPI document as descriptions.


class ImageGenerationRequest(BaseModel):
    # OpenAI's body. ``n`` <= the largest batch, and ``seed`` leaves room for seed + i: this app's
    # version of the class states both bounds (images_request_model).
    # OpenAI clients send model/quality/style/user ...: ignored; the served family's own inputs
    # (its declared specs, by their Cog names) are taken as extra fields
    model_config = ConfigDict(extra="allow")
    prompt: Optional[str] = Field(None, max_length=1000)
    n: JsonInt = 1
    size: Optional[str] = Field(None, max_length=32, pattern=r"^(auto|[0-9]{1,5}x[0-9]{1,5})$")
    response_format: Literal["b64_json"] = "b64_json"
    seed: Optional[JsonInt] = None
    # preheat's extra fields, named as on the Cog route (Replicate's flux-dev-lora)
    lora_weights: Optional[str] = Field(None, max_length=2000)
    lora_scale: Optional[JsonFloat] = None  # bounds checked with the Cog input (one place)


# Cog input fields an OpenAI body may carry as extras, by the Cog names: the common inputs a server
# takes that OpenAI's body does not name itself (steps, guidance, scheduler, eta); every other extra
# OpenAI clients send -- model, quality, style, user -- is ignored
_OPENAI_EXTRAS = tuple(s.surface_name for s in served_specs()
                       if s.surface_name not in {*ImageGenerationRequest.model_fields, *OPENAI_FIELDS})


class ImageData(BaseModel):
    b64_json: str


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]

def images_request_model(limits: Limits) -> type[BaseModel]:
    """This app's :class:`ImageGenerationRequest`: ``n`` up to the largest batch, and a ``seed``
    that leaves room for seed + i (so that the OpenAPI document states the real bounds)."""
    return create_model(
        "ImageGenerationRequest", __base__=ImageGenerationRequest,
        n=(json_int(1, limits.max_batch_size), 1),
        seed=(Optional[json_int(0, SEED_MAX - (limits.max_batch_size - 1))], None),
    )


# ---------------------------------------------------------------- the routes


routes = Routes()


@routes.post("/v1/images/generations", summary="OpenAI-style image generation", response_model=None,
             responses={200: {"model": ImagesResponse}, 408: {"description": "The body did not arrive in time"},
                        413: {"description": "Body too large"}, 415: {"description": "Body is not JSON"},
                        422: {"description": "Invalid request"}, 429: {"description": "Queue full; see Retry-After"},
                        503: {"description": "Not ready, or shutting down"}})
async def images_generations(raw_request: Request, state: State, request: ImageGenerationRequest) -> Response:
    core = state.core
    raw: dict[str, Any] = {"num_outputs": request.n, "output_format": "png"}
    if request.prompt is not None:
        raw["prompt"] = request.prompt
    if request.seed is not None:
        raw["seed"] = request.seed
    if request.lora_weights is not None:
        raw["lora_weights"] = request.lora_weights
    if request.lora_scale is not None:
        raw["lora_scale"] = request.lora_scale
    if request.size is not None and request.size != "auto":
        w, h = (int(v) for v in request.size.split("x"))
        raw.update(IMAGE_SIZE.inputs((w, h)))  # the size's fields are its keywords
    inputs = core.family_inputs()  # None until set-up has succeeded (the parse then refuses the call)
    if inputs is not None:  # the family's inputs and the Cog route's step/guidance/sampler
        accepted = {*family_model(inputs.declared).model_fields, *_OPENAI_EXTRAS}
        raw.update({k: v for k, v in (request.model_extra or {}).items() if k in accepted and k not in raw})
    return await openai_run(core, raw, raw_request, inputs)


@routes.post(EDITS_PATH, summary="OpenAI-style image edit (multipart/form-data)", response_model=None,
             openapi_extra=edits_openapi(),
             responses={200: {"model": ImagesResponse}, 408: {"description": "The body did not arrive in time"},
                        413: {"description": "Body too large"}, 415: {"description": "Body is not multipart"},
                        422: {"description": "Invalid request"}, 429: {"description": "Queue full; see Retry-After"},
                        503: {"description": "Not ready, or shutting down"}})
async def images_edits(raw_request: Request, state: State) -> Response:
    core = state.core
    inputs = core.family_inputs()  # None until set-up has succeeded (the parse then refuses the call)
    # the declared inputs are read from the form (one not offered is then refused by the parse, by name)
    declared, served = inputs if inputs is not None else ((), ())
    try:
        raw = await edits_input(raw_request, declared, served)
    except InputError as err:
        field_name, message = err.errors[0]
        return openai_error(422, f"{field_name}: {message}", field_name)
    return await openai_run(core, raw, raw_request, inputs)


async def openai_run(core: Core, raw: dict[str, Any], raw_request: Request, inputs: Optional[FamilyInputs]) -> Response:
    """An OpenAI route's call, as a Cog-style input: parsed (``inputs``: the family's, as the
    route read them), queued, waited for, answered in OpenAI's shapes (errors name OpenAI's
    field: ``n``, ``size``)."""
    try:
        job, given = await core.parse_async(raw, inputs)
    except InputError as err:
        field_name, _ = err.errors[0]
        param = OPENAI_FIELDS.get(field_name, field_name)
        message = err.message(OPENAI_FIELDS)  # the inputs it names by OpenAI's fields too (n, not num_outputs)
        if param == "size":
            sizes = ", ".join(f"{w}x{h}" for w, h in served_sizes(core.pipe, core.limits))
            message = f"size must be one of {sizes}"
        return openai_error(422, f"{param}: {message}", param)
    except NotAccepting as err:
        return refusal(err, openai=True)
    try:
        pred, _ = core.submit(job, given)
    except (QueueFull, NotAccepting) as err:
        return refusal(err, openai=True)
    snap = await wait_completed(core, pred, raw_request)
    if snap is None:
        return openai_error(499, "the client went away")
    if snap["status"] == "failed" and snap["error"] == SHUT_DOWN:  # dropped by a drain: as new requests are
        return openai_error(503, f"the server is shutting down: {SHUT_DOWN}", kind="server_error")
    if snap["status"] != "succeeded":
        return openai_error(500, f"generation {snap['status']}: {snap['error'] or ''}".strip(), kind="server_error")
    data = [{"b64_json": url.partition(",")[2]} for url in snap["output"]]
    return JSONResponse({"created": int(time.time()), "data": data})


# ---------------------------------------------------------------- OpenAPI: the model's own choices


def describe(spec: dict[str, Any], props: dict[str, Any], specs: tuple[InputSpec, ...],
             size_fields: Any, sizes: tuple[tuple[int, int], ...]) -> None:
    """The served model's inputs in these routes' schemas (``props``: the Cog ``Input``'s
    properties of the offered ``specs``, as ``app._describe_model`` builds them): each one an
    extra field of the JSON body and of the edit form, except the size's own fields
    (``size_fields``), which OpenAI's ``size`` says as one ``WxH`` enum of the served ``sizes``."""
    schemas = spec.get("components", {}).get("schemas", {})
    openai = schemas.get("ImageGenerationRequest", {}).get("properties")
    edits = spec.get("paths", {}).get(EDITS_PATH, {}).get("post", {}).get("requestBody", {}).get("content", {})
    edit_form = edits.get("multipart/form-data", {}).get("schema", {}).get("properties")
    for target, own in ((openai, ()), (edit_form, tuple(edit_form or ()))):
        for name, prop in props.items() if target is not None else ():
            if name not in (*size_fields, *own):  # OpenAI's size says both; the form's files stay files
                target[name] = {k: v for k, v in prop.items() if k != "x-order"}
    if edit_form is not None and not any(isinstance(s.type, Image) and s.surface_name == "image" for s in specs):
        edit_form["image"]["description"] = "This server takes no image: every edit is refused (422)."
    if openai is not None:
        openai["size"] = {"anyOf": [{"type": "string", "enum": [*(f"{w}x{h}" for w, h in sizes), "auto"]},
                                    {"type": "null"}], "title": "Size"}
