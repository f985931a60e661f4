# Debian builds PyTorch 2.6 without libuv, but torchrun 2.6 creates its TCPStore with
# use_libuv=True ("use_libuv was requested but PyTorch was build without libuv support"). The
# torchrun test puts this directory on PYTHONPATH so every TCPStore uses the classic server.
try:
    import torch.distributed as _dist

    _TCPStore = _dist.TCPStore

    def _classic_tcp_store(*args, **kwargs):
        kwargs["use_libuv"] = False
        return _TCPStore(*args, **kwargs)

    _dist.TCPStore = _classic_tcp_store
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as _static

    _static.TCPStore = _classic_tcp_store
except Exception:  # no torch here: nothing to patch
    pass
