"""A recurrent model's state slots as the scheduler hands them out (kvgen.scheduling.state_slots): one
per sequence and its children-to-be, back on release, copied on fork; prompt chunks cut at snapshot
boundaries, snapshots kept there and found again by a prompt sharing the prefix."""

import pytest
import torch

from kvgen import SamplingParams
from kvgen.cache.block_pool import Block, hash_block
from kvgen.cache.state_pool import StatePool
from kvgen.config import RecurrentShape
from kvgen.loaders.llama2c import load_llama2c_tokenizer
from kvgen.scheduling.sequence import Request
from kvgen.scheduling.state_slots import StateSlots

SHAPE = RecurrentShape(k_heads=1, v_heads=2, k_dim=4, v_dim=4, conv_kernel=4)
BS = 16


@pytest.fixture(scope="module")
def tokenizer(stories_dir):
    return load_llama2c_tokenizer(stories_dir / "tok512.bin")


def request(tokenizer, prompt, n=1):
    return Request("r", prompt, SamplingParams(n=n, max_tokens=4), tokenizer)


def slots(num_slots=4, snapshots=4) -> StateSlots:
    return StateSlots(StatePool(SHAPE, 2, num_slots, snapshots), BS, prefix_caching=True, snapshot_every=64)


def cached_blocks(prompt: list[int], n: int) -> list[Block]:
    """The prefix cache's first n blocks of `prompt`, as find_cached_prefix returns them."""
    blocks, parent = [], None
    for i in range(n):
        chunk = prompt[i * BS:(i + 1) * BS]
        parent = hash_block(parent, chunk)
        blocks.append(Block(i, 1, parent, tuple(chunk)))
    return blocks


def test_a_request_takes_a_slot_for_each_completion_and_gives_them_back(tokenizer):
    states = slots(num_slots=3)
    three, one = request(tokenizer, [5] * 20, n=3), request(tokenizer, [6] * 20)
    assert states.can_admit(three.sequences[0])
    states.admit(three.sequences[0], [])
    assert states.pool.num_free == 0 and not states.can_admit(one.sequences[0])
    parent, child = three.sequences[0], three.sequences[1]
    states.pool.states[:, parent.state_slot] = 1.0
    states.fork(parent, child)
    assert torch.equal(states.pool.states[:, child.state_slot], states.pool.states[:, parent.state_slot])
    for seq in three.sequences:
        states.release(seq)
        states.release(seq)  # twice: a finished sequence that is then aborted
    assert states.pool.num_used == 0
    states.pool.check()


def test_prompt_chunks_end_at_snapshot_boundaries_and_the_last_full_block(tokenizer):
    states, seq = slots(), request(tokenizer, list(range(3, 153))).sequences[0]  # 150 tokens: last full block 144
    assert [states.chunk_limit(seq, start) for start in (0, 10, 64, 128, 144)] == [64, 54, 64, 16, None]


def test_a_snapshot_at_a_boundary_is_found_by_a_prompt_sharing_the_prefix(tokenizer):
    states = slots()
    prompt = list(range(3, 153))
    first = request(tokenizer, prompt).sequences[0]
    states.admit(first, [])
    for end, saved in ((40, 0), (64, 1), (100, 1), (144, 2)):
        first.num_computed_tokens = end
        states.after_chunk(first)
        assert states.pool.num_snapshots == saved
    other = request(tokenizer, prompt[:130] + [7] * 30).sequences[0]  # shares 8 blocks: the snapshot at 64 fits
    blocks = cached_blocks(other.token_ids, 8)
    assert states.usable_prefix(other, blocks) == blocks[:4]
    states.pool.states[:, first.state_slot] = 2.0
    states.admit(other, cached_blocks(other.token_ids, 4))
    assert float(states.pool.states[:, other.state_slot].max()) == 0.0  # the state at 64, before the 2.0s
    assert states.usable_prefix(other, cached_blocks(other.token_ids, 3)) == []
