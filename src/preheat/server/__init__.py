"""``preheat serve``: an HTTP server that starts hot, batches concurrent requests and speaks
Cog's and OpenAI's APIs.

    preheat.server.inputs   request parsing/validation, shared with the Runpod handler
    preheat.server.core     set-up (load + warm-up), the bounded queue, the worker thread
    preheat.server.warmup   warm-up: every program a request can reach, compiled before READY
    preheat.server.batching which predictions run together, the batch's engine call, its timings
    preheat.server.app      the FastAPI app: Cog's routes, /metrics, the OpenAPI document
    preheat.server.openai_routes  OpenAI's /v1/images/generations and /v1/images/edits
    preheat.server.routing  the route registry and what every route shares (one AppState per app)
    preheat.server.guard    the outermost ASGI layer: auth, body limits, HTTP metrics
    preheat.server.serve    uvicorn with SIGTERM draining

The click commands are ``preheat.cli.serve`` (``preheat serve``, also ``python -m preheat.server``)
and ``preheat.cli.bench`` (``preheat bench serve``, over ``preheat.bench.serve``).

Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client). Nothing is imported here, so
``python -m preheat.server --help`` stays cheap.
"""
