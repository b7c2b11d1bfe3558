"""Page-locked host memory for the GPU's copies, through the CUDA runtime itself (ctypes).

Copies between host and GPU run asynchronously, at full PCIe speed, only from page-locked
memory. The weights already sit in the object store's shared memory and the saved inputs in
plain host tensors, so both are locked in place (cudaHostRegister) rather than copied into
torch's pinned buffers: DeviceWeights (device_weights.py) registers the store's blocks, and
SavedInputs (saved_inputs.py) its host buffers. What is registered must be unregistered before
its memory is freed (unregister_all, which their close() and finalizers call).
"""

from __future__ import annotations

import ctypes
import functools
import re

import torch

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


def shared_page_spans(spans: list[tuple[int, int]], page: int) -> list[tuple[int, int, list[int]]]:
    """The byte ranges `spans` ((address, bytes) each) as the ranges to page-lock: those that
    share a page merged into one, each as (address, bytes, indices of the spans it covers), in
    address order. cudaHostRegister locks whole pages and refuses a range touching a page that
    is already registered, so buffers packed back to back (the object store's blocks, small
    malloc'd ones) registered one by one would leave every other one unpinned, copied through
    staging. A merged range holds less than a page of memory that is not a span's."""
    merged: list[tuple[int, int, list[int]]] = []
    for start, end, i in sorted((s, s + n, i) for i, (s, n) in enumerate(spans) if n > 0):
        if merged and start // page <= (merged[-1][1] - 1) // page:  # shares the last's page
            first, last, members = merged[-1]
            merged[-1] = (first, max(last, end), [*members, i])
        else:
            merged.append((start, end, [i]))
    return [(start, end - start, members) for start, end, members in merged]


def host_register(t: torch.Tensor, device: torch.device) -> bool:
    """Page-lock `t`'s memory in place for copies to and from `device` (cudaHostRegister,
    portable); False if refused or CUDA's runtime is not loaded. The caller unregisters it
    (host_unregister) before the memory is freed: a freed range still registered would make a
    later allocation at the same address look pinned while CUDA still maps the old pages.

    Portable: pinned for every CUDA context, not only the current one (should the runtime found
    by _cudart have another current device than torch's). Not read-only: the object store maps
    its pages writable (numpy marks them read-only, CUDA does not care)."""
    return host_register_range(t.data_ptr(), t.numel() * t.element_size(), device)


def host_register_range(ptr: int, nbytes: int, device: torch.device) -> bool:
    """host_register of `nbytes` at address `ptr`."""
    lib = _cudart()
    if lib is None or nbytes == 0:
        return False
    with torch.cuda.device(device):
        if lib.cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE) != 0:
            lib.cudaGetLastError()  # clear it: a refused registration must not fail a kernel
            return False
    return True


def host_unregister(ptr: int) -> None:
    """Undo host_register of the memory at `ptr`."""
    lib = _cudart()
    if lib is not None and lib.cudaHostUnregister(ptr) != 0:
        lib.cudaGetLastError()


def unregister_all(ptrs: list[int], device: torch.device) -> None:
    """Unregister (host_unregister) every address in `ptrs`, once no copy can still use them,
    and empty the list: what close() does, and what weakref.finalize does for an object that
    was dropped without it (then at most once: the list is empty after)."""
    if not ptrs:
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for ptr in ptrs:
        host_unregister(ptr)
    ptrs.clear()


def page_locked_empty(
    numel: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, bool]:
    """(an uninitialized host tensor of `numel` values, page-locked for `device`; whether it was
    registered). Plain memory registered in place takes exactly its size, where torch's
    `pin_memory=True` rounds the allocation up to a power of two (its caching host allocator's
    default: 40 GiB of saved activations would lock 64 GiB). Registered: the caller must
    host_unregister it before freeing it; if registration is refused, torch's pinned memory."""
    t = torch.empty(numel, dtype=dtype)
    if host_register(t, device):
        return t, True
    return torch.empty(numel, dtype=dtype, pin_memory=True), False


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process has loaded, through ctypes; None if none is loaded.

    `torch.cuda.cudart()` binds cudaHostRegister but not cudaGetLastError, and a refused
    registration leaves a pending error that a later kernel-launch check would raise. Register,
    clear and unregister therefore all go through this handle: the same runtime torch uses (found
    in /proc/self/maps, so no second copy with its own error state and current device is loaded).
    Without it DeviceWeights does not register and copies through pinned staging buffers.
    """
    try:
        with open("/proc/self/maps") as f:
            paths = sorted(
                {
                    m[1]
                    for line in f
                    if (m := re.search(r"(/\S*/libcudart\.so[.\d]*)$", line.strip()))
                }
            )
    except OSError:
        return None
    if not paths:
        return None
    lib = ctypes.CDLL(paths[0])
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    for fn in (lib.cudaHostRegister, lib.cudaHostUnregister, lib.cudaGetLastError):
        fn.restype = ctypes.c_int
    return lib
