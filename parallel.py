"""The second CPU core: independent work in a forked process, same results.

Not a part of the paper's method; it only makes the tiny default run
(Algorithm 1 on two CPU cores) faster without changing what it computes. The
run keeps ONE torch thread (``distributed.configure_threads``: the thread
count changes float summation order, and a second thread made a shared
machine collapse), so on a two-core machine the second core is idle. Work
that is independent of the main thread's and draws no random numbers (the
warm start of independent agents, whose batches are drawn beforehand in the
serial order; agent k's behaviour log-probs while agent k+1 generates; the
line search's first backtrack, fraction 1/2, while the in-loop check measures
the proposal; an in-loop KL check likely to pass while training goes on,
undone if it crossed: these three only when a core is idle right now,
``idle_core``) runs in a forked child on that core: the same kernels on one thread each, so
the results are the serial ones bit for bit, whatever the load or timing
(``tests/test_speed_caches.py`` checks it). ``freeze_libraries`` keeps the
cyclic GC off the libraries' objects, which every child inherits, and
``exit_process`` ends the CLI without freeing them one by one.
"""
from __future__ import annotations

import gc
import os
import pickle
import traceback
from typing import NoReturn

import torch

IN_CHILD = False  # True in a forked worker: it must not touch locks other threads may hold (tqdm's)


def spare_core() -> bool:
    """A second core to fork onto: POSIX fork, >= 2 cores allowed to this
    process, one torch thread (a forked libgomp pool of several threads can
    hang), CPU only and no process group (torchrun ranks already use the cores)."""
    if not hasattr(os, "fork") or torch.get_num_threads() != 1:
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    return cores >= 2 and not dist and not torch.cuda.is_initialized()


def idle_core() -> bool:
    """``spare_core()`` and, right now, a core nobody else is running on
    (/proc/loadavg's count of running tasks, this process included, below the
    core count). For speculative or overlapping work that only pays when the
    other core is idle: on a machine whose cores are busy with other processes
    a forked child merely takes turns with this one. Decides only whether to
    fork, never what is computed."""
    if not spare_core():
        return False
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        return True
    return running < len(os.sched_getaffinity(0))


def freeze_libraries() -> None:
    """Import the model code every run needs (``Agent.load``), then freeze all
    objects made so far and turn the cyclic GC on. torch's and transformers'
    modules, classes and functions (about 390,000 tracked objects) live until the
    process ends: frozen, the GC never walks them again, not during the
    imports (with the GC paused before them, as the CLI does: 0.7 s of
    collections on two cores, measured), nor in a collection of the run, nor
    in forked children (a walk would write to every page they inherited).
    The CLI ends with ``exit_process``, which never frees them, or unfreezes
    them before the interpreter's own exit."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM  # noqa: F401

    gc.freeze()
    gc.enable()


def exit_process(code: int) -> NoReturn:
    """End the CLI's process with ``code`` as ``sys.exit`` would, minus the
    interpreter's teardown: the atexit handlers run (logging, multiprocessing,
    temporary folders, libraries' shutdown hooks) and Python's and C's stdio
    buffers are flushed, then ``os._exit``. What is skipped is freeing every
    object and module one by one, memory the OS takes back at once anyway:
    1.3 s at the end of a short run (torch's and transformers' objects,
    measured). ``background_call``'s work still running (a stage closing
    when a later one failed) is waited for first, so its metrics row and
    checkpoint reach the disk (its own failure is printed; the exit code is
    then at least 1). Where teardown still has work to do, a non-daemon thread
    running or a multiprocessing child not yet reaped (vLLM's engines), it is
    the plain ``sys.exit`` (after unfreezing ``freeze_libraries``' objects, so
    the last collection frees their cycles: left frozen, nanobind reports
    triton's as leaked). Output that cannot be flushed gives status 120, as
    Python's own exit does."""
    import atexit
    import multiprocessing
    import sys
    import threading

    if _BACKGROUND["pid"] is not None:
        try:
            wait_background()
        except RuntimeError as err:
            print(err, file=sys.stderr)
            code = code or 1
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if others or multiprocessing.active_children():
        gc.unfreeze()
        sys.exit(code)
    atexit._run_exitfuncs()  # what Py_Finalize would run first (the private name is CPython's only entry point)
    for stream, status in ((sys.stdout, 120), (sys.stderr, 0)):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # output lost (a full disk, a closed pipe)
            code = code or status
    try:
        import ctypes
        ctypes.CDLL(None).fflush(None)  # C libraries' buffered stdout (a pipe), which exit() would flush
    except (OSError, AttributeError):  # pragma: no cover - no C library to ask
        pass
    os._exit(code)


def _die_with_parent(parent: int) -> None:
    """In a forked child: be killed when the parent dies (Linux), so a run
    killed mid-stage leaves no writer behind to race with its resume (a torn
    checkpoint folder is what a crash leaves anyway, and is safe)."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def fork_map(fn, jobs: list, parallel: bool | None = None) -> list:
    """[fn(job) for job in jobs], the odd-numbered jobs in one forked child
    process while this process runs the even-numbered ones. ``fn`` must not
    draw random numbers or depend on what the other jobs do; its results come
    back pickled. ``parallel=None``: fork when ``spare_core()``; False: serial."""
    if parallel is None:
        parallel = spare_core()
    if not parallel or len(jobs) < 2:
        return [fn(job) for job in jobs]
    pid, read_fd = _fork_jobs(fn, jobs[1::2])  # the child: its share, sent back pickled
    try:
        mine = [fn(job) for job in jobs[0::2]]
    finally:  # read the child's answer even if ours failed, so it never blocks on a full pipe
        theirs = _collect(pid, read_fd)
    out = []
    for k in range(len(jobs)):
        out.append(mine[k // 2] if k % 2 == 0 else theirs[k // 2])
    return out


def _fork_jobs(fn, jobs: list) -> tuple[int, int]:
    """Fork a child that runs [fn(job) for job in jobs] on one thread and
    pickles ("ok", results) or ("error", traceback) into a pipe; (pid, read fd)."""
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        # every object inherited is the parent's: the child's collections leave them alone (a walk
        # would write to every page it inherited, copying each one); none becomes garbage before _exit
        gc.freeze()
        _die_with_parent(parent)
        os.close(read_fd)
        global IN_CHILD
        IN_CHILD = True
        try:
            payload = pickle.dumps(("ok", [fn(job) for job in jobs]), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises
            payload = pickle.dumps(("error", traceback.format_exc()))
        with os.fdopen(write_fd, "wb") as f:
            f.write(payload)
        os._exit(0)
    os.close(write_fd)
    return pid, read_fd


def _collect(pid: int, read_fd: int) -> list:
    """The results of a ``_fork_jobs`` child; RuntimeError if it failed or died."""
    with os.fdopen(read_fd, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    status, theirs = pickle.loads(data) if data else ("error", "the worker process died without an answer")
    if status != "ok":
        raise RuntimeError(f"parallel worker failed (rerun with one core to see it directly):\n{theirs}")
    return theirs


def fork_map_each(fn, jobs: list, parallel: bool | None = None) -> list:
    """[fn(job) for job in jobs], every job after the first in its own forked
    child while this process runs the first: all jobs at once, the OS sharing
    the cores among them (three warm-start agents on two cores take about 1.5
    agents' time where ``fork_map`` takes 2). Same contract as ``fork_map``:
    ``fn`` draws no random numbers and does not depend on the other jobs;
    each process runs one torch thread, so the results are the serial ones
    bit for bit. ``parallel=None``: fork when ``spare_core()``; False: serial."""
    if parallel is None:
        parallel = spare_core()
    if not parallel or len(jobs) < 2:
        return [fn(job) for job in jobs]
    children = [_fork_jobs(fn, [job]) for job in jobs[1:]]
    try:
        mine = fn(jobs[0])
    finally:  # read every child's answer even if ours failed, so none blocks on a full pipe
        answers = []
        for pid, read_fd in children:
            try:
                answers.append(_collect(pid, read_fd))
            except RuntimeError as err:
                answers.append(err)
    for a in answers:
        if isinstance(a, RuntimeError):
            raise a
    return [mine] + [a[0] for a in answers]


_BACKGROUND: dict = {"pid": None, "what": ""}


def background_call(fn, what: str, parallel: bool | None = None) -> None:
    """fn() in a forked child (a snapshot of this process: what changes here
    afterwards does not reach it) while this process goes on; its result comes
    back pickled and ``wait_background`` returns it. One at a time, in order
    (the previous one is waited for first). Serial where there is no spare
    core: fn() runs now and its result waits for the call."""
    wait_background()
    if not (spare_core() if parallel is None else parallel):
        _BACKGROUND["result"] = fn()
        return
    pid, read_fd = _fork_jobs(lambda _: fn(), [None])
    _BACKGROUND.update(pid=pid, what=what, fd=read_fd)


def wait_background():
    """Wait for the work ``background_call`` started, if any; raise if it
    failed. Returns its result (None if there is none)."""
    pid, what = _BACKGROUND["pid"], _BACKGROUND["what"]
    if pid is None:
        return _BACKGROUND.pop("result", None)
    _BACKGROUND["pid"] = None
    try:
        return _collect(pid, _BACKGROUND.pop("fd"))[0]
    except RuntimeError as err:
        raise RuntimeError(f"{what} failed in a background process: {err}") from None


class Pending:
    """The answer of ``fork_call``'s child: ``result()`` waits for it (and
    raises if the child failed); ``cancel()`` kills the child unread."""

    def __init__(self, pid: int, read_fd: int):
        self.pid, self.read_fd = pid, read_fd

    def result(self):
        return _collect(self.pid, self.read_fd)[0]

    def ready(self) -> bool:
        """Whether ``result()`` would return without waiting (the child wrote
        its answer, or died)."""
        import select
        return bool(select.select([self.read_fd], [], [], 0)[0])

    def cancel(self) -> None:
        import signal
        os.kill(self.pid, signal.SIGKILL)  # our own child, by its id
        os.waitpid(self.pid, 0)
        os.close(self.read_fd)


def fork_call(fn, parallel: bool | None = None) -> Pending | None:
    """Start fn() in a forked child (a snapshot of this process) on the spare
    core and return at once: a ``Pending`` whose ``result()`` is fn()'s value,
    pickled back. For speculative work the caller may not need (``cancel()``
    then). ``fn`` must draw no random numbers. None where there is no spare
    core (``parallel=None``: ``spare_core()``): the caller then computes it
    itself when it needs it, so the answer never depends on the fork."""
    if not (spare_core() if parallel is None else parallel):
        return None
    pid, read_fd = _fork_jobs(lambda _: fn(), [None])
    return Pending(pid, read_fd)
