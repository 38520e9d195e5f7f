"""A step's layout of the state pool (kvgen.runner.state_batch): each sequence's slot and rows in the
order the runner laid the step out, decodes first and batched, a checkpoint row per verify chunk."""

import torch

from kvgen import SamplingParams
from kvgen.cache.state_pool import StatePool
from kvgen.config import RecurrentShape
from kvgen.loaders.llama2c import load_llama2c_tokenizer
from kvgen.runner.state_batch import step_states
from kvgen.scheduling.output import ScheduledChunk
from kvgen.scheduling.sequence import Request


def test_decodes_come_first_then_verify_and_prompt_chunks_with_their_rows(stories_dir):
    tokenizer = load_llama2c_tokenizer(stories_dir / "tok512.bin")
    pool = StatePool(RecurrentShape(1, 2, 4, 4), 2, 4, verify_rows=1, verify_positions=3)
    seqs = [Request(f"r{i}", [5] * 10, SamplingParams(max_tokens=4), tokenizer).sequences[0] for i in range(4)]
    for seq, slot in zip(seqs, (2, 0, 3, 1)):
        seq.state_slot = slot
    verify = ScheduledChunk(seqs[2], 3, 2, draft=[7, 8], verify_row=0)
    chunks = [ScheduledChunk(seqs[0], 1), ScheduledChunk(seqs[1], 1), verify, ScheduledChunk(seqs[3], 6)]
    states = step_states(pool, (0, 2), chunks)  # model layers 0 and 2 are the pool's layers 0 and 1
    assert states.slots.tolist() == [2, 0, 3, 1] and states.row_starts == [0, 1, 2, 5, 11]
    assert states.num_decodes == 2 and states.verify_rows == [None, None, 0, None]
    assert states.layer(2)[1].data_ptr() == pool.states[1].data_ptr()
    assert torch.equal(states.checkpoints(0)[0], pool.checkpoint_conv[0])
