"""storage.py: byte-range arrays read what numpy reads, from disk and through a URL; the input
files a path, directory or glob names."""

import numpy as np

from shardtrain.data import storage


def test_range_arrays_read_what_numpy_reads(tmp_path):
    """Elements and slices of a .npy file, read by range from disk and through a URL, with index
    blocks of 8 entries so that reads cross blocks."""
    want = np.random.default_rng(0).integers(0, 1 << 40, 1000)
    np.save(tmp_path / "a.npy", want)
    rng = np.random.default_rng(1)
    for store in (storage.LocalStore(str(tmp_path)), storage.KvStore(f"file://{tmp_path}")):
        array = storage.npy_array(store, "a.npy", block_bytes=64)
        assert len(array) == 1000 and [array[i] for i in range(1000)] == want.tolist() and array[-1] == want[-1]
        for start, stop in [(0, 1000), (5, 6), (7, 9), (8, 16), (990, 1005), (3, 3)] + \
                [sorted(rng.integers(0, 1000, 2)) for _ in range(50)]:
            assert array[start:stop].tolist() == want[start:stop].tolist(), (start, stop)
        assert storage.npy_array(store, "none.npy") is None


def test_find_files_takes_a_file_a_directory_or_a_glob(tmp_path):
    for name in ("b.txt", "a.txt", "sub/c.txt", "sub/deeper/d.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    every = [str(tmp_path / n) for n in ("a.txt", "b.txt", "sub/c.txt", "sub/deeper/d.jsonl")]
    assert storage.find_files(str(tmp_path)) == every
    assert storage.find_files(str(tmp_path / "b.txt")) == [str(tmp_path / "b.txt")]
    assert storage.find_files(f"{tmp_path}/**/*.txt") == every[:3]
    assert storage.find_files(f"{tmp_path}/*") == every[:2]  # the directory `sub` is no file
    assert storage.find_files(str(tmp_path / "none*")) == []
