"""Tensor parallelism on torch.distributed (Megatron layout): one model across processes, GPUs and
machines. See docs/tensor_parallel.md. Which slice of each weight a rank holds (ShardPlan) is the
loaders' to say (kvgen/loaders/shard.py), since each rank loads only its own slices.

    layers.py    the collectives of a sharded model (row-parallel all-reduce, vocab-parallel layers)
    group.py     the process group, its collectives and timeouts (DistributedError)
    messages.py  a step's tensors, sent from rank 0 with a fixed header
    executor.py  rank 0's executor (TensorParallelExecutor): the engine hands it each step
    worker.py    a worker rank's loop
    liveness.py  who watches whom
    launch.py    starting the workers, or joining torchrun's group
    process.py   a worker's process: a fresh interpreter that never imports the caller's main script
"""
