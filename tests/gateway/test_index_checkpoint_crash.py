"""A gateway killed while it writes its index checkpoint (gateway/core/index_checkpoint.py): a
child process writes checkpoints of a sizeable index one after another and is SIGKILLed at
random points, until 3 kills have landed inside a write (at most 20). Each time the file at the
checkpoint's path is a whole checkpoint (the last one completed, or the one whose rename the
kill just missed), loaded intact; the half-written temporary file is refused if handed to
`load`, and the next writer's restore removes it (a crashed writer's leftovers would otherwise
pile up beside the checkpoint). Real files, a real process, a real kill."""
from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path


from gateway.core.index import KvIndex
from gateway.core.index_checkpoint import load, remove_leftovers, temporary_path
from gateway.core.index_table import page_keys
from tests.gateway.test_index_checkpoint import DEVICE, SPEC

PAGES = 300_000  # a ~10 MB checkpoint: tens of milliseconds a write here
REPO = Path(__file__).resolve().parents[2]

# The child: worker w0 stores PAGES pages in batch 0, then one new page per batch; after each
# batch a checkpoint, and "done G" once the checkpoint of batch G is in place.
_CHILD = """
import sys
from gateway.core.index import KvIndex
from gateway.core.index_checkpoint import capture, write
from tests.gateway.test_index_checkpoint_crash import batch
path, spec, pages = sys.argv[1], sys.argv[2], int(sys.argv[3])
index = KvIndex()
for seq in range(10**9):
    index.apply(batch(seq, pages))
    write(capture(index, {}, "default", spec), path)
    print("done", seq, flush=True)
"""


def _page(i: int) -> bytes:
    return i.to_bytes(8, "little") * 2


def batch(seq: int, pages: int):
    from prefixcache.v1 import events_pb2
    hashes = [_page(i) for i in range(pages)] if seq == 0 else [_page(pages + seq)]
    ev = events_pb2.KvEvent(stored=events_pb2.BlockStored(block_hashes=hashes, medium=DEVICE))
    return events_pb2.EventBatch(pool_id="w0", epoch=0, seq=seq, events=[ev])


def _start(path: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", _CHILD, path, SPEC, str(PAGES)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, text=True)


def _begun(tmp: str) -> bool:
    """Whether a write has put bytes in `tmp`: a kill before the first buffer reaches the file
    leaves nothing to refuse (CI once saw 12 kills with only 2 mid-write, on a loaded machine)."""
    try:
        return os.path.getsize(tmp) > 0
    except OSError:  # not there, or renamed away since
        return False


def _kill_mid_write(proc: subprocess.Popen, rng: random.Random, tmp: str) -> tuple[int, bytes]:
    """Lets the child complete a first checkpoint, kills it at a random point of the writes
    that follow; the last seq it reported done, and what the temporary file held (b"" if none)."""
    assert proc.stdout.readline().split()[0] == "done"  # a whole checkpoint exists
    time.sleep(rng.uniform(0.05, 0.5))
    deadline = time.monotonic() + 2.0  # then into a write (bounded: a writer may not use `tmp`)
    while not _begun(tmp) and time.monotonic() < deadline:
        time.sleep(0.0005)
    time.sleep(rng.uniform(0, 0.004))
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    done = [int(line.split()[1]) for line in proc.stdout.read().splitlines() if line.startswith("done")]
    partial = Path(tmp).read_bytes() if os.path.exists(tmp) else b""
    return (done[-1] if done else 0), partial


def _whole(index: KvIndex) -> int:
    """Checks a loaded index is a whole checkpoint of the child's: its seq."""
    seq = index.info("w0").last_seq
    assert len(index) == PAGES + seq
    sample = [_page(i) for i in range(0, PAGES, 997)] + [_page(PAGES + s) for s in range(1, seq + 1)]
    assert index.pages("w0", DEVICE) >= page_keys(sample)
    return seq


def _refused(path: str, caplog) -> bool:
    index = KvIndex()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gateway.checkpoint"):
        if load(index, path, "default", SPEC) == ["w0"]:
            _whole(index)  # accepted: then it is whole (the kill came after its last byte)
            return False
    assert len(index) == 0 and not index.workers() and "index_checkpoint_ignored" in caplog.text
    return True


def test_a_writer_killed_mid_write_leaves_the_last_whole_checkpoint(tmp_path, caplog):
    path = str(tmp_path / "index.ckpt")
    tmp = temporary_path(path)
    rng = random.Random(31)
    half_written = kills = 0
    while half_written < 3 and kills < 20:  # kills at random points until 3 came mid-write
        kills += 1
        proc = _start(path)
        try:
            done, partial = _kill_mid_write(proc, rng, tmp)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        index = KvIndex()
        assert load(index, path, "default", SPEC) == ["w0"]
        assert _whole(index) in (done, done + 1)  # the kill may land between rename and print
        if partial:
            half_written += _refused(tmp, caplog)  # as the kill left it
        remove_leftovers(path)  # what a restarting gateway's restore does
        assert not os.path.exists(tmp)
    assert half_written == 3, f"{kills} kills, {half_written} inside a write"
    # Whatever byte a write stops at, what it left is refused.
    whole = Path(path).read_bytes()
    for cut in sorted(rng.sample(range(1, len(whole)), 8)):
        Path(tmp).write_bytes(whole[:cut])
        assert _refused(tmp, caplog), f"a checkpoint cut at byte {cut} of {len(whole)} was accepted"
