"""Real memory accounting (dlo_fn.io.memstat): parsers, this process, a shared mapping across two real
processes, and the cgroup counters where readable."""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys

import pytest

from dlo_fn.io.memstat import (
    _cgroup_dir,
    cgroup_memory,
    file_mappings,
    format_bytes,
    host_description,
    in_mappings,
    mapped_file_memory,
    parse_kv_stat,
    parse_smaps_rollup,
    process_memory,
    sum_memory,
    tree_memory,
)

MB = 1 << 20

ROLLUP = """\
55d0c0000000-7ffc00000000 ---p 00000000 00:00 0                          [rollup]
Rss:                1768 kB
Pss:                 430 kB
Pss_Anon:            112 kB
Pss_File:            318 kB
Private_Clean:        56 kB
Private_Dirty:       112 kB
Anonymous:           112 kB
"""


def test_parsers():
    fields = parse_smaps_rollup(ROLLUP)
    assert (
        fields["Rss"] == 1768 * 1024 and fields["Pss_File"] == 318 * 1024 and "55d0c0000000-7ffc00000000" not in fields
    )
    assert parse_smaps_rollup(ROLLUP + ROLLUP)["Pss"] == 2 * 430 * 1024  # smaps: per-mapping lines summed
    assert parse_kv_stat("anon 10\nfile 20\nbogus\nworkingset_x -1\n") == {"anon": 10, "file": 20, "workingset_x": -1}


def test_cgroup_dir_handles_namespaced_mounts():
    assert str(_cgroup_dir("/", "/sys/fs/cgroup", "/a/b")) == "/sys/fs/cgroup/a/b"
    assert str(_cgroup_dir("/a", "/sys/fs/cgroup/memory", "/a/b")) == "/sys/fs/cgroup/memory/b"
    assert str(_cgroup_dir("/", "/sys/fs/cgroup", "/")) == "/sys/fs/cgroup"


def test_in_mappings():
    ranges = [(100, 200), (300, 400)]
    assert in_mappings(ranges, 100, 100) and in_mappings(ranges, 350, 50)
    assert not in_mappings(ranges, 150, 100) and not in_mappings(ranges, 250, 10) and not in_mappings([], 1, 1)


def test_anonymous_memory_shows_in_uss():
    before = process_memory()
    # A fresh anonymous mapping, touched so its pages are resident (a bytearray could reuse heap pages that an
    # earlier test left resident, and add nothing).
    block = mmap.mmap(-1, 64 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(0, len(block), 4096):
        block[i] = 1
    after = process_memory()
    assert after.uss_bytes - before.uss_bytes > 60 * MB
    assert after.pss_anon_bytes - before.pss_anon_bytes > 60 * MB
    assert after.hwm_bytes >= after.rss_bytes >= after.pss_bytes
    block.close()


_CHILD = """
import mmap, sys
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
s = sum(m[i] for i in range(0, len(m), 4096))
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.mark.slow
def test_shared_file_mapping_is_split_between_processes(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(48 * MB))
    with path.open("rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        before = process_memory()
        sum(m[i] for i in range(0, len(m), 4096))
        alone = process_memory()
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout.readline().strip() == "ready"
            mine = mapped_file_memory([path])
            theirs = process_memory(child.pid)
            tree = tree_memory()
            assert file_mappings([path])[str(path.resolve())]
        finally:
            child.stdin.write("\n")
            child.stdin.flush()
            child.wait(timeout=30)
        m.close()
    assert alone.pss_file_bytes - before.pss_file_bytes > 46 * MB  # mapped once: all ours
    assert mine["rss_bytes"] == 48 * MB and mine["pss_bytes"] == 24 * MB  # mapped twice: half each
    assert theirs.rss_bytes > 48 * MB and theirs.uss_bytes < theirs.rss_bytes - 46 * MB
    sums = sum_memory(tree)
    assert {p.pid for p in tree} >= {os.getpid(), child.pid}
    assert sums["rss_bytes"] - sums["pss_bytes"] > 46 * MB  # the shared pages counted once in PSS


def test_cgroup_counts_page_cache(tmp_path):
    before = cgroup_memory()
    if before is None:
        pytest.skip("no readable cgroup memory controller on this machine")
    assert before.version in (1, 2) and before.current_bytes > 0
    # The cgroup's counters are shared with everything else in it (other processes' page cache is reclaimed or
    # written back at any moment), so one 32 MB write can be masked: try a few times with new files.
    deltas = []
    for attempt in range(4):
        before = cgroup_memory()
        (tmp_path / f"blob{attempt}").write_bytes(os.urandom(32 * MB))  # new page cache, charged to our cgroup
        after = cgroup_memory()
        deltas.append((after.file_bytes - before.file_bytes, after.current_bytes - before.current_bytes))
        if deltas[-1][0] > 24 * MB and deltas[-1][1] > 24 * MB:
            break
    else:
        pytest.fail(f"writing 32 MB never raised the cgroup's file and current bytes by 24 MB: {deltas}")


def test_host_description_names_no_host():
    text = host_description()
    assert "cores" in text and "RAM" in text and socket.gethostname() not in text
    assert format_bytes(1.5e9) == "1.50 GB" and format_bytes(12) == "12 B"


def test_unknown_pid():
    with pytest.raises(ProcessLookupError):
        process_memory(2**22 + 12345)
