"""Data-parallel serving on one machine: `kvgen serve --data-parallel-size N` runs N engine processes,
each with its own KV pool and cores, behind the one OpenAI-compatible front end.

    replica.py   the replica process: an engine and a small request loop over a local socket
    router.py    which replica serves a request (prefix-aware, or round-robin)
    frontend.py  ReplicaSet: AsyncLLM's interface over the replicas, restarts, per-replica /metrics
"""
