"""Run by tests/test_distributed.py under ONE torchrun: several workers of
tests/dist/ one after the other in the same two processes, since each
torchrun start (three interpreters importing torch and transformers, the
rendezvous, the process group) costs about 10 s on the loaded 2-core CI machine.

    all_workers.py WORKER.py ARG ... -- WORKER.py ARG ... -- ...

Each worker runs as if it had the processes to itself: the torch / numpy /
Python RNG states of a fresh process, and no process group until the worker's
own ``distributed.setup`` (each computes its one-process reference first); its
``distributed.teardown`` leaves the group, and the next worker joins a new one
through the store torchrun keeps for both processes."""
import random
import runpy
import sys

import numpy as np
import torch

from scale import distributed

jobs, job = [], []
for arg in sys.argv[1:] + ["--"]:
    if arg == "--":
        jobs, job = (jobs + [job] if job else jobs), []
    else:
        job.append(arg)
fresh = (torch.get_rng_state(), np.random.get_state(), random.getstate())
for script, *args in jobs:
    torch.set_rng_state(fresh[0])
    np.random.set_state(fresh[1])
    random.setstate(fresh[2])
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    distributed.teardown()  # if the worker did not
