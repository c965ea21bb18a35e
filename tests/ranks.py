"""Two CPU processes joined by a gloo group, for the distributed tests, run so that no fault can hang the suite.

The group meets through a file in the test's own folder (no TCP port picked and released, which another process
may take first), over the loopback interface (gloo otherwise connects through whatever address the host name
resolves to), with a collective timeout. A rank still running near the deadline prints its stack and exits; the
parent kills what is left at the deadline and fails the test, naming it."""

import faulthandler
import os
import socket
import time
import warnings
from datetime import timedelta

import pytest

WORLD = 2
DEADLINE_S = 120.0


def init_group(rank: int, out_dir: str) -> None:
    """In a rank: join the WORLD-process gloo group of the run whose folder is ``out_dir``."""
    import torch.distributed as dist

    faulthandler.dump_traceback_later(DEADLINE_S - 30, exit=True)
    if "lo" in (name for _, name in socket.if_nameindex()):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out_dir, "gloo-store"), rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=DEADLINE_S / 2))


def spawn(main, out_dir, *args) -> None:
    """Run ``main(rank, out_dir, *args)`` in WORLD spawned processes (each calls ``init_group(rank, out_dir)``); a rank's
    exception is re-raised here, and ranks not done in DEADLINE_S seconds are killed and the test failed."""
    import torch.multiprocessing as mp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks = mp.start_processes(main, args=(str(out_dir), *args), nprocs=WORLD, join=False, start_method="spawn")
        deadline = time.monotonic() + DEADLINE_S
        while not ranks.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                late = [r for r, p in enumerate(ranks.processes) if p.is_alive()]
                for p in ranks.processes:
                    p.kill()
                    p.join()
                pytest.fail(f"{main.__name__}: ranks {late} still running after {DEADLINE_S:.0f} s (killed)")
