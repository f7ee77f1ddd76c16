"""Adapters that put preheat behind other platforms' worker APIs.

    preheat.integrations.runpod   Runpod serverless handler (``python -m preheat.integrations.runpod``)

Each reuses ``preheat.server``'s core (input parsing, batching), never its own copy.
"""
