"""Staging: a checkpoint's tensors copied into host buffers that are kept from one save to the next.

An asynchronous save stops the training loop only for this copy: the weights and optimizer states
change at the next step, so the file is serialised from the copy, on the checkpoint writer's thread
(serialization.py), while training goes on. The buffers hold one copy of the state, allocated at the
first save and reused by every later one (a copy into pages already touched is several times faster
than into new ones), until the writer closes at the end of fit. On CUDA they are page-locked with
``cudaHostRegister`` (exactly the size needed, where the caching pinned allocator would round each
one up to a power of two) and filled with non-blocking copies: the loop only queues them, and the
writer waits for the copies' event before it reads the buffers.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import torch

# smaller buffers are not worth page-locking (the register call costs more than it saves)
_PIN_BYTES = 1 << 16


class StagingBuffers:
    """Host copies of a checkpoint, in buffers reused between saves (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.UntypedStorage] = {}
        self.event: Any = None  # the CUDA copies' event of the last :meth:`stage`, or None
        self.nbytes = 0  # the bytes of the buffers the last :meth:`stage` used

    def stage(self, tree: Any) -> Any:
        """``tree`` with every tensor replaced by a copy in a staging buffer; dicts, lists, tuples
        and sets are rebuilt, anything else is kept (the checkpoint holds plain values only:
        ``check_plain``). Tensors that share a storage keep sharing one, as ``torch.save`` would
        write them, and a dict met twice is staged once (the checkpoint's ``state_dict`` is its
        ``module``). The buffers of storages that are not in ``tree`` any more are let go, so the
        buffers hold one copy of the current state."""
        used: dict[tuple[Any, ...], torch.UntypedStorage] = {}
        staged_dicts: dict[int, Any] = {}
        self.event = None

        def walk(obj: Any) -> Any:
            kind = type(obj)
            if issubclass(kind, torch.Tensor):
                return self._tensor(obj, used)
            if kind is dict or kind is OrderedDict:
                if id(obj) in staged_dicts:
                    return staged_dicts[id(obj)]
                out = staged_dicts[id(obj)] = kind((k, walk(v)) for k, v in obj.items())
                # a module's state dict: its version records load_state_dict reads
                if hasattr(obj, "_metadata"):
                    out._metadata = obj._metadata  # type: ignore[attr-defined]
                return out
            if kind is list or kind is tuple or kind is set:
                return kind(walk(v) for v in obj)
            return obj

        with torch.no_grad():
            staged = walk(tree)
        if self.event is not None:
            self.event.record()
        self._buffers = used
        self.nbytes = sum(b.nbytes() for b in used.values())
        return staged

    def _tensor(
        self, tensor: torch.Tensor, used: dict[tuple[Any, ...], torch.UntypedStorage]
    ) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.is_meta:  # a placeholder (sharded checkpoints' skeleton): nothing to copy
            return tensor
        if (
            type(tensor) is not torch.Tensor
            or tensor.layout is not torch.strided
            or tensor.is_quantized
            or tensor.is_conj()
            or tensor.is_neg()
        ):
            # rare kinds (sparse, subclasses...): a plain copy, not reused
            return tensor.to("cpu", copy=True)
        source = tensor.untyped_storage()
        key = (source.data_ptr(), source.nbytes(), str(tensor.device))
        buffer = used.get(key)
        if buffer is None:  # not yet copied in this save (tied weights and views share one)
            buffer = self._buffers.get(key)
            if buffer is None:
                buffer = _allocate(source.nbytes(), tensor.device.type == "cuda")
            # Queued on this device's stream and covered by one event; a tensor on another GPU is
            # copied at once.
            cuda = (
                tensor.device.type == "cuda" and tensor.device.index == torch.cuda.current_device()
            )
            buffer.copy_(source, non_blocking=cuda)
            if cuda and self.event is None:
                self.event = torch.cuda.Event()
            used[key] = buffer
        staged = torch.empty(0, dtype=tensor.dtype)
        staged.set_(buffer, tensor.storage_offset(), tensor.size(), tensor.stride())
        return staged

    def wait(self) -> None:
        """Block until the copies of the last :meth:`stage` are in the buffers (CUDA: its event;
        else at once)."""
        if self.event is not None:
            self.event.synchronize()


def _allocate(nbytes: int, pin: bool) -> torch.UntypedStorage:
    buffer = torch.UntypedStorage(nbytes)
    if pin and nbytes >= _PIN_BYTES:
        cudart = torch.cuda.cudart()
        # else: stays pageable (slower copy)
        if int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)) == 0:
            unpin = weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
            unpin.atexit = False  # not after the CUDA context is gone
    return buffer
