"""The KV core: the machinery that the two KV faces, ``hixl.kv`` (hixl's own KV API) and
``hixl.llm_datadist`` (the LLM-DataDist compatible one), share. Private: each face keeps its
own names and error types and maps the core's ``HixlError``s onto them.

- ``_window``: the executor, a bounded window of requests in flight on one engine.
"""
