"""Append-only segment files (swarmrl.pool.state.segments) and the rollout store's use of them."""

from __future__ import annotations

import os

import pytest

from swarmrl.errors import DiskWriteError
from swarmrl.pool.state import segments
from swarmrl.pool.state.segments import Location, SegmentLog
from swarmrl.pool.state.store import RolloutStore, split_reference


def seg_files(folder):
    return sorted(n for n in os.listdir(folder) if n.endswith(".seg"))


def test_records_read_back_at_their_location_and_by_key(tmp_path):
    log = SegmentLog(str(tmp_path / "seg"))
    a = log.append("p/a", b"alpha")
    b = log.append("p/b", b"")
    c = log.append("p/a", b"alpha, again")
    assert log.read(a, "p/a") == b"alpha" and log.read(b, "p/b") == b""
    assert log.read(c, "p/a") == b"alpha, again"
    assert log.find("p/a") == c  # the last record of a key wins
    assert log.find("p/b") == b and log.find("p/none") is None
    log.delete("p/a")
    assert log.find("p/a") is None  # a tombstone hides it from a search by key...
    assert log.read(c, "p/a") == b"alpha, again"  # ...not from its location
    assert Location.parse(str(c)) == c
    assert len(seg_files(tmp_path / "seg")) == 1


def test_a_location_that_does_not_hold_the_record_is_refused(tmp_path):
    log = SegmentLog(str(tmp_path / "seg"))
    at = log.append("p/a", b"data")
    with pytest.raises(ValueError, match="not 'p/b'"):
        log.read(at, "p/b")  # same length of key, another key
    with pytest.raises(ValueError, match="no record"):
        log.read(Location(at.segment, at.offset, at.length + 1), "p/a")
    with pytest.raises(ValueError, match="no record"):
        log.read(Location(at.segment, at.offset + 1, at.length), "p/a")
    with pytest.raises(ValueError, match="cannot hold"):
        log.read(Location(at.segment, 3, 1), "p/a")
    with pytest.raises(FileNotFoundError):
        log.read(Location("0" * 20 + "-1-00000000.seg", at.offset, at.length), "p/a")
    for text in ["x", "a.seg@1+2", "../" + at.segment + "@1+2", f"{at.segment}@-1+2", ""]:
        with pytest.raises(ValueError, match="not a segment location"):
            Location.parse(text)


def test_segments_rotate_and_every_writer_finds_every_record(tmp_path):
    folder = str(tmp_path / "seg")
    one, two = SegmentLog(folder, segment_bytes=100), SegmentLog(folder, segment_bytes=100)
    where = {}
    for i in range(12):
        log = one if i % 2 else two  # two processes' logs in one folder
        where[f"k{i}"] = log.append(f"k{i}", bytes([i]) * 40)
    assert len(seg_files(folder)) >= 6  # past 100 bytes each starts a new segment
    reader = SegmentLog(folder)
    for key, location in where.items():
        assert reader.find(key) == location == one.find(key) == two.find(key)
        assert reader.read(location, key) == bytes([int(key[1:])]) * 40


def test_a_torn_tail_hides_only_the_record_it_cut(tmp_path):
    folder = tmp_path / "seg"
    log = SegmentLog(str(folder))
    kept = log.append("p/kept", b"x" * 50)
    torn = log.append("p/torn", b"y" * 50)
    path = folder / torn.segment
    os.truncate(path, torn.offset + 10)  # a crash in the middle of the last write
    restarted = SegmentLog(str(folder))
    assert restarted.find("p/kept") == kept and restarted.find("p/torn") is None
    with pytest.raises(ValueError, match="cut short"):
        restarted.read(torn, "p/torn")
    later = restarted.append("p/later", b"z")  # into a segment of its own
    assert later.segment != torn.segment
    assert SegmentLog(str(folder)).find("p/later") == later


def test_a_failed_write_leaves_no_part_of_its_record(tmp_path, monkeypatch):
    folder = tmp_path / "seg"
    log = SegmentLog(str(folder))
    first = log.append("p/first", b"a" * 30)
    real_write = os.write

    def half(fd, data):  # a disk that fills in the middle of the record
        return real_write(fd, data[: len(data) // 2])

    monkeypatch.setattr(segments.os, "write", half)
    with pytest.raises(OSError, match="wrote"):
        log.append("p/failed", b"b" * 30)
    monkeypatch.setattr(segments.os, "write", real_write)
    assert os.path.getsize(folder / first.segment) == first.offset + first.length
    after = log.append("p/after", b"c" * 30)
    assert after.segment != first.segment  # the next write starts a new segment
    reader = SegmentLog(str(folder))
    assert reader.find("p/first") == first and reader.find("p/after") == after
    assert reader.find("p/failed") is None


def test_writes_on_a_full_disk_leave_no_empty_segments(tmp_path, monkeypatch):
    folder = tmp_path / "seg"
    log = SegmentLog(str(folder))
    real_write = os.write

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(segments.os, "write", full)
    for i in range(6):  # each failed write used to leave a new empty segment behind
        with pytest.raises(OSError, match="No space left"):
            log.append(f"p/{i}", b"x" * 30)
    assert seg_files(folder) == []
    monkeypatch.setattr(segments.os, "write", real_write)
    kept = log.append("p/kept", b"y" * 30)  # room again: writing goes on
    assert seg_files(folder) == [kept.segment]
    assert SegmentLog(str(folder)).find("p/kept") == kept


def test_a_key_or_data_out_of_range_is_refused(tmp_path):
    log = SegmentLog(str(tmp_path / "seg"))
    with pytest.raises(ValueError, match="key"):
        log.append("", b"x")
    with pytest.raises(ValueError, match="key"):
        log.append("k" * 70_000, b"x")


def test_the_store_keeps_submissions_in_segments_and_finds_them_by_reference_or_key(tmp_path):
    store = RolloutStore(str(tmp_path / "rollouts"))
    refs = [store.put_request(f"pool/s{i}.parquet", b'{"n": %d}' % i) for i in range(20)]
    files = [p for p in (tmp_path / "rollouts").rglob("*") if p.is_file()]
    assert len(files) == 1 and files[0].parent == tmp_path / "rollouts" / "pool" / "segments"
    for i, ref in enumerate(refs):
        key, location = split_reference(ref)
        assert key == f"pool/s{i}.parquet" and location is not None
        assert store.get_request(ref) == store.get_request(key) == b'{"n": %d}' % i
    store.delete(refs[3])
    with pytest.raises(FileNotFoundError):
        store.get_request("pool/s3.parquet")
    with pytest.raises(ValueError, match="not a segment location"):
        store.get_request("pool/s4.parquet#elsewhere")
    # the bytes at a reference damaged: an error a reader reports, not a crash
    key, location = split_reference(refs[5])
    with open(tmp_path / "rollouts" / "pool" / "segments" / location.segment, "r+b") as f:
        f.seek(location.offset)
        f.write(b"\x00" * location.length)
    with pytest.raises(ValueError, match="zstd"):
        store.get_request(refs[5])


def test_a_full_disk_is_one_disk_write_error(tmp_path, monkeypatch):
    store = RolloutStore(str(tmp_path / "rollouts"))
    store.put_request("pool/a.parquet", b"{}")

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(segments.os, "write", full)
    with pytest.raises(DiskWriteError, match="No space left"):
        store.put_request("pool/b.parquet", b"{}")
