"""Our parameter tree <-> HF tensor names and layouts (hf/layout.py), against the fixtures' files."""

import numpy as np
import pytest
from hf_reference import FAMILIES, FIXTURES

from shardtrain.hf import safetensors_io
from shardtrain.hf.io import HfDir, safetensors_files
from shardtrain.hf.layout import indexed_names, is_llama4, tensor_map


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_map_names_every_stored_tensor_and_its_layouts_invert(family):
    hf_dir = HfDir(FIXTURES / family)
    m = hf_dir.model
    stored = safetensors_io.Reader(safetensors_files(FIXTURES / family))
    names = [name for entry in tensor_map(m) for name, _ in indexed_names(entry, m)]
    assert sorted(names) == sorted(stored.names())  # nothing missing, nothing left over
    e = m.head_dim or m.d_model // m.n_heads
    for entry in tensor_map(m):
        a = np.asarray(stored.get(entry.hf.format(i=entry.first, j=0)), np.float32)
        ours = entry.to_ours(a)
        assert np.array_equal(entry.to_hf(ours), a), entry.hf
        if entry.ours[-1] in ("wq_dhe", "wk_dke"):  # HF rows n*E + e (a head's E rows together) -> ours [:, n, e]
            eq = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim if m.mla else e
            ours_c = 1 if is_llama4(m) else 2  # Llama 4's interleaved rotary pairs: its channel 2 is our second
            assert np.array_equal(ours[:, 1, ours_c], a[eq + 2])
        if entry.ours[-1] == "wo_hed":  # HF columns n*E + e -> ours [n, e, :] (E: the value head size)
            ev = m.mla.v_head_dim if m.mla else e
            assert np.array_equal(ours[1, 2], a[:, ev + 2])
        if entry.ours[-1] == "wq_b_rhe":  # DeepSeek's interleaved rotary pairs: its channel 2 is our second
            n, p = m.mla.qk_nope_head_dim, m.mla.qk_rope_head_dim
            assert np.array_equal(ours[:, 1, n + 1], a[(n + p) + n + 2])
            assert np.array_equal(ours[:, 1, n + p // 2], a[(n + p) + n + 1])  # ... channel 1 our first of the 2nd half
        if entry.ours[-1] == "wkv_b_che":  # keys' other channels, then values: in HF's order whatever their sizes
            n, v = m.mla.qk_nope_head_dim, m.mla.v_head_dim
            assert np.array_equal(ours[:, 1], a[n + v:2 * (n + v)].T)
        if entry.joined:  # Llama 4's experts.gate_up_proj (E, D, 2F): our gates, then our ups
            assert [p[-1] for p in entry.paths] == ["w_gate_edf", "w_up_edf"] and ours.shape[-1] == 2 * m.d_ff
        if entry.ours[-1] in ("w_up_df", "w_up_edf", "router_de"):  # HF (out, in) -> ours (in, out)
            assert np.array_equal(ours, a.T)
