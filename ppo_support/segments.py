"""The train loop as the host drives it. A run's cycles go through one compiled program, the
script's train for a runtime number of cycles, called again and again: segments. Nothing of the
host runs inside it (no callback). The host dispatches the next segment before it reads the
metrics of the one in flight (JAX's asynchronous dispatch), so the device does not wait for the
host; between segments it hands the metrics rows, checkpoints and videos to the host thread
(logs.HostQueue) and looks for a stop request (Ctrl-C, SIGTERM).

Segments end exactly on the cycles the host must see the states of (every checkpoint and video,
and the last cycle). Otherwise a segment lasts about SEGMENT_SECONDS, measured on the ones before
it: long enough that the host's share of the time is nothing, short enough that a stop comes
soon. What a cycle computes comes from its states alone (state.cycle, state.key), so a run cut
into other segments trains bit for bit the same.

A stop (StopRequests) takes effect at the end of the segment in flight: every later segment runs
zero cycles. Each process passes its own request in, the program takes the largest, so that with
--distributed every process stops at the same cycle."""

from __future__ import annotations

import collections
import signal
import sys
import threading
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import devices

SEGMENT_SECONDS = 1.0  # a segment's target wall time, once the first ones have been timed
MAX_SEGMENT_CYCLES = 1024  # rows of the metrics buffer a segment returns, at most
METRICS_BUFFER_BYTES = 16 * 2**20  # and at most this much of them


def max_segment_cycles(num_cycles: int, num_metrics: int, num_runs: int) -> int:
    """The length of the metrics buffer (max_cycles, runs) per metric: the most cycles one segment runs."""
    by_memory = METRICS_BUFFER_BYTES // (4 * num_metrics * num_runs)
    return max(1, min(num_cycles, MAX_SEGMENT_CYCLES, by_memory))


def make_program(train: Callable, max_cycles: int, mesh: jax.sharding.Mesh | None) -> Callable:
    """The run's one program, jitted: segment(states, num_cycles, host_reports) -> (states,
    metrics, agreed). train(states, num_cycles, max_cycles) is the script's (make_train); every
    cycle's metrics come back, (max_cycles, runs) per name, NaN after the cycles run.
    host_reports holds each process's report (HostReport) on its devices; agreed is the largest
    of each value, as every process reads it: no cycle runs once a stop was requested anywhere."""

    def segment(states: Any, num_cycles: jax.Array, host_reports: jax.Array):
        agreed = jnp.max(host_reports, axis=0)
        stopped = agreed[HostReport._fields.index("stop_signal")] > 0
        states, metrics = train(states, jnp.where(stopped, 0, num_cycles), max_cycles)
        if mesh is not None:  # every process reads its own copy
            metrics, agreed = jax.lax.with_sharding_constraint((metrics, agreed), NamedSharding(mesh, P()))
        return states, metrics, agreed

    return jax.jit(segment)


class HostReport(NamedTuple):
    """What each process tells the others through the program (as float32s)."""

    stop_signal: float  # the signal that asked this process to stop; 0: none
    seconds_per_cycle: float  # measured on the last segment this process read; 0: not yet


def host_reports(report: HostReport, mesh: jax.sharding.Mesh | None) -> Any:
    """This process's report on each of its devices (the program reads every device's)."""
    values = np.asarray(report, np.float32)
    if mesh is None:
        return values[None]
    sharding = NamedSharding(mesh, P(devices.DEVICE_AXIS))
    return jax.make_array_from_callback(
        (mesh.size, len(values)), sharding, lambda index: np.tile(values, (len(range(mesh.size)[index[0]]), 1))
    )


def program_inputs(states: Any, mesh: jax.sharding.Mesh | None) -> tuple[Any, Any, Any]:
    """Arguments to lower the program with: its shapes, and no cycles."""
    return states, np.int32(0), host_reports(HostReport(0.0, 0.0), mesh)


class StopRequests:
    """Ctrl-C (SIGINT) and SIGTERM (which SLURM sends before it preempts a job) while training: the
    first asks the run to stop at the end of the segment in flight (and save itself). Then a
    Ctrl-C, or a SIGTERM after a first Ctrl-C, ends the process at once, as the signal always does;
    a second SIGTERM is ignored, because it is most often the first one again: `timeout` sends it
    to the process and then to its whole process group. Installed only in the main thread, and the
    handlers found are put back by `restore`."""

    def __init__(self):
        self.signal_number = 0
        self.previous: dict[int, Any] = {}

    def install(self, message: Callable[[int], str]) -> None:
        """message(signal_number): the line printed when the first signal comes."""
        if threading.current_thread() is not threading.main_thread():
            return
        self.message = message
        for signal_number in (signal.SIGINT, signal.SIGTERM):
            self.previous[signal_number] = signal.signal(signal_number, self.handle)

    def handle(self, signal_number: int, frame: Any) -> None:
        if self.signal_number:  # the handler was already reset below; a signal sent twice at once
            return
        self.signal_number = signal_number
        for other in self.previous:  # the next one acts at once, whatever the main thread is doing (a repeated SIGTERM: ignored)
            repeated_sigterm = other == signal_number == signal.SIGTERM
            signal.signal(other, signal.SIG_IGN if repeated_sigterm else signal.SIG_DFL)
        print(f"\n{self.message(signal_number)}", file=sys.stderr, flush=True)

    def restore(self) -> None:
        for signal_number, handler in self.previous.items():
            signal.signal(signal_number, handler)
        self.previous = {}


def signal_name(signal_number: int) -> str:
    return signal.Signals(signal_number).name


class Segment(NamedTuple):
    """A segment the host has read: cycles first_cycle + 1 .. last_cycle have run."""

    first_cycle: int
    last_cycle: int
    states: Any  # on the device(s)
    metrics: dict[str, np.ndarray]  # (cycles run, runs) per metric name
    ready_time: float  # time.perf_counter() when the host saw it finished


class Dispatched(NamedTuple):
    outputs: tuple[Any, Any, Any]  # the program's (states, metrics, agreed), still computing
    first_cycle: int
    last_cycle: int  # if it runs in full
    dispatch_time: float


class Pace:
    """How many cycles the next segment runs: about SEGMENT_SECONDS at the rate agreed so far (the
    slowest process's), and shorter towards the end (next_cycles). The first runs one cycle; the
    one after the first rate takes its full length at once (that rate was timed on a segment the
    host waited for alone, its round trip included, so it can only overstate a cycle's time); from
    there a segment grows at most 4-fold over the one before. With --distributed every process
    paces from the same agreed values, so they all cut the same segments."""

    def __init__(self, max_cycles: int):
        self.max_cycles = max_cycles
        self.cycles = 1
        self.seconds_per_cycle = 0.0  # 0: not measured yet

    def record(self, seconds_per_cycle: float) -> None:
        if seconds_per_cycle > 0:
            most = 4 * self.cycles if self.seconds_per_cycle else self.max_cycles
            self.seconds_per_cycle = seconds_per_cycle
            by_time = max(1, int(SEGMENT_SECONDS / seconds_per_cycle))
            self.cycles = min(self.max_cycles, most, by_time)

    def next_cycles(self, cycles_left: int) -> int:
        """The next segment's length: `cycles`, but near the end at most half of the cycles left
        (and no fewer than a 64th of `cycles`, about 16 ms: enough to cover the host's round trip
        between two segments). The host writes a segment's rows and checkpoint while the next
        computes, so segments that halve towards the end leave little of that work after the
        device has finished, even where a checkpoint falls a few cycles before the end."""
        return min(self.cycles, cycles_left, max(-(-cycles_left // 2), self.cycles // 64, 1))

    def segments_ahead(self) -> int:
        """Segments dispatched beyond the one running: one, so that the device never waits; none
        while the rate is unknown or a single cycle outlasts SEGMENT_SECONDS (the host's gap is
        nothing beside it, and a stop then waits for one cycle, not two)."""
        return 1 if 0 < self.seconds_per_cycle <= SEGMENT_SECONDS else 0


def local_copy(tree: Any) -> Any:
    """NumPy copies of a tree of arrays that every process holds whole (replicated)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return jax.tree.map(lambda leaf: np.asarray(leaf.addressable_shards[0].data), tree)


class Background:
    """function() on a daemon thread of its own (a compile: XLA works without the GIL). wait()
    waits on the thread's lock, which lets a signal's Python handler run at once."""

    def __init__(self, function: Callable[[], None]):
        self.error: BaseException | None = None

        def run() -> None:
            try:
                function()
            except BaseException as error:  # raised again by wait()
                self.error = error

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def wait_until_ready(array: jax.Array) -> None:
    """Waits for a computation on a thread of its own: the main thread then waits on a lock, which
    a signal interrupts to run its Python handler at once (it would wait for the device to finish
    inside JAX's own wait)."""
    Background(array.block_until_ready).wait()


def run(
    program: Callable, states: Any, start_cycle: int, num_cycles: int, must_end: Callable[[int], bool],
    max_cycles: int, mesh: jax.sharding.Mesh | None, requests: StopRequests, after_segment: Callable[[Segment], None],
) -> tuple[Any, int]:
    """Trains from start_cycle to num_cycles, or until a stop request, in segments of `program`
    (make_program, compiled), each ending no later than the first cycle for which must_end(cycle)
    is true. after_segment runs on the host for each segment that ran, in order, while the next
    one computes. Returns the final states and the stop's signal number (0: the run finished)."""
    pace = Pace(max_cycles)
    in_flight: collections.deque[Dispatched] = collections.deque()
    cycle, stop, measured = start_cycle, 0, 0.0
    last_ready = time.perf_counter()

    def dispatch_ahead() -> None:
        nonlocal states, cycle
        while not stop and cycle < num_cycles and len(in_flight) <= pace.segments_ahead():
            end = cycle + pace.next_cycles(num_cycles - cycle)
            end = next((c for c in range(cycle + 1, end) if must_end(c)), end)
            report = host_reports(HostReport(requests.signal_number, measured), mesh)
            outputs = program(states, np.int32(end - cycle), report)
            in_flight.append(Dispatched(outputs, cycle, end, time.perf_counter()))
            states, cycle = outputs[0], end

    while True:
        dispatch_ahead()
        if not in_flight:
            return states, stop
        segment = in_flight.popleft()
        segment_states, metrics, agreed = segment.outputs
        wait_until_ready(agreed)
        ready = time.perf_counter()
        agreed = HostReport(*local_copy(agreed).tolist())  # the same values in every process
        stop = stop or int(agreed.stop_signal)
        if stop:  # it ran no cycle, nor will any dispatched after it
            continue
        ran = segment.last_cycle - segment.first_cycle
        measured = (ready - max(last_ready, segment.dispatch_time)) / ran
        last_ready = ready
        # --distributed: every process paces from the agreed rate; one process from its own, a segment sooner
        pace.record(measured if jax.process_count() == 1 else agreed.seconds_per_cycle)
        dispatch_ahead()  # the device's next segment before the host's work on this one, its rows' copy included
        rows = {name: values[:ran] for name, values in local_copy(metrics).items()}
        after_segment(Segment(segment.first_cycle, segment.last_cycle, segment_states, rows, ready))
