"""Does PyTorch's own FSDP (FullyShardedDataParallel, and FSDP2's fully_shard) train on CPU?

One process, a Gloo group, a two-layer model, one forward/backward. Prints one line per API:
"ok" or the error it raised. bench/bench.py runs it with PyTorch 2.6 and quotes the output in
BENCHMARKS.md.
"""
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn


def attempt(name, wrap):
    try:
        model = wrap(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)))
        model(torch.randn(4, 8)).sum().backward()
        print(f"{name}: ok (torch {torch.__version__})")
    except Exception as e:  # noqa: BLE001 - the error text is the result
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        print(f"{name}: {last}")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "s"), rank=0,
                                world_size=1)
        from torch.distributed.fsdp import FullyShardedDataParallel
        attempt("FullyShardedDataParallel (FSDP1), CPU, Gloo", FullyShardedDataParallel)
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard

        def fsdp2(m):
            for layer in m:
                fully_shard(layer)
            return fully_shard(m)
        attempt("fully_shard (FSDP2), CPU, Gloo", fsdp2)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
