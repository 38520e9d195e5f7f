"""The latency bench's roofline for a mixture of experts: a batch-1 decode step reads the experts a
token is routed to, not every expert, in kvgen's count and in llama.cpp's count of the file."""

from gguf import GGUFReader

from kvgen import LLM
from kvgen.bench.latency import gguf_matmul_bytes
from tests.loaders.arch_fixtures import arch_checkpoint


def test_a_step_reads_top_k_of_the_experts():
    path = arch_checkpoint("qwen3moe").gguf_q8  # 8 experts, top-2
    tensors = GGUFReader(path).tensors
    dense = sum(int(t.n_bytes) for t in tensors if len(t.shape) == 2 and t.name != "token_embd.weight")
    experts = sum(int(t.n_bytes) for t in tensors if len(t.shape) == 3)
    tied = not any(t.name == "output.weight" for t in tensors)
    embedding = sum(int(t.n_bytes) for t in tensors if t.name == "token_embd.weight") if tied else 0
    assert gguf_matmul_bytes(path) == dense + embedding + experts * 2 // 8

    model = LLM(path, num_kv_blocks=16).engine.model
    report = model.kernels()
    assert model.step_weight_bytes() == sum(s for role, (_, s) in report.items() if role != "experts") + \
        round(report["experts"][1] / 4)
