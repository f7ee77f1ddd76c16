"""Adapters that put preheat behind other platforms' worker APIs.

    preheat.integrations.runpod   Runpod serverless handler (``python -m preheat.integrations.runpod``)
    preheat.integrations.ray      Ray Serve deployment (``serve run preheat.integrations.ray:app``,
                                  ``preheat serve --ray``); needs the ``ray`` extra

Each reuses ``preheat.server``'s core (input parsing, batching), never its own copy.
"""
