"""Image data: the IDX reader against hand-built files and its errors, MNIST-format
directories, the batch stream (determinism, epochs, coverage, normalisation), the digits set,
the real Fashion-MNIST files when installed, and patchify/unpatchify."""

import gzip
import pathlib
import struct

import einops
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer import data
from spinformer.data import _idx, _images, _mnist

FASHION = pathlib.Path(data.FASHION_MNIST_DIR)
NAMES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
         "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}


def tiny_arrays(seed=0, n_train=23, n_test=7, hw=(4, 6)):
    rng = np.random.default_rng(seed)
    return {
        "train_images": rng.integers(0, 256, (n_train, *hw), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, n_train, dtype=np.uint8),
        "test_images": rng.integers(0, 256, (n_test, *hw), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, n_test, dtype=np.uint8),
    }


def write_mnist_dir(d: pathlib.Path, arrays, gz=True, skip=()):
    d.mkdir(parents=True, exist_ok=True)
    for role, name in NAMES.items():
        if role not in skip:
            data.write_idx(d / (name + (".gz" if gz else "")), arrays[role])
    return d


def tiny_dataset(n_train=10, n_val=7, n_test=5, batch_size=4, seed=0, **kw):
    rng = np.random.default_rng(123)
    split = lambda n: (rng.integers(0, 256, (n, 3, 2), dtype=np.uint8),  # noqa: E731
                       np.arange(n) % 3)
    return data.ImageDataset(split(n_train), split(n_val), split(n_test),
                             batch_size=batch_size, seed=seed, **kw)


# ------------------------------------------------------------------------------ IDX files


def test_read_idx_hand_built_file(tmp_path):
    """A file built byte by byte from the format description (not by write_idx)."""
    x = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    raw = struct.pack(">I", 0x00000803) + struct.pack(">III", 2, 3, 4) + bytes(range(24))
    (tmp_path / "a").write_bytes(raw)
    (tmp_path / "a.gz").write_bytes(gzip.compress(raw))
    for name in ("a", "a.gz"):
        got = data.read_idx(tmp_path / name)
        assert got.dtype == np.uint8 and got.shape == (2, 3, 4)
        np.testing.assert_array_equal(got, x)
    labels = struct.pack(">II", 0x00000801, 3) + bytes([7, 0, 9])
    (tmp_path / "l").write_bytes(labels)
    np.testing.assert_array_equal(data.read_idx(tmp_path / "l", ndim=1), [7, 0, 9])
    # big-endian multi-byte types: int16 -2 is ff fe, float32 1.5 is 3f c0 00 00
    (tmp_path / "s").write_bytes(bytes([0, 0, 0x0B, 1, 0, 0, 0, 2, 0xFF, 0xFE, 0x01, 0x00]))
    np.testing.assert_array_equal(data.read_idx(tmp_path / "s"), [-2, 256])
    (tmp_path / "f").write_bytes(bytes([0, 0, 0x0D, 1, 0, 0, 0, 1, 0x3F, 0xC0, 0, 0]))
    assert data.read_idx(tmp_path / "f").tolist() == [1.5]
    # and write_idx produces exactly those bytes
    data.write_idx(tmp_path / "b", x)
    assert (tmp_path / "b").read_bytes() == raw


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32,
                                   np.float64])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_round_trip(tmp_path, dtype, suffix):
    rng = np.random.default_rng(1)
    a = (rng.normal(size=(5, 3, 2)) * 100).astype(dtype)
    p = data.write_idx(tmp_path / f"x{suffix}", a)
    assert (p.read_bytes()[:2] == b"\x1f\x8b") == (suffix == ".gz")
    b = data.read_idx(p)
    assert b.dtype == a.dtype and b.dtype.isnative
    np.testing.assert_array_equal(b, a)


def test_idx_chunked_read(tmp_path, monkeypatch):
    """Payloads above the preallocation size are read in chunks; the result is the same."""
    monkeypatch.setattr(_idx, "_PREALLOCATE", 10)
    monkeypatch.setattr(_idx, "_CHUNK", 7)
    a = np.arange(3 * 5 * 4, dtype=np.int16).reshape(3, 5, 4) - 50
    for suffix in ("", ".gz"):
        np.testing.assert_array_equal(data.read_idx(data.write_idx(tmp_path / f"c{suffix}", a)),
                                      a)
    p = tmp_path / "t.gz"
    p.write_bytes(gzip.compress(data.write_idx(tmp_path / "t", a).read_bytes()[:-9]))
    with pytest.raises(data.ImageDataError, match="= 120 bytes of data, the file has 111"):
        data.read_idx(p)


def test_write_idx_rejects_unsupported(tmp_path):
    with pytest.raises(ValueError, match="astype"):
        data.write_idx(tmp_path / "x", np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="1 to 255 dimensions"):
        data.write_idx(tmp_path / "x", np.uint8(3))


def _idx_bytes(a):
    header = bytes([0, 0, 8, a.ndim]) + np.asarray(a.shape, ">u4").tobytes()
    return header + a.astype(np.uint8).tobytes()


def test_read_idx_errors(tmp_path):
    images = np.zeros((60, 28, 28), np.uint8)
    good = _idx_bytes(images)

    def check(name, content, *patterns, ndim=None):
        p = tmp_path / name
        p.write_bytes(content)
        with pytest.raises(data.ImageDataError) as e:
            data.read_idx(p, ndim=ndim)
        msg = str(e.value)
        assert name in msg, msg
        for pat in patterns:
            assert pat in msg, msg
        return msg

    # truncated payload, raw and gzipped
    for name, content in (("train-images-idx3-ubyte", good[:16 + 1200]),
                          ("train-images-idx3-ubyte.gz", gzip.compress(good[:16 + 1200]))):
        check(name, content, "header says 60×28×28 uint8 = 47040 bytes", "has 1200",
              "truncated", "re-download")
    # too many bytes: header and data disagree
    check("extra", good + b"\0" * 5, "47045", "5 bytes too many")
    # wrong magic: a text file, a little-endian header, an unknown type code
    check("text.gz", b"hello world, not idx", "magic number 0x68656c6c",
          "not gzip-compressed")
    check("le", struct.pack("<I", 0x803) + good[4:], "magic number 0x03080000")
    check("type", bytes([0, 0, 0x07, 1, 0, 0, 0, 1, 5]), "magic number 0x00000701")
    check("zero", bytes([0, 0, 8, 0]), "0 dimensions")
    check("short", b"\0\0", "2 bytes", "too short")
    check("dims", bytes([0, 0, 8, 3, 0, 0, 0, 60, 0, 0]), "declares 3 dimensions",
          "only 6 of those bytes")
    # a garbage header announcing ~8e28 bytes fails on the short file, not on an allocation
    huge = bytes([0, 0, 8, 3]) + b"\xff" * 12 + b"\0" * 100
    for name, content in (("huge", huge), ("huge.gz", gzip.compress(huge))):
        check(name, content, "4294967295×4294967295×4294967295", "has 100", "truncated")
    # expected dimension count (labels vs images swapped)
    check("swap", good, "expected 1 dimension", "swapped", ndim=1)
    # corrupt gzip: flipped bytes inside the deflate stream, a cut stream, a bad CRC
    gz = bytearray(gzip.compress(good))
    bad = bytearray(gz)
    bad[20:40] = b"\xff" * 20
    check("bad.gz", bytes(bad), "not a valid gzip file")
    check("cut.gz", bytes(gz[: len(gz) // 2]), "not a valid gzip file")
    crc = bytearray(gz)
    crc[-8] ^= 0xFF
    check("crc.gz", bytes(crc), "not a valid gzip file")
    # a missing file
    with pytest.raises(data.ImageDataNotFound, match="no such file"):
        data.read_idx(tmp_path / "nothing")


# ------------------------------------------------------------------------ MNIST directories


def test_find_mnist_files_and_load(tmp_path):
    arrays = tiny_arrays()
    d = write_mnist_dir(tmp_path / "gz", arrays, gz=True)
    files = data.find_mnist_files(d)
    assert {k: v.name for k, v in files.items()} == {k: n + ".gz" for k, n in NAMES.items()}
    loaded = data.load_mnist(d)
    for k in NAMES:
        np.testing.assert_array_equal(loaded[k], arrays[k])
    # raw files, in torchvision's raw/ subdirectory, with a dot before idx
    r = tmp_path / "tv" / "raw"
    r.mkdir(parents=True)
    for role, name in NAMES.items():
        data.write_idx(r / name.replace("-idx", ".idx"), arrays[role])
    assert data.find_mnist_files(tmp_path / "tv")["test_labels"].name == "t10k-labels.idx1-ubyte"
    np.testing.assert_array_equal(data.load_mnist(tmp_path / "tv")["train_images"],
                                  arrays["train_images"])
    # the cache notices rewritten files
    arrays2 = tiny_arrays(seed=5)
    write_mnist_dir(d, arrays2, gz=True)
    np.testing.assert_array_equal(data.load_mnist(d)["test_labels"], arrays2["test_labels"])


def test_missing_data_errors(tmp_path, monkeypatch):
    hint = ("apt-get install dataset-fashion-mnist", "data.path", "train-images-idx3-ubyte[.gz]")
    # the default directory (pointed somewhere empty)
    monkeypatch.setattr(_mnist, "FASHION_MNIST_DIR", str(tmp_path / "none"))
    with pytest.raises(data.ImageDataNotFound) as e:
        data.ImageDataset.fashion_mnist(batch_size=4, seed=0)
    msg = str(e.value)
    assert msg.startswith(f"Fashion-MNIST not found in {tmp_path / 'none'}")
    assert all(h in msg for h in hint), msg
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, ValueError)
    # a user path that does not exist / is a file / is empty
    for p, what in ((tmp_path / "nope", "no such directory"),
                    (data.write_idx(tmp_path / "f", np.zeros(1, np.uint8)), "not a directory"),
                    (tmp_path, "none of the four")):
        with pytest.raises(FileNotFoundError) as e:
            data.find_mnist_files(p)
        assert what in str(e.value) and all(h in str(e.value) for h in hint), str(e.value)
    # a directory with some of the files
    d = write_mnist_dir(tmp_path / "part", tiny_arrays(), skip=("test_labels",))
    with pytest.raises(data.ImageDataNotFound) as e:
        data.find_mnist_files(d)
    msg = str(e.value)
    assert "missing t10k-labels-idx1-ubyte[.gz]" in msg and "found t10k-images" in msg, msg
    assert all(h in msg for h in hint), msg
    # the command line reports FileNotFoundError in one line, without a traceback
    assert issubclass(data.ImageDataNotFound, FileNotFoundError)


def test_mismatched_files(tmp_path):
    a = tiny_arrays()
    a["train_labels"] = a["train_labels"][:-1]
    with pytest.raises(data.ImageDataError, match=r"holds 22 labels but train-images-idx3-ubyte"
                                                  r".gz holds 23 images"):
        data.load_mnist(write_mnist_dir(tmp_path / "count", a))
    a = tiny_arrays()
    a["test_images"] = a["test_images"][:, :, :5]
    with pytest.raises(data.ImageDataError, match="4×6 images but t10k-images-idx3-ubyte.gz 4×5"):
        data.load_mnist(write_mnist_dir(tmp_path / "shape", a))
    a = tiny_arrays()
    d = write_mnist_dir(tmp_path / "swap", a)
    data.write_idx(d / "t10k-labels-idx1-ubyte.gz", a["test_images"])
    with pytest.raises(data.ImageDataError, match="t10k-labels-idx1-ubyte.gz: expected 1 dim"):
        data.load_mnist(d)
    a = tiny_arrays()
    a["train_labels"] = a["train_labels"].astype(np.int32)
    with pytest.raises(data.ImageDataError, match="labels are uint8"):
        data.load_mnist(write_mnist_dir(tmp_path / "dtype", a))


def test_from_mnist_dir_splits(tmp_path):
    a = tiny_arrays(n_train=23)
    d = write_mnist_dir(tmp_path / "m", a)
    ds = data.ImageDataset.from_mnist_dir(d, batch_size=4, seed=0, val_size=5)
    assert ds.sizes == {"train": 18, "val": 5, "test": 7}
    assert ds.kind == "image_classification" and ds.vocab_size == 0
    assert ds.image_shape == (4, 6) and ds.seq_len == 24
    assert ds.num_classes == int(max(a["train_labels"].max(), a["test_labels"].max())) + 1
    np.testing.assert_array_equal(ds.split_arrays("val")[0], a["train_images"][18:])
    np.testing.assert_array_equal(ds.split_arrays("test")[1], a["test_labels"])
    small = data.ImageDataset.from_mnist_dir(d, batch_size=4, seed=0, val_size=5, max_train=6)
    assert small.sizes == {"train": 6, "val": 5, "test": 7}
    np.testing.assert_array_equal(small.split_arrays("train")[0], a["train_images"][:6])
    np.testing.assert_array_equal(small.split_arrays("val")[0], a["train_images"][18:])
    for bad in (0, 23, -1):
        with pytest.raises(ValueError, match="val_size"):
            data.ImageDataset.from_mnist_dir(d, batch_size=4, seed=0, val_size=bad)
    with pytest.raises(ValueError, match="max_train"):
        data.ImageDataset.from_mnist_dir(d, batch_size=4, seed=0, val_size=5, max_train=0)


# ------------------------------------------------------------------------------ batches


def test_batch_format_and_determinism():
    ds = tiny_dataset()
    for split in ("train", "val", "test"):
        b = ds.batch(3, split)
        assert b["inputs"].shape == (4, 3, 2) and b["inputs"].dtype == np.float32
        assert b["targets"].shape == (4,) and b["targets"].dtype == np.int32
        assert b["mask"].shape == (4,) and b["mask"].dtype == np.float32
        again = tiny_dataset().batch(3, split)
        for k in b:
            np.testing.assert_array_equal(b[k], again[k])
    # different seeds, different training order; the same val/test batches
    other = tiny_dataset(seed=1)
    assert not np.array_equal(ds.batch_rows(0)[0], other.batch_rows(0)[0])
    np.testing.assert_array_equal(ds.batch(1, "val")["inputs"], other.batch(1, "val")["inputs"])
    # resumable: batch k does not depend on which batches were drawn before, or in which order
    fresh = tiny_dataset()
    late = [fresh.batch_rows(k)[0] for k in (9, 2, 17, 0)]
    used = tiny_dataset()
    seq = [used.batch_rows(k)[0] for k in range(18)]
    for k, rows in zip((9, 2, 17, 0), late):
        np.testing.assert_array_equal(rows, seq[k])
    with pytest.raises(ValueError, match="unknown split"):
        ds.batch(0, "dev")
    with pytest.raises(ValueError, match="non-negative integer"):
        ds.batch(-1)
    with pytest.raises(ValueError, match="seed"):
        tiny_dataset(seed=-1)


@pytest.mark.parametrize("n_train,batch_size", [(10, 4), (12, 4), (5, 7), (1, 3)])
def test_epochs_cover_training_set_once(n_train, batch_size):
    ds = tiny_dataset(n_train=n_train, batch_size=batch_size, seed=3)
    epochs = 4
    n_batches = -(-epochs * n_train // batch_size)
    stream = np.concatenate([ds.batch_rows(i)[0] for i in range(n_batches)])
    perms = [stream[e * n_train:(e + 1) * n_train] for e in range(epochs)]
    for p in perms:
        assert sorted(p.tolist()) == list(range(n_train))
    if n_train > 3:
        assert len({tuple(p) for p in perms}) > 1  # reshuffled between epochs
    assert all(ds.batch_rows(i)[1].sum() == batch_size for i in range(n_batches))


@pytest.mark.parametrize("split,n", [("val", 7), ("test", 5)])
def test_eval_batches_cover_split_once(split, n):
    ds = tiny_dataset(n_val=7, n_test=5, batch_size=3)
    k = ds.num_batches(split)
    assert k == -(-n // 3)
    rows = np.concatenate([ds.batch_rows(i, split)[0] for i in range(k)])
    mask = np.concatenate([ds.batch_rows(i, split)[1] for i in range(k)])
    np.testing.assert_array_equal(rows, np.arange(k * 3) % n)  # in order, wrapping
    np.testing.assert_array_equal(mask, (np.arange(k * 3) < n).astype(np.float32))
    assert ds.batch_rows(k, split)[1].sum() == 0  # past the first pass: all masked
    # the masked mean over those batches is the split's mean, exactly
    x, y = ds.split_arrays(split)
    b = [ds.batch(i, split) for i in range(k)]
    vals = np.concatenate([bb["targets"] for bb in b]).astype(np.float64)
    assert np.isclose((vals * mask).sum() / mask.sum(), y.mean())


def test_evaluate_over_num_batches_is_exact():
    """Through the trainer's `evaluate`: the accuracy over `num_batches("val")` batches equals
    the brute-force accuracy over the whole validation split (no example counted twice)."""
    from spinformer.train import evaluate

    class Linear(eqx.Module):
        w: jax.Array

        def __call__(self, x, *, key=None, return_diagnostics=False):
            return x.reshape(-1) @ self.w, None

    ds = data.ImageDataset.digits(batch_size=64, seed=0)
    model = Linear(jax.random.normal(jax.random.key(0), (64, 10)))
    k = ds.num_batches("val")
    assert k == 5  # 270 = 4 * 64 + 14
    got = evaluate(model, [ds.batch(i, "val") for i in range(k)])["accuracy"]
    x, y = ds.split_arrays("val")
    pred = np.argmax(ds.preprocess(x).reshape(len(x), -1) @ np.asarray(model.w), axis=1)
    np.testing.assert_allclose(got, float((pred == y).mean()), rtol=0, atol=1e-6)


def test_normalisation_statistics():
    ds = tiny_dataset(n_train=12, batch_size=4)
    x_train = ds.split_arrays("train")[0].astype(np.float64) / 255.0
    np.testing.assert_allclose(ds.mean, x_train.mean(), rtol=1e-12)
    np.testing.assert_allclose(ds.std, x_train.std(), rtol=1e-12)
    # one epoch of standardised training batches has mean 0 and std 1 (B divides n here)
    epoch = np.concatenate([ds.batch(i)["inputs"] for i in range(3)]).astype(np.float64)
    assert abs(epoch.mean()) < 1e-6
    np.testing.assert_allclose(epoch.std(), 1.0, rtol=0, atol=1e-6)
    # validation batches use the training statistics, not their own
    xv, yv = ds.split_arrays("val")
    b = ds.batch(0, "val")
    np.testing.assert_allclose(b["inputs"], (xv[:4] / 255.0 - x_train.mean()) / x_train.std(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(b["targets"], yv[:4])
    raw = tiny_dataset(n_train=12, normalize=False).batch(0, "val")["inputs"]
    np.testing.assert_allclose(raw, xv[:4] / 255.0, rtol=1e-6)
    # float images take the other statistics path; pixel_max scales them
    rng = np.random.default_rng(0)
    f = lambda n: (rng.uniform(0, 16, (n, 2, 2)).astype(np.float32), np.zeros(n, int))  # noqa
    fd = data.ImageDataset(f(9), f(2), f(2), batch_size=2, seed=0, pixel_max=16.0)
    xf = fd.split_arrays("train")[0].astype(np.float64) / 16.0
    np.testing.assert_allclose(fd.mean, xf.mean(), rtol=1e-6)
    np.testing.assert_allclose(fd.std, xf.std(), rtol=1e-6)
    with pytest.raises(ValueError, match="normalize=False"):
        const = (np.zeros((3, 2, 2), np.uint8), np.zeros(3, int))
        data.ImageDataset(const, const, const, batch_size=2, seed=0)


def test_baselines_and_constructor_errors():
    ds = tiny_dataset(n_train=10)  # labels 0,1,2,0,1,2,... : majority label 0
    assert ds.majority_label == 0 and ds.num_classes == 3
    b = {"targets": np.array([0, 0, 1, 2]), "mask": np.array([1, 1, 1, 0], np.float32)}
    base = ds.baselines(b)
    assert set(base) == {"chance_accuracy", "majority_accuracy"}
    np.testing.assert_allclose([base["chance_accuracy"], base["majority_accuracy"]],
                               [1 / 3, 2 / 3], rtol=1e-6)
    good = (np.zeros((3, 2, 2), np.uint8), np.array([0, 1, 1]))
    with pytest.raises(ValueError, match="3 images but 2 labels"):
        data.ImageDataset(good, (good[0], good[1][:2]), good, batch_size=2, seed=0,
                          normalize=False)
    with pytest.raises(ValueError, match="one shape"):
        data.ImageDataset(good, (np.zeros((3, 2, 3), np.uint8), good[1]), good, batch_size=2,
                          seed=0, normalize=False)
    with pytest.raises(ValueError, match="label 1 occurs"):
        data.ImageDataset(good, good, good, batch_size=2, seed=0, num_classes=1,
                          normalize=False)
    with pytest.raises(ValueError, match="test split is empty"):
        data.ImageDataset(good, good, (good[0][:0], good[1][:0]), batch_size=2, seed=0,
                          normalize=False)
    with pytest.raises(ValueError, match="batch_size"):
        data.ImageDataset(good, good, good, batch_size=0, seed=0, normalize=False)
    one = (np.zeros((1, 4, 6, 3), np.uint8), [0])
    rgb = data.ImageDataset((np.ones((4, 4, 6, 3), np.uint8) * np.arange(3, dtype=np.uint8),
                             np.arange(4)), one, one, batch_size=2, seed=0)
    assert rgb.image_shape == (4, 6, 3) and rgb.seq_len == 24
    assert rgb.batch(0)["inputs"].shape == (2, 4, 6, 3)


# ------------------------------------------------------------------------------ digits


def test_digits():
    sklearn = pytest.importorskip("sklearn.datasets")
    ds = data.ImageDataset.digits(batch_size=32, seed=0)
    assert ds.sizes == {"train": 1257, "val": 270, "test": 270}
    assert ds.num_classes == 10 and ds.image_shape == (8, 8) and ds.seq_len == 64
    assert ds.pixel_max == 16.0
    # the split does not depend on the training seed, and the three splits are the whole set
    other = data.ImageDataset.digits(batch_size=8, seed=7)
    for s in ("train", "val", "test"):
        for a, b in zip(ds.split_arrays(s), other.split_arrays(s)):
            np.testing.assert_array_equal(a, b)
    ref = sklearn.load_digits()
    key = lambda x, y: sorted(  # noqa: E731
        bytes(xi.astype(np.uint8).tobytes()) + bytes([int(yi)]) for xi, yi in zip(x, y))
    ours = [ds.split_arrays(s) for s in ("train", "val", "test")]
    assert key(np.concatenate([x for x, _ in ours]), np.concatenate([y for _, y in ours])) \
        == key(ref.images, ref.target)
    b = ds.batch(0)
    assert b["inputs"].shape == (32, 8, 8) and b["targets"].max() < 10
    x = ds.split_arrays("train")[0].astype(np.float64) / 16
    np.testing.assert_allclose([ds.mean, ds.std], [x.mean(), x.std()], rtol=1e-6)


# ------------------------------------------------------------------------ real Fashion-MNIST


@pytest.mark.skipif(not FASHION.is_dir(), reason=f"Fashion-MNIST is not installed in {FASHION} "
                    "(apt-get install dataset-fashion-mnist)")
def test_real_fashion_mnist():
    """Known facts (Xiao, Rasul & Vollgraf 2017 and its repository's README; the TensorFlow
    classification tutorial): 60,000 training and 10,000 test images of 28×28, 10 classes,
    exactly 6,000 training and 1,000 test images per class; the first training and the first
    test image are both ankle boots (label 9); pixel mean 0.2860 and standard deviation
    0.3530 over the training images scaled to [0, 1]."""
    a = data.load_mnist()
    assert a["train_images"].shape == (60000, 28, 28) and a["test_images"].shape == (10000, 28, 28)
    assert np.bincount(a["train_labels"]).tolist() == [6000] * 10
    assert np.bincount(a["test_labels"]).tolist() == [1000] * 10
    assert a["train_labels"][0] == 9 and a["test_labels"][0] == 9
    assert _mnist.FASHION_MNIST_CLASSES[9] == "Ankle boot"
    m, s = _images._pixel_stats(a["train_images"], 255.0)
    assert round(m, 4) == 0.2860 and round(s, 4) == 0.3530
    ds = data.ImageDataset.fashion_mnist(batch_size=64, seed=0)
    assert ds.sizes == {"train": 55000, "val": 5000, "test": 10000}
    assert ds.num_classes == 10 and ds.image_shape == (28, 28) and ds.seq_len == 784
    # the statistics the docstring records, against a brute-force float64 mean
    x = a["train_images"][:55000]
    np.testing.assert_allclose(ds.mean, 0.285817, rtol=0, atol=5e-7)
    np.testing.assert_allclose(ds.std, 0.352937, rtol=0, atol=5e-7)
    np.testing.assert_allclose(ds.mean, x.mean(dtype=np.float64) / 255.0, rtol=1e-12)
    b = ds.batch(0, "test")
    assert b["inputs"].shape == (64, 28, 28) and b["targets"][0] == 9
    assert ds.baselines(b)["chance_accuracy"] == 0.1
    assert ds.num_batches("test") == 157
    # a second construction reuses the decoded files
    assert data.ImageDataset.fashion_mnist(batch_size=8, seed=1, max_train=100).sizes["train"] \
        == 100


# ------------------------------------------------------------------------------ patches


def test_patchify_brute_force_and_round_trip():
    rng = np.random.default_rng(0)
    img = rng.normal(size=(6, 8)).astype(np.float32)
    p = data.patchify(img, 2)
    assert p.shape == (12, 4)
    for i in range(3):
        for j in range(4):
            np.testing.assert_array_equal(p[i * 4 + j], img[2 * i:2 * i + 2, 2 * j:2 * j + 2]
                                          .reshape(-1))
    np.testing.assert_array_equal(data.unpatchify(p, (6, 8)), img)
    rgb = rng.normal(size=(6, 8, 3)).astype(np.float32)
    q = data.patchify(rgb, 2)
    ref = einops.rearrange(rgb, "(h p1) (w p2) c -> (h w) (p1 p2 c)", p1=2, p2=2)
    np.testing.assert_array_equal(q, ref)
    np.testing.assert_array_equal(data.unpatchify(q, (6, 8, 3)), rgb)
    batch = rng.normal(size=(2, 5, 6, 8)).astype(np.float32)
    pb = data.patchify(batch, 3 - 1, batch_dims=2)
    assert pb.shape == (2, 5, 12, 4)
    np.testing.assert_array_equal(pb[1, 3], data.patchify(batch[1, 3], 2))
    np.testing.assert_array_equal(data.unpatchify(pb, (6, 8), batch_dims=2), batch)
    # JAX: under jit and vmap
    xs = jnp.asarray(batch[0])
    f = jax.jit(jax.vmap(lambda x: data.unpatchify(data.patchify(x, 2), (6, 8))))
    np.testing.assert_array_equal(np.asarray(f(xs)), batch[0])
    np.testing.assert_array_equal(np.asarray(jax.vmap(lambda x: data.patchify(x, 2))(xs)),
                                  pb[0])


def test_patchify_errors():
    with pytest.raises(ValueError, match=r"6×8 image cannot be cut into 3×3.*divide both: "
                                         r"\[1, 2\]"):
        data.patchify(np.zeros((6, 8)), 3)
    with pytest.raises(ValueError, match="patch must be a positive integer"):
        data.patchify(np.zeros((6, 8)), 0)
    with pytest.raises(ValueError, match=r"expected an image \(H, W\) or \(H, W, C\)"):
        data.patchify(np.zeros((2, 3, 6, 8)), 2)
    with pytest.raises(ValueError, match="do not tile"):
        data.unpatchify(np.zeros((12, 4)), (6, 6))
    with pytest.raises(ValueError, match="do not tile"):
        data.unpatchify(np.zeros((12, 5)), (6, 8))


def _small_images(n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 256, (n, 8, 8)).astype(np.uint8)  # no zero pixels: masks are visible
    y = rng.integers(0, 3, n)
    return data.ImageDataset((x[:24], y[:24]), (x[24:32], y[24:32]), (x[32:], y[32:]),
                             batch_size=5, seed=3)


def test_reconstruction_batches():
    """Masked batches: the clean images in [0, 1] as targets, the same pixels in the inputs
    except a fraction set to 0, the same corruption every time a batch is asked for, a
    different one for another batch; the baselines are the MSEs they name."""
    images = _small_images()
    ds = data.ImageReconstruction(images, "mask", mask_fraction=0.3)
    assert ds.kind == "reconstruction" and ds.image_shape == (8, 8)
    b = ds.batch(1, "val")  # 3 of its 5 examples are in the split (the rest wrap: mask 0)
    rows, mask = images.batch_rows(1, "val")
    np.testing.assert_allclose(b["targets"], images.split_arrays("val")[0][rows] / 255.0,
                               rtol=1e-6)
    np.testing.assert_array_equal(b["mask"], mask)
    masked = b["inputs"] == 0
    assert 0.2 < masked.mean() < 0.4
    np.testing.assert_array_equal(b["inputs"][~masked], b["targets"][~masked])
    assert mask.sum() == 3
    np.testing.assert_array_equal(ds.batch(1, "val")["inputs"], b["inputs"])
    assert not np.array_equal(ds.batch(0, "val")["inputs"] == 0, masked)
    base = ds.baselines(b)
    m = b["mask"]
    identity = (((b["inputs"] - b["targets"]) ** 2).mean(axis=(1, 2)) * m).sum() / m.sum()
    np.testing.assert_allclose(base["identity_mse"], identity, rtol=1e-6)
    noisy = data.ImageReconstruction(images, "noise", noise_variance=0.5).batch(0)
    assert noisy["inputs"].min() >= 0 and noisy["inputs"].max() <= 1
    assert not np.allclose(noisy["inputs"], noisy["targets"])
    with pytest.raises(ValueError, match="corrupt"):
        data.ImageReconstruction(images, "blur")
    with pytest.raises(ValueError, match="mask_fraction"):
        data.ImageReconstruction(images, "mask", mask_fraction=0.0)


def test_reconstructor_maps_each_site_back_to_its_patch():
    """The output image is the sites' pixel maps put back where the patch embedding took
    them from (unpatchify is the inverse of the embedding's patchify)."""
    from spinformer import nn

    p = 2
    model = nn.ImageReconstructor((8, 6), dim=8, depth=2, num_heads=2, patch=p,
                                  ffn_hidden=8, key=jax.random.key(0))
    img = jax.random.uniform(jax.random.key(1), (8, 6))
    out, diag = model(img, return_diagnostics=True)
    assert out.shape == (8, 6)
    x = model.embed(img) + model.pos_embed
    from spinformer.nn._image import _apply

    x, _ = _apply(model.layers, model.depth, x, None, False)
    sites = jax.vmap(model.unembed)(jax.vmap(model.norm)(x))  # (N, p²)
    patches = einops.rearrange(out, "(h p) (w q) -> (h w) (p q)", p=p, q=p)
    np.testing.assert_allclose(patches, sites, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="patch"):
        nn.ImageReconstructor((8, 6), dim=8, patch=4, key=jax.random.key(0))


def test_reconstruction_trains_below_the_identity_baseline(tmp_path):
    """`data.corrupt: mask` end to end through the trainer: the loss is the MSE per pixel,
    no accuracy is reported, and a short run restores masked digits better than returning
    the corrupted image does."""
    import spinformer as sf

    cfg = sf.config.load_config(pathlib.Path(__file__).parents[2] / "configs" /
                                "fmnist_softmax.yaml").replace({
        "data.task": "digits", "data.corrupt": "mask", "data.batch_size": 32,
        "data.eval_batches": 4, "model.embed": "patch", "model.patch": 2, "model.dim": 16,
        "model.depth": 1, "model.ffn_hidden": 32, "train.steps": 150,
        "train.warmup_steps": 10, "train.lr": 3e-3, "train.eval_every": 150,
        "train.progress": False})
    summary = sf.train.run(cfg, tmp_path / "run")
    m = summary["metrics"]
    assert "accuracy" not in m and m["mse"] == m["loss"]
    assert m["mse"] < 0.8 * summary["baselines"]["identity_mse"]
    with pytest.raises(sf.config.ConfigError, match="embed=patch"):
        sf.train.build_model(cfg.replace({"model.embed": "conv"}),
                             sf.train.build_dataset(cfg), key=jax.random.key(0))
    with pytest.raises(sf.config.ConfigError, match="data.corrupt='mask' is read only by "
                       "data.task fashion_mnist or digits"):
        cfg.replace({"data.task": "brackets", "data.corrupt": "mask"})
    assert cfg.replace({"data.task": "brackets"}).data.corrupt is None  # left behind
