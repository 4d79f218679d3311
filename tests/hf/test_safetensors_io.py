"""safetensors read and write with numpy only (hf/safetensors_io.py), checked against safetensors.numpy."""

import numpy as np
import pytest
from hf_reference import rewrite_header

from shardtrain.config import ConfigError
from shardtrain.hf import safetensors_io


def test_safetensors_writer_reads_back_and_transformers_layout(tmp_path):
    import ml_dtypes
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones((3,), ml_dtypes.bfloat16)}
    safetensors_io.write(tmp_path / "x.safetensors", [(k, v.shape, v.dtype) for k, v in arrays.items()],
                         arrays.__getitem__, metadata={"format": "pt"})
    r = safetensors_io.Reader([tmp_path / "x.safetensors"])
    assert all(np.array_equal(r.get(k), v) and r.dtype(k) == v.dtype for k, v in arrays.items())
    import safetensors.numpy
    assert np.array_equal(safetensors.numpy.load_file(tmp_path / "x.safetensors")["a"], arrays["a"])


def test_every_dtype_reads_back_and_an_unknown_one_is_a_config_error(tmp_path):
    """Each dtype of DTYPES (unsigned and float8 included) round-trips, and matches safetensors.numpy
    where that has the dtype; a dtype numpy cannot hold names the file, tensor and dtype."""
    import safetensors.numpy
    arrays = {code: (np.arange(12) % 7).astype(dtype).reshape(3, 4) for code, dtype in safetensors_io.DTYPES.items()}
    path = tmp_path / "all.safetensors"
    safetensors_io.write(path, [(k, v.shape, v.dtype) for k, v in arrays.items()], arrays.__getitem__)
    r = safetensors_io.Reader([path])
    assert all(np.array_equal(r.get(k), v) and r.dtype(k) == v.dtype for k, v in arrays.items())
    numpy_kinds = {k: v for k, v in arrays.items() if k in ("U16", "U32", "U64", "I16", "F64", "BOOL")}
    safetensors_io.write(tmp_path / "np.safetensors", [(k, v.shape, v.dtype) for k, v in numpy_kinds.items()],
                         numpy_kinds.__getitem__)
    theirs = safetensors.numpy.load_file(tmp_path / "np.safetensors")
    assert all(np.array_equal(theirs[k], v) and theirs[k].dtype == v.dtype for k, v in numpy_kinds.items())
    header = b'{"w":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}'
    (tmp_path / "f4.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    r = safetensors_io.Reader([tmp_path / "f4.safetensors"])
    assert r.shape("w") == (2,)  # the header reads; the tensor does not
    for read in (r.get, r.dtype):
        with pytest.raises(ConfigError, match=r"f4.safetensors: tensor w has dtype F4, which is not supported"):
            read("w")


@pytest.mark.parametrize("case, edit, length, message", [
    ("negative", lambda h: h["a"].update(data_offsets=[-24, 0]), None,
     r"tensor a: data_offsets \[-24, 0\] lie outside the file's 30 bytes of data"),
    ("overlap", lambda h: h["b"].update(data_offsets=[0, 6]), None,
     r"tensor a: data_offsets \[0, 24\] overlap tensor b's \[0, 6\]"),
    ("past the end", lambda h: h["b"].update(data_offsets=[24, 36]), None,
     r"tensor b: data_offsets \[24, 36\] lie outside"),
    ("size", lambda h: h["b"].update(shape=[4]), None,
     r"tensor b: data_offsets \[24, 30\] hold 6 bytes, but BF16 x \[4\]"),
    ("gap", lambda h: (h["a"].update(shape=[2, 2], data_offsets=[0, 16]), h["b"].update(data_offsets=[24, 30])), None,
     r"tensor b: data_offsets \[24, 30\] leave bytes \[16, 24\) unused"),
    ("trailing", lambda h: h.pop("b"), None, "the tensors' data ends at byte 24 but 30 bytes follow the header"),
    ("shape", lambda h: h["a"].update(shape=[2, -3]), None, "tensor a: header entry .* is not"),
    ("huge header", None, 2 ** 62, "safetensors header length 4611686018427387904 does not fit the file's"),
])
def test_malformed_headers_are_refused_before_any_tensor_is_read(tmp_path, case, edit, length, message):
    """The checks the safetensors library makes (offsets inside the file, contiguous, no overlap, dtype
    x shape bytes; a header length bounded by the file) and a few more, each naming the file and tensor."""
    import ml_dtypes
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones((3,), ml_dtypes.bfloat16)}
    path = tmp_path / "x.safetensors"
    safetensors_io.write(path, [(k, v.shape, v.dtype) for k, v in arrays.items()], arrays.__getitem__)
    rewrite_header(path, edit, length)
    with pytest.raises(ConfigError, match=f"x.safetensors: {message}"):
        safetensors_io.Reader([path])
