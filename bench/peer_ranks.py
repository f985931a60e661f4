"""How bench/ddp_peer.py and bench/gpt2_peer.py start their ranks: `plain` runs the worker in
this process with no process group; otherwise `nproc` processes (torch.multiprocessing) meet
through a FileStore: Debian's PyTorch 2.6 has no libuv, which torchrun's rendezvous insists on.
Every rank runs OMP_NUM_THREADS intra-op threads (1 if unset)."""
import os
import tempfile

import torch
import torch.distributed as dist


def start(worker, args, nproc, plain):
    """worker(rank, args, store_path): store_path is None when `plain`."""
    if plain:
        worker(0, args, None)
        return
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(worker, args=(args, os.path.join(tmp, "store")), nprocs=nproc)


def join(rank, nproc, store_path):
    """Sets the rank's threads and, unless plain (store_path None), joins the Gloo group."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if store_path:
        dist.init_process_group("gloo", init_method="file://" + store_path, rank=rank,
                                world_size=nproc)
