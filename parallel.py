"""The second CPU core: independent work in a forked process, same results.

Not a part of the paper's method; it only makes the tiny default run
(Algorithm 1 on two CPU cores) faster without changing what it computes. The
run keeps ONE torch thread (``distributed.configure_threads``: the thread
count changes float summation order, and a second thread made a shared
machine collapse), so on a two-core machine the second core is idle. Work
that is independent of the main thread's and draws no random numbers (the
warm start of independent agents, whose batches are drawn beforehand in the
serial order) runs in a forked child on that core: the same kernels on one
thread each, so the results are the serial ones bit for bit, whatever the
load or timing (``tests/test_speed_caches.py`` checks it).
"""
from __future__ import annotations

import os
import pickle
import traceback

import torch


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


def fork_map(fn, jobs: list, parallel: bool | None = None) -> list:
    """[fn(job) for job in jobs], the odd-numbered jobs in one forked child
    process while this process runs the even-numbered ones. ``fn`` must not
    draw random numbers or depend on what the other jobs do; its results come
    back pickled. ``parallel=None``: fork when ``spare_core()``; False: serial."""
    if parallel is None:
        parallel = spare_core()
    if not parallel or len(jobs) < 2:
        return [fn(job) for job in jobs]
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run its share, send it back, exit without cleanup handlers
        os.close(read_fd)
        try:
            payload = pickle.dumps(("ok", [fn(job) for job in jobs[1::2]]), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises
            payload = pickle.dumps(("error", traceback.format_exc()))
        with os.fdopen(write_fd, "wb") as f:
            f.write(payload)
        os._exit(0)
    os.close(write_fd)
    try:
        mine = [fn(job) for job in jobs[0::2]]
    finally:  # read the child's answer even if ours failed, so it never blocks on a full pipe
        with os.fdopen(read_fd, "rb") as f:
            data = f.read()
        os.waitpid(pid, 0)
    status, theirs = pickle.loads(data) if data else ("error", "the worker process died without an answer")
    if status != "ok":
        raise RuntimeError(f"parallel worker failed (rerun with one core to see it directly):\n{theirs}")
    out = []
    for k in range(len(jobs)):
        out.append(mine[k // 2] if k % 2 == 0 else theirs[k // 2])
    return out
