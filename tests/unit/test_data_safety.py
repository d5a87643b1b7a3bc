"""Data that fails safely: checksummed token files, ids inside the vocabulary, one-line errors for
bad inputs, corpus names kept inside the cache, no leftover folders, and workers that outlive the
process group's stop signals but not their parent."""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import data
import data.integrity
import data.sources
from base.signals import sigterm_raises
from data.prepare import cache_folder, prepare, read_meta, remove_stale_tmp_folders, verify
from data.windows import TokenWindows
from data.workers import PARENT_CHECK_S, WorkerInit, hardened_forks
from helpers import ROOT, make_cfg, process_state, python, still_running

preparation = importlib.import_module("data.prepare")  # `data.prepare` is the function
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, PR_SET_PDEATHSIG")


def _text_cfg(tmp_path: Path, *overrides: str):
    """data=text over tmp_path/corpus, prepared into tmp_path/cache."""
    return make_cfg(
        "data=text", f"data.files={tmp_path}/corpus/*.txt", f"data.cache_dir={tmp_path}/cache",
        "data.num_proc=1", *overrides,
    ).data  # fmt: skip


def _write_corpus(tmp_path: Path, texts: dict[str, bytes | str]) -> None:
    (tmp_path / "corpus").mkdir(exist_ok=True)
    for name, text in texts.items():
        path = tmp_path / "corpus" / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())


def _small_corpus(tmp_path: Path) -> None:
    line = "a line of a small corpus with enough words to fill some windows\n"
    _write_corpus(tmp_path, {"a.txt": line * 300, "b.txt": line * 300})


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.glob("*.tmp-*")) if cache.exists() else []


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


# ---- 1. token-file integrity


@pytest.fixture
def prepared_copy(tmp_path):
    """The bundled corpus, prepared once per session, copied into a cache of this test's own."""
    cfg = make_cfg().data
    folder = prepare(cfg)
    assert folder is not None
    cfg.cache_dir = str(tmp_path)
    copy = cache_folder(cfg)
    shutil.copytree(folder, copy)
    return cfg, copy


@pytest.mark.parametrize("loader,name", [("memmap", "train.bin"), ("text", "val.txt")])
def test_a_same_size_corruption_is_refused_on_load(prepared_copy, loader, name) -> None:
    cfg, folder = prepared_copy
    cfg.loader = loader
    data.load_splits(cfg, block_size=32, seed=0)  # whole: loads
    _flip_byte(folder / name, (folder / name).stat().st_size // 2)
    with pytest.raises(RuntimeError, match=f"{name} is corrupt: its content differs.*delete"):
        data.load_splits(cfg, block_size=32, seed=0)


def test_large_files_are_checked_by_sampled_blocks_and_fully_on_demand(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(data.integrity, "FULL_CHECK_BYTES", 1000)  # every file counts as large
    monkeypatch.setattr(data.integrity, "SAMPLE_BLOCK_BYTES", 64)
    _small_corpus(tmp_path)
    cfg = _text_cfg(tmp_path)
    folder = prepare(cfg)
    assert folder is not None
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["files"]["train.bin"]["bytes"] == 2 * meta["splits"]["train"]["tokens"]
    _flip_byte(folder / "train.bin", 100)  # between the first and second sampled blocks
    read_meta(folder, "train", "bin")  # the sampled check misses it...
    with pytest.raises(RuntimeError, match="train.bin is corrupt: its content differs"):
        verify(folder)  # ...the full one does not
    _flip_byte(folder / "train.bin", 10)  # inside the first block
    with pytest.raises(RuntimeError, match="train.bin is corrupt: 16 sampled blocks differ"):
        read_meta(folder, "train", "bin")


def test_prepare_script_verifies_on_demand(tmp_path) -> None:
    _small_corpus(tmp_path)
    cmd = [python(), "scripts/prepare_data.py", "data=text", f"data.files={tmp_path}/corpus/*.txt"]
    env = {**os.environ, "GPT2_RECIPE_CACHE": str(tmp_path / "cache")}
    run = lambda: subprocess.run(  # noqa: E731
        [*cmd, "--verify"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    out = run()
    assert out.returncode == 0, out.stderr
    assert "every file matches meta.json" in out.stdout
    folder = Path(out.stdout.strip().splitlines()[-1].split(": ", 1)[1])
    _flip_byte(folder / "val.txt", 5)
    out = run()
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"prepare_data.py: error: {folder / 'val.txt'} is corrupt: its content differs from what "
        f"meta.json records: delete {folder} and run again: it is prepared automatically on "
        "first use"
    ]


def test_a_garbled_or_old_meta_json_says_how_to_fix(prepared_copy) -> None:
    cfg, folder = prepared_copy
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text('{"name": "shakespeare", "spl')
    with pytest.raises(RuntimeError, match=f"meta.json is unreadable .*delete {folder}"):
        data.load_splits(cfg, block_size=32, seed=0)
    del meta["format"], meta["files"]  # what the previous format wrote
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RuntimeError, match="meta.json is not in this version's format.*delete"):
        data.load_splits(cfg, block_size=32, seed=0)


def test_a_corpus_is_prepared_again_when_its_content_changes_whatever_its_mtime(tmp_path) -> None:
    # `cp -p`, `rsync -a`, `touch -r`: a same-size edit that keeps the modification time.
    _small_corpus(tmp_path)
    cfg, path = _text_cfg(tmp_path), tmp_path / "corpus" / "a.txt"
    first = prepare(cfg)
    before = path.stat()
    path.write_text(path.read_text().replace("small", "SMALL"))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    again = prepare(cfg)
    assert first and again and again != first and "SMALL" in (again / "train.txt").read_text()
    # A prepared folder that does not hold what its sources hold (planted, or stale) is refused.
    shutil.rmtree(again)
    shutil.copytree(first, again)
    with pytest.raises(RuntimeError, match=rf"{again} was prepared from other sources.*delete"):
        data.load_splits(cfg, block_size=32, seed=0)


# ---- 2. token ids inside the vocabulary


def test_preparation_refuses_ids_outside_the_vocabulary(tmp_path, monkeypatch) -> None:
    class WrongTokenizer:
        def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
            return [[50300 if "bad" in t else 7] for t in texts]

    monkeypatch.setattr(preparation, "gpt2_encoding", WrongTokenizer)
    _write_corpus(tmp_path, {"a.txt": "good\n" * 50, "b.txt": "bad\n" * 50, "c.txt": "good\n"})
    with pytest.raises(ValueError, match=r"document 1 of the train split has token id 50300, out"):
        prepare(_text_cfg(tmp_path, "data.val_fraction=0.001"))
    assert _leftovers(tmp_path / "cache") == []


@pytest.mark.parametrize("bad_id", [50257, 50303, 50304, 65535])
def test_windows_never_hand_out_an_id_outside_the_vocabulary(tmp_path, bad_id: int) -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    tokens[500] = bad_id
    tokens.tofile(tmp_path / "train.bin")
    windows = TokenWindows(tmp_path / "train.bin", 16, 0, 1000, vocab_size=50257)
    items = [windows[i] for i in range(len(windows)) if i * 16 + 17 < 490]
    assert all(item.max() < 50257 for item in items)
    with pytest.raises(ValueError, match=f"train.bin is corrupt: token 500 is {bad_id}, outside"):
        for i in range(len(windows)):
            windows[i]


def test_synthetic_ids_beyond_gpt2s_vocabulary_are_refused() -> None:
    cfg = make_cfg("data=synthetic", "data.vocab_size=50304").data
    with pytest.raises(ValueError, match=r"data.vocab_size must be an integer in \[1, 50257\]"):
        data.check_config(cfg)
    with pytest.raises(ValueError, match="data.vocab_size"):
        data.load_splits(cfg, block_size=8, seed=0)
    data.check_config(make_cfg("data=synthetic", "data.vocab_size=50257").data)


# ---- 3. bad inputs: one line naming the file and what to do


def test_an_empty_corpus_is_refused(tmp_path) -> None:
    _write_corpus(tmp_path, {"empty.txt": ""})
    with pytest.raises(ValueError, match=r"data.files='.*corpus/\*.txt' holds no text .*empty"):
        prepare(_text_cfg(tmp_path))
    assert _leftovers(tmp_path / "cache") == []


def test_non_utf8_text_names_the_file_and_the_byte(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(data.sources, "_READ_BYTES", 3)  # characters cut between reads
    _write_corpus(tmp_path, {"a.txt": "fine\n", "b.txt": "héllo wö".encode() + b"\xff rest"})
    with pytest.raises(ValueError, match=r"b.txt is not UTF-8 text: byte 10 is 0xff .*iconv"):
        prepare(_text_cfg(tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_named(tmp_path) -> None:
    _small_corpus(tmp_path)
    (tmp_path / "corpus" / "b.txt").chmod(0)
    with pytest.raises(RuntimeError, match="cannot read .*b.txt: Permission denied: make it"):
        prepare(_text_cfg(tmp_path))


@LINUX
def test_a_file_failing_to_read_is_named(tmp_path) -> None:
    """An I/O error (even as root): reading /proc/self/mem at offset 0 fails with EIO."""
    _small_corpus(tmp_path)
    (tmp_path / "corpus" / "c.txt").symlink_to("/proc/self/mem")
    with pytest.raises(RuntimeError, match="cannot read .*mem: Input/output error: make it"):
        prepare(_text_cfg(tmp_path))


def test_files_that_match_nothing_or_only_folders_say_what_to_do(tmp_path) -> None:
    (tmp_path / "notes").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no file matches '.*nothing\*.txt'.*start from"):
        prepare(make_cfg("data=text", f"data.files={tmp_path}/nothing*.txt").data)
    with pytest.raises(FileNotFoundError, match=r"names only folders.*notes/\*\*/\*.txt"):
        prepare(make_cfg("data=text", f"data.files={tmp_path}/notes").data)


def test_a_full_disk_is_reported_as_such(tmp_path, monkeypatch) -> None:
    """train.bin written to /dev/full: every write fails with ENOSPC, as on a full disk."""

    def full_disk_open(path, mode="r", **kwargs):
        return open("/dev/full" if Path(path).name == "train.bin" else path, mode, **kwargs)

    monkeypatch.setattr(preparation, "open", full_disk_open, raising=False)
    _small_corpus(tmp_path)
    with pytest.raises(RuntimeError, match="could not write .*train.bin: .*No space left on dev"):
        prepare(_text_cfg(tmp_path))
    assert _leftovers(tmp_path / "cache") == []


# ---- 4. corpus names stay inside data.cache_dir


@pytest.mark.parametrize("name", ["../../x", "..", ".", "a/b", "/tmp/x", "x\\y", ""])
def test_a_corpus_name_cannot_leave_the_cache(tmp_path, name: str) -> None:
    _small_corpus(tmp_path)
    cfg = _text_cfg(tmp_path)
    cfg.name = name
    with pytest.raises(ValueError, match=r"data.name=.* a plain folder name"):
        prepare(cfg)
    assert list(tmp_path.iterdir()) == [tmp_path / "corpus"]


# ---- 5. no leftover folders


def test_stale_folders_of_dead_preparations_are_removed(tmp_path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    dead = subprocess.run([python(), "-c", "import os; print(os.getpid())"], capture_output=True)
    dead_pid = int(dead.stdout)
    host = preparation._HOST
    names = {
        "dead": f"text-0123456789.tmp-{host}-{dead_pid}",
        "alive": f"shakespeare-0123456789.tmp-{host}-{dead_pid}-x",  # its lock is held
        "ours": f"text-0123456789.tmp-{host}-{os.getpid()}",
        "other machine": f"text-0123456789.tmp-elsewhere-{dead_pid}",
    }
    for name in names.values():
        (cache / name).mkdir()
        (cache / name / "train.bin").write_bytes(b"partial")
    lock = cache / names["alive"] / preparation.LOCK
    hold = f"import fcntl, time; f = open({str(lock)!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
    alive = subprocess.Popen([python(), "-c", hold + "print(1, flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert alive.stdout.readline()  # the lock is taken
        removed = remove_stale_tmp_folders(cache)
        assert sorted(p.name for p in removed) == sorted([names["dead"], names["ours"]])
        assert _leftovers(cache) == sorted([names["alive"], names["other machine"]])
    finally:
        alive.kill()
        alive.wait()


# ---- 6. workers: deaf to the group's stop signals, dead with their parent


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`, found in /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(stat.parent.name))
    return children


def _hardened(pid: int) -> bool:
    """Whether a worker has blocked both stop signals and started the thread that screens them."""
    try:
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        )
    except OSError:
        return False
    stop_bits = sum(1 << (int(sig) - 1) for sig in (signal.SIGTERM, signal.SIGINT))
    blocked = int(status["SigBlk"], 16) & stop_bits == stop_bits
    return blocked and int(status["Threads"]) >= 2


def _wait(condition: Callable[[], object], timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while not (result := condition()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return result


def _dead(pids: list[int]) -> bool:
    return not any(map(still_running, pids))


def _kill(pids: list[int]) -> None:
    for pid in pids:
        if not _dead([pid]):
            os.kill(pid, signal.SIGKILL)


@LINUX
def test_loader_workers_survive_the_groups_stop_signals_and_die_with_their_parent() -> None:
    probe = subprocess.Popen(
        [python(), "tests/unit/data_workers_probe.py"], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    workers: list[int] = []
    try:
        assert probe.stdout.readline().strip() == "ready", probe.stderr.read()
        workers = _children(probe.pid)
        assert len(workers) == 2
        os.killpg(probe.pid, signal.SIGTERM)  # what a scheduler does
        os.killpg(probe.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        line = probe.stdout.readline().strip()
        assert line == "batches 20", probe.stderr.read() if probe.poll() is not None else line
        probe.kill()  # the trainer dies outright: its workers follow
        probe.wait()
        assert _wait(lambda: _dead(workers), timeout=2), {w: process_state(w) for w in workers}
    finally:
        probe.kill()
        probe.wait()
        _kill(workers)


def _sleep() -> None:
    time.sleep(60)


@LINUX
def test_a_hardened_worker_obeys_only_its_parents_stop_signal() -> None:
    with hardened_forks():
        worker = multiprocessing.get_context("fork").Process(target=_sleep, daemon=True)
        worker.start()
    pid = worker.pid
    assert pid is not None
    try:
        assert _wait(lambda: _hardened(pid), timeout=30)  # a loaded machine is slow
        for sig in (signal.SIGTERM, signal.SIGINT):  # from another process: ignored
            kill = f"import os; os.kill({worker.pid}, {int(sig)})"
            subprocess.run([python(), "-c", kill], check=True)
        worker.join(0.5)
        assert worker.is_alive()
        worker.terminate()  # from its parent (how pools and loaders end their workers): obeyed
        worker.join(5)
        assert worker.exitcode == -signal.SIGTERM
    finally:
        worker.kill()


_HARDEN_UNDER_FIRE = """
import os, signal, sys, time
sys.path.insert(0, ".")
from data.workers import PARENT_CHECK_S, harden_worker
set_handler = signal.signal

def set_then_signalled(sig, handler):
    previous = set_handler(sig, handler)
    os.kill(os.getpid(), signal.SIGTERM)  # not the parent's: to be dropped
    return previous

pid = os.fork()
if pid == 0:
    assert len(os.listdir("/proc/self/task")) == 1  # no thread but this one to take a signal
    signal.signal = set_then_signalled
    harden_worker(os.getppid())
    time.sleep(2 * PARENT_CHECK_S)  # time for the screen to see the pending signals
    os._exit(0)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@LINUX
def test_a_stop_signal_while_a_worker_hardens_does_not_end_it() -> None:
    # A loaded machine can pause a starting worker anywhere in its set-up, and the group's
    # SIGTERM can arrive then: a stop signal right after each handler it sets must not end it.
    # (Forked from a process of its own: a test process may hold fork hooks that start threads.)
    done = subprocess.run([python(), "-c", _HARDEN_UNDER_FIRE], cwd=ROOT, timeout=60)
    assert done.returncode == 0


class _Freed:
    """Cyclic garbage that records which process freed it."""

    pids: list[int] = []

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        _Freed.pids.append(os.getpid())


def _collect_and_report() -> None:
    gc.collect()
    sys.exit(len(_Freed.pids))  # how many of the parent's objects this child freed


@pytest.mark.parametrize("frozen_before", [False, True], ids=["nothing_frozen", "some_frozen"])
def test_a_forked_child_leaves_the_parents_garbage_to_the_parent(frozen_before: bool) -> None:
    # A child that freed the parent's pinned batches would abort (SIGABRT on an H200: CUDA cannot
    # run in a forked child): the fork hook keeps the parent's objects out of the child's
    # collector, also where the process froze objects of its own earlier (as on the H200).
    ours = frozen_before and gc.get_freeze_count() == 0
    _Freed.pids.clear()
    gc.disable()  # the garbage must still be there when the fork happens
    try:
        if ours:
            gc.freeze()
        _Freed()
        child = multiprocessing.get_context("fork").Process(target=_collect_and_report)
        child.start()
        child.join(30)
    finally:
        if ours:
            gc.unfreeze()
        gc.enable()
    assert child.exitcode == 0
    gc.collect()
    assert _Freed.pids == [os.getpid()]  # the parent's collector still frees it


_FORK_FROM_A_THREAD = """
import sys, threading, time, multiprocessing
sys.path.insert(0, ".")
from data.workers import hardened_forks
worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)

def replace_a_worker():  # as a pool's thread does; it ends when the pool does
    worker.start()
    time.sleep(1)  # the worker has hardened itself meanwhile

with hardened_forks():
    thread = threading.Thread(target=replace_a_worker)
    thread.start()
    thread.join()
print(worker.pid, flush=True)
time.sleep(60)
"""


@LINUX
def test_a_worker_forked_by_another_thread_outlives_it_and_dies_with_its_parent() -> None:
    # The parent-death signal fires when the forking *thread* ends. A pool's replacement worker,
    # killed that way while it held the task queue's lock, hung the pool's terminate() forever.
    parent = subprocess.Popen(
        [python(), "-c", _FORK_FROM_A_THREAD], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        time.sleep(0.5)  # the forking thread ended before the pid was printed
        assert not _dead([worker]), process_state(worker)
        parent.kill()
        parent.wait()
        assert _wait(lambda: _dead([worker]), timeout=3 * PARENT_CHECK_S), process_state(worker)
    finally:
        parent.kill()


def _stopped_inside_a_fork_hook() -> None:
    # As an at-fork hook of a library would: it runs the inherited handler, and swallows what
    # that raises.
    handler = signal.getsignal(signal.SIGTERM)
    assert callable(handler)
    with contextlib.suppress(SystemExit):
        handler(signal.SIGTERM, None)
    time.sleep(30)


@LINUX
def test_a_process_forked_under_sigterm_raises_ends_on_its_sigterm() -> None:
    # A pool's SIGTERM can reach a new worker before it sets its own handlers; raising there
    # was swallowed by a fork hook, the worker lived on, and the pool's terminate() waited forever.
    with sigterm_raises():
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        child = multiprocessing.get_context("fork").Process(target=_stopped_inside_a_fork_hook)
        child.start()
        child.join(10)
    child.kill()
    assert child.exitcode == 128 + signal.SIGTERM


_WORKER_KILLED = """
import os, signal, sys
sys.path.insert(0, ".")
import importlib
from helpers import make_cfg
preparation = importlib.import_module("data.prepare")
parent = os.getpid()

class KilledInAWorker:  # as the out-of-memory killer ends a worker
    def encode_ordinary_batch(self, texts):
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return [[7] for _ in texts]

preparation.gpt2_encoding = KilledInAWorker
cfg = make_cfg("data=text", f"data.files={sys.argv[1]}/corpus/*.txt",
               f"data.cache_dir={sys.argv[1]}/cache", "data.num_proc=4").data
try:
    preparation.prepare(cfg)
except preparation.Unusable as e:
    print(e)
"""


@LINUX
def test_a_preparation_whose_worker_is_killed_ends_in_one_line(tmp_path) -> None:
    _write_corpus(tmp_path, {f"{n}.txt": "a line of a corpus\n" * 50 for n in range(8)})
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    done = subprocess.run(
        [python(), "-c", _WORKER_KILLED, str(tmp_path)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    last = done.stdout.splitlines()[-1] if done.stdout else done.stderr
    assert last.startswith("a process preparing text died (4 were running): killed by"), last
    assert "data.num_proc=2 (less memory) or data.num_proc=1" in last
    assert list((tmp_path / "cache").iterdir()) == []


def test_worker_init_composes_with_another_one(tmp_path) -> None:
    def mark(worker_id: int) -> None:
        (tmp_path / f"worker-{worker_id}").write_text(str(os.getpid()))

    # A list is a dataset (indexable, sized), not a torch Dataset subclass as the stubs ask.
    loader = torch.utils.data.DataLoader(  # type: ignore[var-annotated]
        list(range(4)),  # type: ignore[arg-type]
        batch_size=1, num_workers=2, worker_init_fn=WorkerInit(then=mark),
    )  # fmt: skip
    assert sorted(int(b) for b in loader) == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-0", "worker-1"]


def _big_corpus(tmp_path: Path) -> str:
    """~24 MB of random words in 4 files: tokenising takes seconds with 2 processes."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(5000)]
    block = "\n".join(" ".join(rng.choices(words, k=12)) + "." for _ in range(20000))
    _write_corpus(tmp_path, {f"{n}.txt": f"{n}\n" + block * 4 for n in range(4)})
    return f"data.files={tmp_path}/corpus/*.txt"


def _prepare_in_a_child(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    """`prepare_data.py` on the big corpus with 2 processes, in a process group of its own;
    returns it once it is tokenising, with its child processes (the pool and its manager).
    Its output goes to tmp_path/log."""
    env = {**os.environ, "GPT2_RECIPE_CACHE": str(tmp_path / "cache")}
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(
            [python(), "scripts/prepare_data.py", "data=text", _big_corpus(tmp_path),
             "data.num_proc=2"],
            cwd=ROOT, env=env, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
    assert _wait(lambda: len(_children(proc.pid)) >= 2 or proc.poll() is not None, timeout=120)
    time.sleep(0.5)  # well into tokenising
    return proc, _children(proc.pid)


@LINUX
def test_killing_a_preparation_leaves_no_process_behind(tmp_path) -> None:
    proc, workers = _prepare_in_a_child(tmp_path)
    try:
        assert proc.poll() is None and len(workers) >= 2, (tmp_path / "log").read_text()
        proc.kill()
        proc.wait()
        assert _wait(lambda: _dead(workers), timeout=2), {w: process_state(w) for w in workers}
        # Its folder outlives it, until the next preparation on this machine removes it.
        (stale,) = _leftovers(tmp_path / "cache")
        assert f".tmp-{preparation._HOST}-{proc.pid}-" in stale
        assert [p.name for p in remove_stale_tmp_folders(tmp_path / "cache")] == [stale]
    finally:
        _kill(workers)


@LINUX
def test_a_preparation_stopped_by_sigterm_cleans_up(tmp_path) -> None:
    proc, workers = _prepare_in_a_child(tmp_path)
    try:
        log = tmp_path / "log"
        assert proc.poll() is None and len(workers) >= 2, log.read_text()
        os.killpg(proc.pid, signal.SIGTERM)  # the whole group, as a scheduler does
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM, log.read_text()
        assert _wait(lambda: _dead(workers), timeout=2), {w: process_state(w) for w in workers}
        assert list((tmp_path / "cache").iterdir()) == []
    finally:
        proc.kill()
        _kill(workers)
