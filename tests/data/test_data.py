"""Data layer: every source round-trips exactly through Parquet, bad inputs fail cleanly."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DistributedSampler

from raytrain_mp.data import ParquetImageDataset, read_meta
from raytrain_mp.data.sources import make_synthetic_source
from raytrain_mp.ddp.distributed_eval import ShardSampler
from raytrain_mp.errors import UsageError

from helpers import assert_ordinary_modes, assert_usage_error, run_cli


def all_samples(root) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images, labels, ids) of both splits, ordered by source id."""
    images, labels, ids = [], [], []
    for split in ("train", "val"):
        ds = ParquetImageDataset(str(root), split)
        images += [ds.raw_image(i) for i in range(len(ds))]
        labels.append(ds.labels)
        ids.append(ds.ids)
    ids = np.concatenate(ids)
    order = np.argsort(ids)
    return np.stack(images)[order], np.concatenate(labels)[order], ids[order]


def test_digits_round_trip_is_exactly_sklearn(tmp_path, capsys):
    from sklearn.datasets import load_digits

    out = tmp_path / "digits"
    res = run_cli(capsys, "data", "prepare", "digits", "--out", str(out), "--json")
    assert res.code == 0, res.err
    assert res.last_json["train"] + res.last_json["val"] == 1797
    images, labels, ids = all_samples(out)
    digits = load_digits()
    assert ids.tolist() == list(range(1797))
    assert np.array_equal(images[..., 0], digits.images.astype(np.uint8))
    assert np.array_equal(digits.images, images[..., 0].astype(np.float64))  # no rounding happened
    assert np.array_equal(labels, digits.target)
    meta = read_meta(str(out))
    assert meta.image_shape == (8, 8, 1) and meta.num_classes == 10
    train = ParquetImageDataset(str(out), "train")
    image, y, params = train[0]
    assert image.shape == (1, 8, 8) and image.dtype == torch.uint8 and params.tolist() == [0] * 7
    x = train.transform(image[None], params[None], torch.device("cpu"), torch.float32)[0]
    expected = (train.raw_image(0).astype(np.float64) - meta.mean[0]) / meta.std[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32
    assert torch.allclose(x[0], torch.from_numpy(expected[..., 0]).float())


def write_cifar_batch(path, images_chw: np.ndarray, labels: list[int]) -> None:
    """A batch in the tarball's format: python-2 style bytes keys, (N, 3072) uint8, list labels."""
    batch = {
        b"batch_label": b"testing batch 1 of 1",
        b"labels": labels,
        b"data": images_chw.reshape(len(labels), -1),
        b"filenames": [f"img_{i}.png".encode() for i in range(len(labels))],
    }
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=2)


def test_cifar10_pickle_format(tmp_path, capsys):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    rng = np.random.default_rng(1)
    batches = []
    for i in range(1, 6):
        x = rng.integers(0, 256, size=(4, 3, 32, 32), dtype=np.uint8)
        y = rng.integers(0, 10, size=4).tolist()
        write_cifar_batch(root / f"data_batch_{i}", x, y)
        batches.append((x, y))
    test_x = rng.integers(0, 256, size=(3, 3, 32, 32), dtype=np.uint8)
    write_cifar_batch(root / "test_batch", test_x, [0, 9, 4])
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    with open(root / "batches.meta", "wb") as f:
        pickle.dump({b"num_cases_per_batch": 4, b"label_names": names, b"num_vis": 3072}, f, protocol=2)

    out = tmp_path / "prepared"
    res = run_cli(capsys, "data", "prepare", f"cifar10:{tmp_path}", "--out", str(out))
    assert res.code == 0, res.err
    meta = read_meta(str(out))
    assert meta.class_names[1] == "automobile" and meta.image_shape == (32, 32, 3)
    train = ParquetImageDataset(str(out), "train")
    all_x = np.concatenate([x for x, _ in batches]).transpose(0, 2, 3, 1)
    assert len(train) == 20
    for i in range(20):
        assert np.array_equal(train.raw_image(i), all_x[i])
    assert train.labels.tolist() == sum((y for _, y in batches), [])
    val = ParquetImageDataset(str(out), "val")
    assert np.array_equal(val.raw_image(2), test_x[2].transpose(1, 2, 0))
    assert val.labels.tolist() == [0, 9, 4]


def write_png_tree(root, sizes=None) -> dict[str, list[np.ndarray]]:
    from PIL import Image

    rng = np.random.default_rng(2)
    arrays = {}
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        arrays[cls] = []
        for i in range(5):
            h, w = (sizes or {}).get((cls, i), (6, 7))
            arr = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            Image.fromarray(arr).save(root / cls / f"{i}.png")
            arrays[cls].append(arr)
    return arrays


def test_imagefolder_pngs(tmp_path, capsys):
    arrays = write_png_tree(tmp_path / "tree")
    out = tmp_path / "prepared"
    res = run_cli(
        capsys, "data", "prepare", f"imagefolder:{tmp_path / 'tree'}", "--out", str(out), "--val-fraction", "0.3"
    )
    assert res.code == 0, res.err
    images, labels, ids = all_samples(out)
    expected = arrays["cat"] + arrays["dog"]  # ImageFolder order: classes sorted, files sorted
    assert ids.tolist() == list(range(10))
    assert all(np.array_equal(a, b) for a, b in zip(images, expected))
    assert labels.tolist() == [0] * 5 + [1] * 5
    assert read_meta(str(out)).class_names == ["cat", "dog"]


def test_the_validation_split_is_stratified_and_an_old_data_set_still_loads(tmp_path, capsys):
    from PIL import Image

    for cls in ("a", "b", "c"):
        (tmp_path / "tree" / cls).mkdir(parents=True)
        for i in range(40):
            Image.fromarray(np.full((2, 2, 3), i, dtype=np.uint8)).save(tmp_path / "tree" / cls / f"{i:02d}.png")
    out = tmp_path / "prepared"
    res = run_cli(capsys, "data", "prepare", f"imagefolder:{tmp_path / 'tree'}", "--out", str(out), "--seed", "3")
    assert res.code == 0, res.err
    assert "  val_per_class: {'a': 8, 'b': 8, 'c': 8}" in res.out.splitlines()
    assert "  train_per_class: {'a': 32, 'b': 32, 'c': 32}" in res.out.splitlines()
    assert np.bincount(ParquetImageDataset(str(out), "val").labels).tolist() == [8, 8, 8]
    assert read_meta(str(out)).class_counts == {"train": [32, 32, 32], "val": [8, 8, 8]}
    assert_ordinary_modes(out)
    # A data set from before per-class counts: its metadata has none, and it loads with its split.
    meta_file = out / "metadata.json"
    old = {key: value for key, value in json.loads(meta_file.read_text()).items() if key != "class_counts"}
    meta_file.write_text(json.dumps(old))
    assert read_meta(str(out)).class_counts is None and len(ParquetImageDataset(str(out), "val")) == 24


def test_synthetic_round_trip_identical_tensors(tmp_path, capsys):
    out = tmp_path / "syn"
    args = ["--num-samples", "40", "--image-size", "12", "--num-classes", "4", "--seed", "7", "--rows-per-shard", "9"]
    res = run_cli(capsys, "data", "prepare", "synthetic", "--out", str(out), *args)
    assert res.code == 0, res.err
    raw = make_synthetic_source(40, 12, 4, 3, 0.2, 7)
    meta = read_meta(str(out))
    assert len(meta.shards["train"]) == 4  # 32 rows in shards of 9
    for split, part in (("train", raw.train), ("val", raw.val)):
        ds = ParquetImageDataset(str(out), split)
        mean, std = np.asarray(meta.mean), np.asarray(meta.std)
        images, labels, params = ds.batch(range(len(ds)))
        assert torch.equal(images, torch.from_numpy(part.images.transpose(0, 3, 1, 2).copy()))
        assert labels.tolist() == part.labels.tolist()
        x = ds.transform(images, params, torch.device("cpu"), torch.float64)
        assert torch.equal(x, torch.from_numpy(((part.images - mean) / std).transpose(0, 3, 1, 2).copy()))
    again = ParquetImageDataset(str(out), "train", augment=True, seed=3)
    again.set_epoch(1)
    assert torch.equal(again[5][2], again[(1, 5)][2])  # augmentation is a function of (seed, epoch, index)
    assert any(not torch.equal(again[(2, i)][2], again[(1, i)][2]) for i in range(8))


@pytest.mark.parametrize("replicas", [2, 3])
def test_distributed_sampler_covers_each_index_once(tmp_path, replicas):
    raw = make_synthetic_source(24, 4, 2, 1, 0.2, 0)
    from raytrain_mp.data.prepare import write_dataset

    write_dataset(raw, tmp_path / "d")
    ds = ParquetImageDataset(str(tmp_path / "d"), "train")
    n = len(ds)
    assert n == 19  # a size neither replica count divides, so padding shows
    for epoch in (0, 1):
        shards = []
        for rank in range(replicas):
            sampler = DistributedSampler(ds, num_replicas=replicas, rank=rank, shuffle=True, seed=4)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        flat = sum(shards, [])
        padded = -(-n // replicas) * replicas
        assert len(flat) == padded and sorted(set(flat)) == list(range(n))
        assert len(flat) - len(set(flat)) == padded - n  # padding repeats exactly that many indices
        dropped = []
        for rank in range(replicas):
            sampler = DistributedSampler(ds, num_replicas=replicas, rank=rank, shuffle=True, seed=4, drop_last=True)
            sampler.set_epoch(epoch)
            dropped += list(sampler)
        assert len(dropped) == len(set(dropped)) == (n // replicas) * replicas
        exact = sum((list(ShardSampler(n, r, replicas)) for r in range(replicas)), [])
        assert sorted(exact) == list(range(n))  # evaluation: every index exactly once, no padding
    orders = []
    for epoch in (0, 1):
        s = DistributedSampler(ds, num_replicas=replicas, rank=0, shuffle=True, seed=4)
        s.set_epoch(epoch)
        orders.append(list(s))
    assert orders[0] != orders[1]  # set_epoch reshuffles


# ---------------------------------------------------------------- bad inputs


def assert_nothing_written(out) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


def test_unknown_source(tmp_path, capsys):
    res = run_cli(capsys, "data", "prepare", "mnist", "--out", str(tmp_path / "o"))
    assert_usage_error(res, "SOURCE", "'mnist'", "digits, synthetic, cifar10:PATH, imagefolder:PATH")
    assert_nothing_written(tmp_path / "o")


def test_unknown_option_real_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain_mp.cli", "data", "prepare", "digits", "--out", str(tmp_path / "o"),
         "--colour", "x"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["raytrain-mp: error: unrecognized arguments: --colour x"]
    assert_nothing_written(tmp_path / "o")


@pytest.mark.parametrize(
    "make, fragments",
    [
        (lambda p: f"cifar10:{p / 'missing'}", ["cifar10: no such folder", "missing"]),
        (lambda p: f"imagefolder:{p / 'missing'}", ["imagefolder: no such folder"]),
        (lambda p: (p / "empty").mkdir() or f"cifar10:{p / 'empty'}", ["expected data_batch_1..5 and test_batch"]),
        (lambda p: (p / "flat").mkdir() or f"imagefolder:{p / 'flat'}", ["not an ImageFolder tree"]),
    ],
)
def test_missing_path_and_wrong_layout(tmp_path, capsys, make, fragments):
    res = run_cli(capsys, "data", "prepare", make(tmp_path), "--out", str(tmp_path / "o"))
    assert_usage_error(res, *fragments)
    assert_nothing_written(tmp_path / "o")


def test_cifar_labels_out_of_range(tmp_path, capsys):
    root = tmp_path / "c"
    root.mkdir()
    x = np.zeros((2, 3, 32, 32), dtype=np.uint8)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        write_cifar_batch(root / name, x, [3, 12])
    res = run_cli(capsys, "data", "prepare", f"cifar10:{root}", "--out", str(tmp_path / "o"))
    assert_usage_error(res, "labels out of range", "0..9")
    assert_nothing_written(tmp_path / "o")


def test_empty_split(tmp_path, capsys):
    write_png_tree(tmp_path / "tree")
    res = run_cli(
        capsys,
        "data",
        "prepare",
        f"imagefolder:{tmp_path / 'tree'}",
        "--out",
        str(tmp_path / "o"),
        "--val-fraction",
        "0.01",
    )
    assert_usage_error(res, "--val-fraction 0.01", "empty train or val split")
    assert_nothing_written(tmp_path / "o")


def test_mixed_image_sizes(tmp_path, capsys):
    write_png_tree(tmp_path / "tree", sizes={("dog", 3): (9, 9)})
    res = run_cli(capsys, "data", "prepare", f"imagefolder:{tmp_path / 'tree'}", "--out", str(tmp_path / "o"))
    assert_usage_error(res, "--image-size")
    assert_nothing_written(tmp_path / "o")
    res = run_cli(
        capsys, "data", "prepare", f"imagefolder:{tmp_path / 'tree'}", "--out", str(tmp_path / "o"), "--image-size", "5"
    )
    assert res.code == 0 and read_meta(str(tmp_path / "o")).image_shape == (5, 5, 3)


def test_existing_out_is_not_clobbered(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = run_cli(capsys, "data", "prepare", "synthetic", "--out", str(out), "--num-samples", "10")
    assert_usage_error(res, "--out", "already exists", "--overwrite")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def prepared_synthetic(tmp_path) -> str:
    from raytrain_mp.data.prepare import write_dataset

    write_dataset(make_synthetic_source(30, 4, 3, 1, 0.2, 0), tmp_path / "d")
    return str(tmp_path / "d")


def test_truncated_shard(tmp_path, capsys, monkeypatch):
    import raytrain_mp.cluster

    def no_ray(address):
        raise AssertionError("Ray was asked for before the data was checked")

    monkeypatch.setattr(raytrain_mp.cluster, "ray_connection", no_ray)
    root = prepared_synthetic(tmp_path)
    shard = tmp_path / "d" / "train" / "part-00000.parquet"
    shard.write_bytes(shard.read_bytes()[:-40])
    with pytest.raises(UsageError, match="part-00000.parquet is not a readable Parquet shard"):
        ParquetImageDataset(root, "train")
    res = run_cli(capsys, "ddp", "--data", root, "--global-batch-size", "4", "--storage-path", str(tmp_path / "runs"))
    assert_usage_error(res, "train/part-00000.parquet", "truncated or corrupt")
    assert not (tmp_path / "runs").exists()


def test_shard_labels_out_of_range_and_wrong_rows(tmp_path):
    root = prepared_synthetic(tmp_path)
    shard = tmp_path / "d" / "val" / "part-00000.parquet"
    table = pq.read_table(shard)
    labels = pa.array([5] + table.column("label").to_pylist()[1:], type=pa.int64())
    pq.write_table(table.set_column(1, "label", labels), shard)
    with pytest.raises(UsageError, match=r"labels out of range \(.*\.\.5\); accepted: 0..2"):
        ParquetImageDataset(root, "val")
    pq.write_table(table.slice(0, 2), shard)
    with pytest.raises(UsageError, match="holds 2 rows but metadata says 6"):
        ParquetImageDataset(root, "val")


def test_not_a_dataset_folder(tmp_path, capsys):
    res = run_cli(capsys, "ddp", "--data", str(tmp_path))
    assert_usage_error(res, "--data", "holds no metadata.json")
    res = run_cli(capsys, "ddp", "--data", str(tmp_path / "nope"))
    assert_usage_error(res, "--data: no such data set folder")
