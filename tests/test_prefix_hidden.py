"""The record of computed hidden states that fills in vLLM's cached prefixes
(``swarmrl.inference.prefix_hidden``): found by whole blocks, confirmed token for token,
bounded in memory."""

import torch

from swarmrl.inference.prefix_hidden import HiddenPrefixes


def _rows(n: int, tag: float) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32)[:, None] + tag * torch.ones(n, 4)


def test_a_prefix_is_found_in_whole_blocks_of_the_sequence_that_computed_it():
    store = HiddenPrefixes(block=4, max_bytes=1 << 20)
    seq = list(range(10, 21))  # 11 tokens, 10 rows computed (the last token never ran)
    store.add(seq, _rows(10, 0.5))
    later = seq + [7, 7, 7]  # the next turn extends it
    assert torch.equal(store.find(later, 8), _rows(10, 0.5)[:8])
    assert torch.equal(store.find(later, 4), _rows(10, 0.5)[:4])
    assert store.find(later, 12) is None  # beyond the rows it holds
    assert store.find(later, 6) is None  # not a block boundary: vLLM never reuses half a block
    assert store.find([10, 11, 12, 99] + seq[4:], 8) is None  # differs in the first block
    assert store.find(later, 0) is None


def test_the_newest_holder_answers_and_a_hash_collision_is_no_answer():
    store = HiddenPrefixes(block=2, max_bytes=1 << 20)
    store.add([1, 2, 3, 4, 5], _rows(4, 0.0))
    store.add([1, 2, 3, 4, 6], _rows(4, 9.0))
    assert torch.equal(store.find([1, 2, 3, 4], 4), _rows(4, 9.0))
    # a stored sequence whose hash key matches but whose tokens differ answers nothing
    ident = store._index[store._keys([1, 2, 3, 4], 4)[-1]]
    store._index[store._keys([8, 8, 8, 8], 4)[-1]] = ident
    assert store.find([8, 8, 8, 8], 4) is None


def test_the_oldest_sequences_are_forgotten_past_the_memory_bound():
    one = _rows(8, 0.0)
    size = one.element_size() * one.numel()
    store = HiddenPrefixes(block=4, max_bytes=2 * size)
    for first in range(3):
        store.add([first] * 9, _rows(8, float(first)))
    assert len(store) == 2 and store.bytes == 2 * size
    assert store.find([0] * 9, 8) is None
    assert torch.equal(store.find([1] * 9, 8), _rows(8, 1.0))
    # a lookup makes a sequence the newest: the next one added pushes out the other
    store.add([3] * 9, _rows(8, 3.0))
    assert store.find([2] * 9, 8) is None and store.find([1] * 9, 8) is not None
    store.add([0] * 100, _rows(99, 0.0))  # larger than the bound alone: not kept
    assert store.find([0] * 100, 96) is None
    store.clear()
    assert len(store) == 0 and store.bytes == 0 and store.find([1] * 9, 8) is None
