"""Sharded checkpoint directories on small hand-made folders, without DCP writing anything or a process group:
the index (.metadata) is read without running code and checked against the directory (checkpoint/sharded_index.py),
and directories are recognised, published, copied and removed (checkpoint/dirs.py)."""
from __future__ import annotations

import os
import pickle

import pytest
import torch
from taskfit.checkpoint.dirs import (
    MARKER,
    STATE_FILE,
    checkpoint_exists,
    copy_checkpoint,
    is_sharded,
    publish,
    remove_checkpoint,
    require_complete,
)
from taskfit.checkpoint.sharded_index import SafeReader, crc_line, file_crc, fingerprint, read_index
from taskfit.errors import CheckpointError
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)


def tensor_entry(numel: int) -> TensorStorageMetadata:
    size = torch.Size([numel])
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, [ChunkStorageMetadata(torch.Size([0]),
                                                                                                      size)])


def make_checkpoint(path, files=None, stored=None, state=None, marker=True):
    """A sharded checkpoint directory: shard ``files`` (name: bytes), an index storing ``stored`` (fqn: (file, offset,
    length)) and, with ``marker``, a COMPLETE marker recording each shard file's size and fingerprint."""
    files = {"__0_0.distcp": bytes(16), "__1_0.distcp": bytes(range(16))} if files is None else files
    stored = {"w": ("__0_0.distcp", 0, 16), "b": ("__1_0.distcp", 0, 16)} if stored is None else stored
    os.makedirs(path, exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as fh:
            fh.write(data)
    index = Metadata(state_dict_metadata=state if state is not None else {k: tensor_entry(4) for k in stored},
                     storage_data={MetadataIndex(fqn, torch.Size([0])): _StorageInfo(rel, offset, length)
                                   for fqn, (rel, offset, length) in stored.items()})
    with open(os.path.join(path, ".metadata"), "wb") as fh:
        pickle.dump(index, fh)
    if marker:
        lines = ["taskfit sharded checkpoint, 2 shard file(s); complete"]
        lines += [f"shard {name} {' '.join(map(str, fingerprint(os.path.join(path, name))))}" for name in files]
        with open(os.path.join(path, MARKER), "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return str(path)


def refusal(path) -> str:
    with pytest.raises(CheckpointError) as info:
        read_index(path)
    return str(info.value)


# ---- the index and the directory agree ------------------------------------------------------------------------
def test_a_complete_checkpoint_reads_its_index(tmp_path):
    path = make_checkpoint(tmp_path / "ok")
    index = read_index(path)
    assert isinstance(index, Metadata) and sorted(i.fqn for i in index.storage_data) == ["b", "w"]
    assert SafeReader(path, index).read_metadata() is index


def test_an_index_pointing_outside_the_directory_is_refused(tmp_path):
    (tmp_path / "outside.distcp").write_bytes(bytes(16))
    path = make_checkpoint(tmp_path / "ckpt", files={}, stored={"w": ("../outside.distcp", 0, 16)}, marker=False)
    message = refusal(path)
    assert f"Refused to load {path}: its index (.metadata) stores w in '../outside.distcp', which is outside the " \
           "checkpoint directory. Nothing was read." in message


def test_a_missing_shard_file_is_named(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", marker=False)
    os.remove(os.path.join(path, "__1_0.distcp"))
    assert f"{os.path.join(path, '__1_0.distcp')} is missing: the index (.metadata) of {path} stores data in it." \
        in refusal(path)


def test_a_truncated_shard_file_is_named_with_its_sizes(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", files={"__0_0.distcp": bytes(8)}, stored={"w": ("__0_0.distcp", 0, 16)},
                           marker=False)
    assert "is shorter than the index (.metadata) says: 8 bytes, with data up to byte 16" in refusal(path)


@pytest.mark.parametrize("content, damage", [
    (b"", "EOFError"),
    (b"not a pickle at all", "UnpicklingError"),
    (pickle.dumps({"a": 1}), "it holds a dict, not DCP's index"),
])
def test_a_damaged_index_is_one_error_with_what_to_do(tmp_path, content, damage):
    path = make_checkpoint(tmp_path / "ckpt")
    with open(os.path.join(path, ".metadata"), "wb") as fh:
        fh.write(content)
    message = refusal(path)
    assert message.startswith(f"Cannot read {os.path.join(path, '.metadata')}, the index of the sharded checkpoint: "
                              "it is damaged (") and damage in message
    assert "HINT: copy the whole checkpoint directory again" in message


class RunsCode:
    def __init__(self, flag):
        self.flag = flag

    def __reduce__(self):
        return os.mkdir, (self.flag,)


def test_an_index_that_would_run_code_is_refused_without_running_it(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt")
    flag = str(tmp_path / "code-ran")
    with open(os.path.join(path, ".metadata"), "wb") as fh:
        pickle.dump(RunsCode(flag), fh)
    message = refusal(path)
    assert "it needs to import and call `posix.mkdir`, which a checkpoint index never needs" in message
    assert "Nothing in it was executed." in message and not os.path.exists(flag)


def test_entries_stored_as_pickled_objects_are_refused(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", state={"w": tensor_entry(4), "optimizer_extra": BytesStorageMetadata()})
    assert f"Refused to load {path}: its entries ['optimizer_extra'] are pickled objects" in refusal(path)


# ---- the COMPLETE marker's fingerprints ---------------------------------------------------------------------------
def test_swapped_shard_files_are_named_as_swapped(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt")
    first, second = (os.path.join(path, n) for n in ("__0_0.distcp", "__1_0.distcp"))
    os.rename(first, first + ".tmp")
    os.rename(second, first)
    os.rename(first + ".tmp", second)
    message = refusal(path)
    assert "is not the shard file written under that name: it holds the data written as" in message
    assert "(shard files swapped or renamed)" in message


def test_a_shard_file_changed_since_it_was_written_is_named(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt")
    with open(os.path.join(path, "__1_0.distcp"), "r+b") as fh:
        fh.write(b"\xff")
    assert "it changed since it was written (16 bytes now, 16 then: truncated or damaged)" in refusal(path)


def test_every_byte_of_a_shard_file_is_checked_against_its_recorded_crc32(tmp_path):
    """Damage between the 64 KiB ends the fingerprint reads is refused by the CRC-32 of every byte
    (issue 47, row 3); a marker without crc32 lines (an older taskfit's) is checked by its
    fingerprints only."""
    # 300 KiB
    big = bytes(range(256)) * 1200
    files = {"__0_0.distcp": big, "__1_0.distcp": bytes(16)}
    stored = {"w": ("__0_0.distcp", 0, len(big)), "b": ("__1_0.distcp", 0, 16)}
    path = make_checkpoint(tmp_path / "ckpt", files=files, stored=stored)
    old = make_checkpoint(tmp_path / "old", files=files, stored=stored)
    with open(os.path.join(path, MARKER), "a") as fh:
        fh.write("".join(crc_line(os.path.join(path, name)) + "\n" for name in files))
    read_index(path)
    assert f"crc32 __0_0.distcp {len(big)} {file_crc(os.path.join(path, '__0_0.distcp')):08x}" in \
        open(os.path.join(path, MARKER)).read()
    for folder in (path, old):
        with open(os.path.join(folder, "__0_0.distcp"), "r+b") as fh:
            fh.seek(len(big) // 2)
            fh.write(b"\xff" * 16)
    message = refusal(path)
    assert message.startswith(f"Sharded checkpoint {path} is damaged: the bytes of its shard file "
                              "__0_0.distcp do not match the checksum COMPLETE recorded when it "
                              "was written (crc32 ")
    assert 'fit(ckpt_path="last") falls back to the newest intact one' in message
    # (only what its marker records is checked)
    read_index(old)


def test_fingerprint_is_the_size_and_a_digest_of_the_ends(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * 300_000)
    b.write_bytes(b"x" * 299_999 + b"y")
    size, digest = fingerprint(str(a))
    assert size == 300_000 and len(digest) == 32
    assert fingerprint(str(b)) != fingerprint(str(a))  # the last bytes count
    b.write_bytes(b"x" * 299_999)
    assert fingerprint(str(b))[0] == 299_999


# ---- dirs: recognising, publishing, copying, removing ----------------------------------------------------------
def test_what_counts_as_a_sharded_checkpoint_and_a_complete_one(tmp_path):
    (tmp_path / "file.ckpt").write_bytes(b"x")
    for name, content in (("writing", STATE_FILE), ("complete", MARKER), ("other", "notes.txt")):
        (tmp_path / name).mkdir()
        (tmp_path / name / content).write_text("")
    assert [is_sharded(str(tmp_path / n)) for n in ("writing", "complete", "other", "file.ckpt")] == \
        [True, True, False, False]
    assert [checkpoint_exists(str(tmp_path / n)) for n in ("writing", "complete", "file.ckpt", "nothing")] == \
        [False, True, True, False]
    require_complete(str(tmp_path / "complete"))
    with pytest.raises(CheckpointError, match=r"writing is an incomplete sharded checkpoint \(no COMPLETE marker\): "
                                              r"it was being written, copied or deleted when that stopped\."):
        require_complete(str(tmp_path / "writing"))


def test_publish_puts_a_directory_in_place_and_replaces_an_older_checkpoint(tmp_path):
    old = make_checkpoint(tmp_path / "last.ckpt", files={"__0_0.distcp": b"old"}, stored={}, marker=True)
    new = make_checkpoint(tmp_path / ".last.ckpt.tmp", files={"__0_0.distcp": b"new"}, stored={}, marker=True)
    publish(new, old)
    assert (tmp_path / "last.ckpt" / "__0_0.distcp").read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]  # neither the temporary nor the replaced one is left
    fresh = make_checkpoint(tmp_path / ".tmp2", files={"__0_0.distcp": b"2"}, stored={})
    publish(fresh, str(tmp_path / "epoch=1.ckpt"))
    assert sorted(os.listdir(tmp_path)) == ["epoch=1.ckpt", "last.ckpt"]


def test_publish_never_replaces_a_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "mine.txt").write_text("keep")
    tmp = make_checkpoint(tmp_path / ".tmp", files={"__0_0.distcp": b"x"}, stored={})
    with pytest.raises(CheckpointError) as info:
        publish(tmp, str(tmp_path / "results"))
    assert f"Could not write the sharded checkpoint {tmp_path / 'results'}" in str(info.value)
    assert "a directory that is not a checkpoint has its name" in str(info.value)
    assert (tmp_path / "results" / "mine.txt").read_text() == "keep" and not os.path.exists(tmp)


def test_copy_and_remove_a_checkpoint_directory(tmp_path):
    src = make_checkpoint(tmp_path / "epoch=3.ckpt")
    copy_checkpoint(src, str(tmp_path / "best.ckpt"))
    assert sorted(os.listdir(tmp_path / "best.ckpt")) == sorted(os.listdir(src))
    assert read_index(str(tmp_path / "best.ckpt")).storage_data.keys() == read_index(src).storage_data.keys()
    remove_checkpoint(src)
    remove_checkpoint(src)  # already gone: fine
    (tmp_path / "single.ckpt").write_bytes(b"x")
    remove_checkpoint(str(tmp_path / "single.ckpt"))
    assert sorted(os.listdir(tmp_path)) == ["best.ckpt"]
