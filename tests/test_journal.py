"""Journals (docs/FORMAT.md, "Journals"): an append-only log per writer in a local root. What a
reader gets back after kills, torn writes, damaged bytes, another key, a full disk, rotation and
timeline restarts."""

from __future__ import annotations

import os

import pytest

from ckptstore.codec.crypto import RawKey
from ckptstore.journal import Journal

from helpers import small_tmpfs

KEY = RawKey(bytes(range(32)))


def _j(root, name="loader-g0.w1.rank0", keep=4, master=None) -> Journal:
    return Journal(root, name, scope="loader-g0", keep=keep, master=master)


def _files(root) -> list[str]:
    return sorted(os.listdir(os.path.join(root, "journals")))


@pytest.mark.parametrize("master", [None, KEY], ids=["checksummed", "encrypted"])
def test_records_read_back_after_reopening_and_rotation_keeps_the_newest(tmp_path, master):
    j = _j(tmp_path, keep=4, master=master)
    for s in range(1, 12):
        j.append(s, b"pos-%d" % s)
    j.close()
    got = _j(tmp_path, keep=4, master=master).read()
    # rotation: the previous file and the current one hold at least the newest `keep`, oldest first
    assert [s for s, _b in got] == list(range(max(1, 12 - len(got)), 12)) and len(got) >= 4
    assert all(b == b"pos-%d" % s for s, b in got)
    assert _files(tmp_path) == ["loader-g0.w1.rank0.log", "loader-g0.w1.rank0.prev.log"]
    raw = b"".join(open(os.path.join(tmp_path, "journals", f), "rb").read() for f in _files(tmp_path))
    assert (b"pos-11" in raw) == (master is None)  # encrypted: no body in the clear


def test_a_torn_tail_is_cut_and_the_next_record_follows_the_last_good_one(tmp_path):
    j = _j(tmp_path, keep=100)
    for s in range(1, 6):
        j.append(s, b"x" * 100)
    j.close()
    path = os.path.join(tmp_path, "journals", "loader-g0.w1.rank0.log")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # a kill in the middle of the last write
        f.truncate(size - 37)
    assert [s for s, _b in _j(tmp_path, keep=100).read()] == [1, 2, 3, 4]
    j = _j(tmp_path, keep=100)
    j.append(6, b"y")
    assert [s for s, _b in j.read()] == [1, 2, 3, 4, 6]


def test_a_damaged_byte_ends_the_journal_before_it(tmp_path):
    j = _j(tmp_path, keep=100, master=KEY)
    for s in range(1, 6):
        j.append(s, b"x" * 100)
    j.close()
    path = os.path.join(tmp_path, "journals", "loader-g0.w1.rank0.log")
    data = bytearray(open(path, "rb").read())
    rec = (len(data) - data.index(b"CKF1", 1)) // 5  # the records' length (all the same)
    data[len(data) - 3 * rec + 60] ^= 0x40  # inside record 3
    open(path, "wb").write(data)
    assert [s for s, _b in _j(tmp_path, keep=100, master=KEY).read()] == [1, 2]
    j = _j(tmp_path, keep=100, master=KEY)  # appends after the last good record
    j.append(7, b"z")
    assert [s for s, _b in j.read()] == [1, 2, 7]


def test_a_record_moved_between_journals_does_not_authenticate(tmp_path):
    a = _j(tmp_path, "loader-g0.w1.rank0", keep=100, master=KEY)
    b = _j(tmp_path, "loader-g0.w1.rank1", keep=100, master=KEY)
    a.append(1, b"a1")
    b.append(1, b"b1")
    b.append(2, b"b2")
    pa = os.path.join(tmp_path, "journals", "loader-g0.w1.rank0.log")
    pb = os.path.join(tmp_path, "journals", "loader-g0.w1.rank1.log")
    rb = open(pb, "rb").read()
    last = rb[rb.rindex(b"CKF1"):]
    with open(pa, "ab") as f:  # b's record appended to a's file: a valid frame, the wrong journal
        f.write(last)
    assert a.read() == [(1, b"a1")]


def test_another_key_or_a_foreign_file_is_not_read_and_a_new_journal_starts(tmp_path):
    j = _j(tmp_path, keep=100, master=KEY)
    j.append(1, b"secret")
    j.close()
    other = RawKey(b"\x01" * 32)
    assert _j(tmp_path, keep=100, master=other).read() == []
    assert _j(tmp_path, keep=100, master=None).read() == []  # encrypted, and no key
    for junk in (b"", b"not a journal", b"CKF1" + b"\0" * 60):
        with open(os.path.join(tmp_path, "journals", "loader-g0.w1.rank0.log"), "wb") as f:
            f.write(junk)
        j = _j(tmp_path, keep=100, master=other)  # replaced by a new journal, with a warning
        j.append(5, b"new")
        assert j.read() == [(5, b"new")]
        j.close()


def test_a_reset_abandons_the_timeline_and_a_step_taken_again_replaces_the_newer_records(tmp_path):
    j = _j(tmp_path, keep=10)
    for s in (1, 2, 3, 4, 5):
        j.append(s, b"a%d" % s)
    j.append(5, b"again")  # the same step again (it did not commit): the newer record wins
    assert j.read()[-1] == (5, b"again")
    j.append(3, b"b3")  # a timeline restarted at an older step: 4 and 5 are abandoned
    assert [(s, b) for s, b in j.read()][-2:] == [(2, b"a2"), (3, b"b3")]
    j.reset()
    assert j.read() == []
    j.append(4, b"c4")
    for s in range(5, 15):  # the reset is in the previous file now, then gone with it
        j.append(s, b"c%d" % s)
    j.close()
    got = _j(tmp_path, keep=10).read()
    assert got == [(s, b"c%d" % s) for s in range(4, 15)][-len(got):] and len(got) >= 10


@pytest.fixture
def tiny(tmp_path):
    with small_tmpfs(tmp_path / "tiny", size="64k") as d:
        yield d


def test_a_full_disk_raises_oserror_and_keeps_every_record_written(tiny):
    j = _j(tiny, keep=10_000)
    n = 0
    with pytest.raises(OSError):
        for n in range(1, 10_000):
            j.append(n, os.urandom(3000))
    j.close()
    got = _j(tiny, keep=10_000).read() if os.path.getsize(os.path.join(tiny, "journals",
                                                                          "loader-g0.w1.rank0.log")) else []
    assert [s for s, _b in got] == list(range(1, n)), (n, [s for s, _b in got][-3:])
