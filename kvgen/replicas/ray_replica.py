"""Replicas as Ray actors on a Ray cluster's nodes: `kvgen serve --ray-address ADDR --data-parallel-size N`.

Ray places and runs the replicas; the front end stays one process (the Ray driver). One placement
group holds a bundle of `threads` CPUs per replica with the SPREAD strategy: one replica per node
while there are nodes, then packed onto the nodes with CPUs left. Each replica is an actor in its
own bundle whose one long call, `run`, is kvgen.replicas.replica.run_replica: it builds the engine
on the actor's node and connects back to the front end over TCP (multiprocessing.connection with
the launcher's auth key), the same loop and messages as a local replica (kvgen.replicas.launch).
Tokens stream over that connection rather than through Ray's object store, as vLLM's Ray
data-parallel backend streams over ZMQ: one message per engine step, and an actor that dies is
seen at once, as its connection closing. A dead actor is not restarted by Ray (max_restarts=0): the
front end starts a new one in the same bundle, as it restarts a local replica.

`ADDR`: `local` starts a private single-machine Ray instance with the server and stops it with it;
`auto` joins the cluster started on this machine with `ray start --head`; anything else is handed
to ray.init (`HOST:PORT` of the head's GCS, or `ray://HOST:10001`). Each node imports its own
installed kvgen (the same version) and reads the model from the same path.
"""

from __future__ import annotations

import os
import secrets
from multiprocessing.connection import Listener

from kvgen.errors import KVGenError
from kvgen.replicas.launch import REPLICA_ENV, SpawnArgs, replica_marker
from kvgen.replicas.replica import run_replica

PLACEMENT_TIMEOUT_S = 60.0
LOCAL_OBJECT_STORE_BYTES = 128 * 2**20  # the replicas pass nothing through it; Ray's floor is ~75 MiB
# Settings the replica's libraries read as they load (kvgen.threads), passed on to every actor.
PASSED_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")


def import_ray():  # noqa: ANN201 - the ray module
    try:
        import ray
    except ImportError:
        raise KVGenError("--ray-address needs Ray: pip install 'kvgen[ray]'") from None
    return ray


class ReplicaActor:
    """The Ray actor (made remote by RayLauncher): one call, `run`, for the replica's whole life."""

    def run(self, index: int, address: tuple[str, int], authkey: bytes, threads: int, *spawn_args) -> None:
        """The replica's life; then the actor's process ends too (the front end said close, or it is
        gone: an idle actor would otherwise hold its CPUs until Ray noticed its owner's end)."""
        import ray

        run_replica(index, address, authkey, threads, *spawn_args)
        ray.actor.exit_actor()


class RayReplica:
    """One replica actor and its running `run` call."""

    def __init__(self, actor, ref) -> None:  # noqa: ANN001 - Ray's ActorHandle and ObjectRef
        self.actor, self.ref = actor, ref

    def exit_status(self) -> str | None:
        ray = import_ray()
        if not ray.is_initialized():  # the front end has closed: every actor is gone
            return "Ray is shut down"
        done, _ = ray.wait([self.ref], timeout=0)
        if not done:
            return None
        try:
            ray.get(self.ref)
            return "it returned"
        except ray.exceptions.RayError as error:
            return f"Ray: {type(error).__name__}"

    def join(self, timeout: float) -> None:
        ray = import_ray()
        if ray.is_initialized():
            ray.wait([self.ref], timeout=timeout)

    def terminate(self) -> None:
        self.kill()  # an actor busy in `run` takes no other call: a polite stop is the ("close",) message

    def kill(self) -> None:
        ray = import_ray()
        if ray.is_initialized():
            ray.kill(self.actor, no_restart=True)


class RayLauncher:
    """Replicas as actors on the Ray cluster at `address`, `threads_per_replica` CPUs each (default:
    the cluster's CPUs / N)."""

    def __init__(self, address: str, num_replicas: int, threads_per_replica: int | None,
                 spawn_args: SpawnArgs) -> None:
        ray = import_ray()
        if num_replicas < 1:
            raise KVGenError(f"--data-parallel-size must be at least 1, got {num_replicas}")
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            _connect(ray, address)
        self.spawn_args = spawn_args
        self.pg = None
        try:
            cpus = int(ray.cluster_resources().get("CPU", 0))
            self.threads = threads_per_replica or max(cpus // num_replicas, 1)
            if self.threads < 1:
                raise KVGenError(f"--threads-per-replica must be at least 1, got {self.threads}")
            if num_replicas * self.threads > cpus:
                raise KVGenError(f"{num_replicas} replicas x {self.threads} CPUs need {num_replicas * self.threads} "
                                 f"CPUs, but the Ray cluster at {address} has {cpus}")
            self.pg, self.placements = _place(ray, num_replicas, self.threads)
            self.authkey = secrets.token_bytes(32)
            self.listener = Listener((ray.util.get_node_ip_address(), 0), "AF_INET", authkey=self.authkey)
        except BaseException:
            self.close()
            raise
        self._actor = ray.remote(ReplicaActor)

    def start(self, index: int) -> RayReplica:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        env = {k: os.environ[k] for k in os.environ if k.startswith("KVGEN_") or k in PASSED_ENV}
        env |= {"OMP_NUM_THREADS": str(self.threads), "OPENBLAS_NUM_THREADS": str(self.threads),
                REPLICA_ENV: replica_marker(index)}
        actor = self._actor.options(
            num_cpus=self.threads, max_restarts=0, runtime_env={"env_vars": env},
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index),
        ).remote()
        ref = actor.run.remote(index, self.listener.address, self.authkey, self.threads, *self.spawn_args)
        return RayReplica(actor, ref)

    def close(self) -> None:
        ray = import_ray()
        if getattr(self, "listener", None) is not None:
            self.listener.close()
        if self.pg is not None and ray.is_initialized():
            ray.util.remove_placement_group(self.pg)
        if self._owns_ray:
            ray.shutdown()


def _connect(ray, address: str) -> None:  # noqa: ANN001
    if address == "local":
        ray.init(address="local", num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False,
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, logging_level="warning")
        return
    try:
        ray.init(address=address, logging_level="warning")
    except (ConnectionError, ValueError) as error:
        hint = "" if os.environ.get("RAY_AUTH_MODE") else " (with token authentication: RAY_AUTH_MODE=token)"
        raise KVGenError(f"cannot join the Ray cluster at {address}: {str(error).splitlines()[0]}{hint}") from None


def _place(ray, num_replicas: int, threads: int):  # noqa: ANN001, ANN202 - (PlacementGroup, placements)
    """A placement group of one `threads`-CPU bundle per replica, spread over the nodes; each
    bundle's node as "Ray node IP"."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    pg = placement_group([{"CPU": threads}] * num_replicas, strategy="SPREAD")
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        free = {n["NodeManagerAddress"]: n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]}
        raise KVGenError(f"Ray could not place {num_replicas} replicas x {threads} CPUs within "
                         f"{PLACEMENT_TIMEOUT_S:.0f} s (CPUs per node: {free})") from None
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    return pg, [f"Ray node {ips.get(nodes[i], nodes[i])}, {threads} CPUs" for i in range(num_replicas)]
