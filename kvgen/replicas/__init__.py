"""Data-parallel serving: `kvgen serve --data-parallel-size N` runs N engine processes, each with its
own KV pool and cores, behind the one OpenAI-compatible front end; on this machine, or with
`--ray-address` as Ray actors on a cluster's nodes.

    replica.py      the replica: an engine and a small request loop over a socket to the front end
    launch.py       where replicas run: the launcher interface, and local processes pinned to cores
    ray_replica.py  the Ray launcher: replicas as actors in a placement group spread over the nodes
    router.py       which replica serves a request (prefix-aware, or round-robin)
    admission.py    what the front end checks a request against before routing it
    frontend.py     ReplicaSet: AsyncLLM's interface over the replicas, restarts, the readings /metrics reports
"""
