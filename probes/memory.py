"""Memory counters per phase: CUDA allocator statistics, or an exact live-tensor tracker on CPU.

CPU has no caching allocator, so "allocated" is the exact sum of live tensor storages, counted by a
dispatch mode that sees every storage an op creates and a weakref finalizer that sees it die. There is
no reserved pool on CPU: that counter stays None. Process RSS (VmHWM, reset per phase) is the
device-level figure. The same tracker runs under FakeTensorMode for estimates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import os
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from planner.models.allocator import SimulatedOOM

_DEVICE = torch.ops.prim.device.default


class LiveTensorTracker(TorchDispatchMode):
    """Counts live tensor-storage bytes exactly; raises torch.OutOfMemoryError past `cap_bytes`: by CUDA's rule
    when an allocator model is given (configured with the cap as its limit: a segment that would pass it fails
    once cached blocks are released, as under set_per_process_memory_fraction), else on live bytes."""

    def __init__(self, cap_bytes: int | None = None, track_resizes: bool = False, allocator=None):
        super().__init__()
        self.cap_bytes = cap_bytes
        # A model of CUDA's caching allocator (planner/models/allocator.py) fed every storage as it comes and goes:
        # the reserved bytes a CUDA GPU would hold for the same allocations. It holds no tensor, only sizes.
        self.allocator = allocator
        # CUDA's rule holds the cap only when the model has the cap as its limit; otherwise live bytes do
        self._allocator_caps = allocator is not None and cap_bytes is not None and (
            allocator.config.limit_bytes == cap_bytes)
        self.live = 0
        self.peak = 0
        self.ops = 0
        self._sizes: dict[int, int] = {}
        # FSDP frees and re-gathers parameters by resizing storages in place (no dispatched op shows it):
        # with track_resizes, every tracked storage's size is re-read after each op (slower; sharded runs only).
        self.track_resizes = track_resizes
        self._refs: dict[int, weakref.ref] = {}
        # While recording (record()), every change the tracker makes, in order: (key, bytes) for a storage
        # seen, (key, None) for one released, None where an op ends and the peak is read. replay() applies such
        # a record to this tracker's counters and allocator model without running its ops.
        self._events: list | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and type(args[0]) is FakeTensor:
            # `.device` of a fake tensor (three in four ops an estimate dispatches: foreach grouping asks it per
            # tensor) allocates nothing: answer it here instead of a second trip through FakeTensorMode.
            return args[0].fake_device
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if isinstance(out, torch.Tensor):  # the common case, without flattening
            self._track(out)
        else:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._track(t)
        if self.track_resizes:
            self.refresh()
        if self._events is not None and self._events and self._events[-1] is not None:
            self._events.append(None)  # the peak is read here (twice in a row reads the same)
        if self.live > self.peak:
            self.peak = self.live
        if self.cap_bytes is not None and not self._allocator_caps and self.live > self.cap_bytes:
            # `out` is released as the exception unwinds, so the count drops back by itself.
            raise torch.OutOfMemoryError(
                f"CPU cap exceeded: {self.live} live tensor bytes > cap {self.cap_bytes} bytes (rentplan --cap)")
        return out

    def _track(self, t: torch.Tensor) -> None:
        if _HOST_SIDE:  # host memory (a checkpoint read into RAM), not the device's: see host_side()
            return
        if is_traceable_wrapper_subclass(t):
            # A wrapper (DTensor) owns no memory: its storage reports the full logical size but has no data.
            # The memory is in its inner tensors (a DTensor's local shard).
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._track(inner)
            return
        st = t.untyped_storage()
        key = id(st)
        if key in self._sizes:
            return
        n = st.nbytes()
        self._sizes[key] = n
        self.live += n
        if self._events is not None:
            self._events.append((key, n))
        # A weak reference whose callback runs when the storage dies (cheaper than weakref.finalize); it is
        # kept here until then, and is also how refresh() reads sizes back.
        self._refs[key] = weakref.ref(st, lambda _ref, key=key: self._release(key))
        if self.allocator is not None:
            try:
                self.allocator.malloc(key, n)
            # only with a limit, which is the cap (_allocator_caps); `t` is released as the exception unwinds: its
            # count with it
            except SimulatedOOM as e:
                raise torch.OutOfMemoryError(
                    f"CPU cap exceeded: CUDA's caching allocator (modelled) cannot reserve {n} more bytes within "
                    f"the cap of {self.cap_bytes} bytes (rentplan --cap); {self.live} live tensor bytes. {e}") from None

    def _release(self, key: int) -> None:
        n = self._sizes.pop(key, None)
        if n is None:  # counted out already (replay)
            self._refs.pop(key, None)
            return
        self.live -= n
        self._refs.pop(key, None)
        if self._events is not None:
            self._events.append((key, None))
        if self.allocator is not None:
            self.allocator.free(key)

    @contextlib.contextmanager
    def record(self):
        """Yields a Recording of what the tracker counts inside the block, to replay() elsewhere. A tracker that
        enforces a cap (an OOM mid-block) or re-reads resized storages records nothing replayable."""
        rec = Recording([], replayable=self.cap_bytes is None and not self.track_resizes)
        self._events = rec.events
        try:
            yield rec
        finally:
            self._events = None

    def replay(self, rec: "Recording", known: dict | None = None, bind: dict | None = None) -> None:
        """Count a recorded block again as if its ops ran now: the same storages made and released in the same
        order, the peak read where each op ended; the allocator model gets the same calls, from the state it is
        in now. A storage the block released that it did not make must be in `known` (recorded key -> the key
        of its counterpart here), else nothing is counted and ValueError says so. `bind` (recorded key -> a
        tensor made outside every mode, of the same storage size) gives a storage the block made a real tensor
        to stand for it from here on, counted as any other; the others the block left alive stay counted under
        keys of their own (no tensor stands behind them). While recording, the replay is recorded as it is
        counted here."""
        if not rec.replayable:
            raise ValueError("this recording cannot be replayed (a cap, or resized storages)")
        known = dict(known or {})
        made: set = set()
        last: dict = {}  # a bound key -> the event that made the storage it names at the end (ids are reused)
        for i, ev in enumerate(rec.events):
            if ev is not None:
                if ev[1] is not None:
                    made.add(ev[0])
                    if bind and ev[0] in bind:
                        last[ev[0]] = i
                elif ev[0] in made:
                    made.discard(ev[0])
                elif ev[0] not in known or known[ev[0]] not in self._sizes:
                    raise ValueError("the recording releases a storage from before it that has no counterpart here")
        if bind and (set(last) != set(bind) or set(last) - made or any(
                bind[k].untyped_storage().nbytes() != rec.events[i][1] for k, i in last.items())):
            raise ValueError("a tensor is bound to a storage the recording does not leave alive, or not of its size")
        bound = {i: bind[k] for k, i in last.items()}
        now = known
        events = self._events
        for i, ev in enumerate(rec.events):
            if ev is None:
                if self.live > self.peak:
                    self.peak = self.live
                if events is not None and events and events[-1] is not None:
                    events.append(None)
                continue
            key, n = ev
            if n is None:
                mine = now.pop(key)
                self.live -= self._sizes.pop(mine)
                self._refs.pop(mine, None)
                if self.allocator is not None:
                    self.allocator.free(mine)
            else:
                if i in bound:
                    st = bound[i].untyped_storage()
                    mine = id(st)
                    self._refs[mine] = weakref.ref(st, lambda _ref, key=mine: self._release(key))
                else:
                    mine = ("replayed", next(_REPLAYED))
                now[key] = mine
                self._sizes[mine] = n
                self.live += n
                if self.allocator is not None:
                    self.allocator.malloc(mine, n)
            if events is not None:
                events.append((mine, n))

    def refresh(self) -> None:
        """Account for storages resized in place since they were first seen."""
        for key, ref in list(self._refs.items()):
            st = ref()
            if st is None:
                continue
            n = st.nbytes()
            if n != self._sizes.get(key, n):
                self.live += n - self._sizes[key]
                self._sizes[key] = n
                if self.allocator is not None:  # a CUDA storage resized in place is freed and allocated anew
                    self.allocator.free(key)
                    self.allocator.malloc(key, n)

    def reset_peak(self) -> None:
        if self.track_resizes:
            self.refresh()
        self.peak = self.live


@dataclasses.dataclass
class Recording:
    """What a LiveTensorTracker counted in a block, in order: (key, bytes) for a storage first seen, (key, None)
    for one released, None where an op ended and the peak was read."""

    events: list
    replayable: bool = True

    def shape(self) -> list:
        """The events with each key replaced by its order of first appearance: two blocks with the same shape
        made and released storages of the same sizes in the same order."""
        current: dict = {}  # key -> the number of the storage it names now (an id is reused once freed)
        out: list = []
        made = 0
        for ev in self.events:
            if ev is None:
                out.append(None)
            elif ev[1] is not None:
                current[ev[0]] = made
                out.append((made, ev[1]))
                made += 1
            else:
                out.append((current.pop(ev[0], ("before", ev[0])), None))
        return out

    def alive(self) -> list:
        """Keys of the storages the block made and left alive, in the order it made them."""
        live: dict = {}
        for ev in self.events:
            if ev is not None:
                if ev[1] is not None:
                    live[ev[0]] = True
                else:
                    live.pop(ev[0], None)
        return list(live)


_REPLAYED = itertools.count()
_HOST_SIDE = 0


@contextlib.contextmanager
def host_side():
    """Tensors made here stand for host memory: a checkpoint read into RAM before its values are copied onto the
    device (probes/checkpoint.load). The trackers leave them out; what the device then holds of them is counted
    when it gets there (device_side)."""
    global _HOST_SIDE
    _HOST_SIDE += 1
    try:
        yield
    finally:
        _HOST_SIDE -= 1


def device_side(tensors) -> None:
    """These tensors now live on the device being measured (a CPU pilot's device is this host, where a tensor
    moved "to the device" is the same tensor): the active trackers count them from here on."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    trackers = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, LiveTensorTracker)]
    for tracker in trackers:
        for t in tensors:
            tracker._track(t)
        tracker.peak = max(tracker.peak, tracker.live)


def read_vm_hwm() -> int | None:
    """Peak resident set size of this process since the last reset, in bytes (Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_vm_hwm() -> None:
    try:  # writing 5 to clear_refs resets the peak RSS counter (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class PhaseMeter:
    """Start/stop memory accounting around one phase on the worker's device."""

    def __init__(self, device: torch.device, tracker: LiveTensorTracker | None, fake: bool = False):
        self.device = device
        self.fake = fake  # estimates: the process's RSS says nothing about the model
        self.tracker = tracker
        self.cuda = device.type == "cuda"
        self._ooms0 = 0

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def start(self) -> dict:
        """Synchronize, reset the peaks, and return the baseline before the phase."""
        gc.collect()
        self.synchronize()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._ooms0 = torch.cuda.memory_stats(self.device).get("num_ooms", 0)
            return {"baseline_allocated_bytes": torch.cuda.memory_allocated(self.device)}
        reset_vm_hwm()
        if self.tracker is not None:
            self.tracker.reset_peak()
            if self.tracker.allocator is not None:
                self.tracker.allocator.reset_peak()
            return {"baseline_allocated_bytes": self.tracker.live}
        return {}

    def held(self) -> dict:
        """What is held now, for a phase this meter did not watch from its start (a loop that built its model before
        rentplan was told): on CUDA the current counters, not max_memory_* (peaks since the process started or the
        last reset, an earlier OOM'd attempt's included) and no OOM count (num_ooms counts every earlier OOM)."""
        if not self.cuda:
            return self.stop()
        self.synchronize()
        free, total = torch.cuda.mem_get_info(self.device)
        reserved_now = torch.cuda.memory_reserved(self.device)
        return {"peak_allocated_bytes": torch.cuda.memory_allocated(self.device), "peak_reserved_bytes": reserved_now,
                "device_used_bytes": total - free, "context_bytes": max(0, total - free - reserved_now),
                "num_ooms_delta": None}

    def stop(self) -> dict:
        """Synchronize and read the phase's peaks. Allocated and reserved stay separate."""
        self.synchronize()
        if self.cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            reserved_now = torch.cuda.memory_reserved(self.device)
            return {
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device),
                "device_used_bytes": total - free,
                "context_bytes": max(0, total - free - reserved_now),
                "num_ooms_delta": torch.cuda.memory_stats(self.device).get("num_ooms", 0) - self._ooms0,
            }
        out = {"peak_reserved_bytes": None, "device_used_bytes": None if self.fake else (read_vm_hwm() or _rss())}
        if self.tracker is not None:
            out["peak_allocated_bytes"] = self.tracker.peak
            if self.tracker.allocator is not None:
                out["simulated_reserved_bytes"] = self.tracker.allocator.peak_reserved
        return out


def _rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def reading_notes(device: torch.device, phase: str, optimizer: str) -> str:
    """What a measured CUDA line's counters leave out or fold in, said on the line it affects."""
    if device.type != "cuda" or phase not in ("first_step", "steady", "resume"):
        return ""
    notes = []
    if optimizer.startswith("paged_"):  # bitsandbytes' get_paged: cudaMallocManaged, beside torch's allocator
        notes.append("paged optimizer state (bitsandbytes, CUDA managed memory) is outside torch's allocator: not "
                     "in these peaks, and --cap does not bound it")
    if torch.backends.cudnn.benchmark and phase != "steady":
        notes.append("cudnn.benchmark on: this update's time includes cuDNN's algorithm search and its peaks the "
                     "workspaces it tried")
    return "; ".join(notes)
