"""Serving beyond one engine: data-parallel replicas (Ray actors) behind a cache-aware router,
and several models behind one OpenAI endpoint. See docs/scaling.md."""
