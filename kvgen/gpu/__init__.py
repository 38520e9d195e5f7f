"""kvgen on CUDA: Triton paged attention over the KV block pools, CUDA graphs for decode steps.

Nothing here is imported on a CPU run: the engine reaches these modules only when the model sits on a
CUDA device (`kvgen.gpu.backend.gpu_runner`), and the kernels' tests run them on the CPU under
Triton's interpreter (`TRITON_INTERPRET=1`). `graph_ladder` is plain Python and imports no torch.

    triton_attention  the kernels: KV store by slot mapping, paged decode, paged prefill
    backend           TritonPagedAttention: PagedAttention whose store and attention run the kernels
    graph_ladder      the batch sizes decode graphs are captured at, and the padding to them
    graphs            capture and replay of pure-decode steps (CUDA only)
"""
