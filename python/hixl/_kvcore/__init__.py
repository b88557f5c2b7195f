"""The KV core: the machinery that the two KV faces, ``hixl.kv`` (hixl's own KV API) and
``hixl.llm_datadist`` (the LLM-DataDist compatible one), share. Private: each face keeps its
own names and error types and maps the core's ``HixlError``s onto them.

- ``_plan``: the planner's primitives (block runs, their bytes, requests' pieces, the
  descriptor array).
- ``_window``: the executor, a bounded window of requests in flight on one engine.
- ``_layers``: the layerwise engine, layers sent as they become ready.
- ``_links``: linking several peers at once.
- ``_notify``: the notification router, taking a face's own names from its engine (by
  asking, or on a serving loop) and leaving the application's there.
"""
