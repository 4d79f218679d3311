"""Sampling in generate.py (greedy generation against transformers: tests/hf/test_hf_parity.py)."""

import jax
import numpy as np

from shardtrain import generate


def test_sampling_is_seeded_and_top_p_keeps_the_smallest_set_reaching_p():
    logits_bv = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 4000, np.float32))

    def draw(top_p, seed):
        return np.asarray(generate.sample(logits_bv, jax.random.key(seed), 1.0, top_p))
    counts = np.bincount(draw(1.0, 0), minlength=4) / 4000
    assert np.abs(counts - [0.5, 0.3, 0.15, 0.05]).max() < 0.03
    assert set(draw(0.7, 0)) == {0, 1} and set(draw(0.8, 0)) == {0, 1} and set(draw(0.81, 0)) == {0, 1, 2}
    assert set(draw(0.2, 0)) == {0}
    assert np.array_equal(draw(0.9, 1), draw(0.9, 1)) and not np.array_equal(draw(0.9, 1), draw(0.9, 2))
