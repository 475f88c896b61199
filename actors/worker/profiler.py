"""The recording behind --profiler-config (actors/engine/profiler.py): a session opened by
/start_profile and closed by /stop_profile, counted in steps as vLLM's workers count them (a delay
before recording, a limit after which the session stops by itself, torch's wait / warm-up /
active schedule), each step labelled with what it computed. ``StepProfiler`` runs in a worker
(``step`` once per step, on the thread that runs the steps); ``frontend_profiler`` is the server
frontend's, recording its process for the whole session."""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import socket
import time
from typing import Any, Callable, ContextManager

import msgspec
import torch

from actors.engine.messages import SchedulerOutput
from actors.engine.profiler import ProfilerConfig, check_bounds

log = logging.getLogger("troupe.profiler")

TABLE_ROWS = 50

# Imported by torch's profiler when it starts, once recording has begun: the recorder then keeps
# the name of this module's code, which is freed after the import, and reading the events for
# the operator table fails on the garbage (or shows it). Imported here, before any session.
try:
    importlib.import_module("torch.profiler._cupti_monitor")
except ImportError:
    pass


_warm = False


def warm_up() -> None:
    """One empty session, once, on the thread that loaded torch: Kineto (torch's profiler
    library) wants its first session there, and a session first started on another thread (a
    worker's core thread) makes it print an alarming, harmless "ERROR: External init callback"
    line."""
    global _warm
    if not _warm:
        _warm = True
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            pass


class StepProfiler:
    """One process's recorder. ``kind`` "torch": torch.profiler, the trace written by
    ``whole_trace_writer`` as ``<name>.<id>.pt.trace.json[.gz]`` and the operator table as
    ``<name>.profiler_out.txt``; "cuda": cudaProfilerStart / cudaProfilerStop."""

    def __init__(self, config: ProfilerConfig, name: str, activities: tuple[str, ...], print_table: bool = True) -> None:
        self.config = config
        self.name = name
        self.activities = activities
        self.print_table = print_table
        self.active = False            # between start and stop (a delayed start included)
        self.running = False           # recording now
        self._steps = 0                # steps since start
        self._recorded = 0             # steps recorded (warm-up steps not counted)
        self._warmup_left = 0
        self._delay = config.delay_iterations
        self._limit = config.max_iterations
        self._profile: Any = None

    # -- the session ---------------------------------------------------------------------------
    def start(self, name: str | None = None, delay_iterations: int | None = None,
              max_iterations: int | None = None) -> None:
        check_bounds(delay_iterations, max_iterations)
        if self.active:
            log.debug("start_profile while a session is open: ignored")
            return
        if name is not None:
            self.name = name
        self._delay = self.config.delay_iterations if delay_iterations is None else delay_iterations
        self._limit = self.config.max_iterations if max_iterations is None else max_iterations
        self.active, self._steps, self._recorded = True, 0, 0
        if self._delay == 0:
            self._begin()

    def stop(self) -> None:
        if not self.active:
            log.debug("stop_profile with no session open: ignored")
            return
        self.active = False
        if self.running:
            self._end()

    def step(self) -> None:
        """A step ran: start after the delay, advance torch's schedule, stop at the limit."""
        if not self.active:
            return
        self._steps += 1
        if not self.running and self._delay > 0 and self._steps == self._delay:
            log.info("profiling starts after %d steps", self._delay)
            self._begin()
        if self.running and self._schedule_step():
            self._recorded += 1
        if self._limit > 0 and self.running and self._recorded > self._limit:
            log.info("profiled %d steps: stopping", self._limit)
            self.stop()

    def annotate(self, so: SchedulerOutput, in_prompt: Callable[[str], bool]) -> ContextManager[Any]:
        """The step ``so`` as one labelled range of the trace (vLLM's labels, ``step_label``)."""
        if not (self.running and self.config.profiler == "torch" and "CPU" in self.activities):
            return contextlib.nullcontext()
        return torch.profiler.record_function(step_label(so, in_prompt, self.config.detailed_trace_annotation))

    # -- the recorder ---------------------------------------------------------------------------
    def _begin(self) -> None:
        try:
            if self.config.profiler == "cuda":
                torch.cuda.profiler.start()
            else:
                self._profile = torch.profiler.profile(**self._torch_options())
                self._warmup_left = max(self.config.wait_iterations + self.config.warmup_iterations - 1, 0)
                self._profile.start()
            self.running = True
            log.info("profiling (%s) started: %s", self.config.profiler, self.name)
        except Exception as exc:               # noqa: BLE001 -- the engine goes on without it
            log.warning("the profiler did not start: %s", exc)

    def _end(self) -> None:
        try:
            if self.config.profiler == "cuda":
                torch.cuda.profiler.stop()
            else:
                self._profile.stop()           # the trace is written now (on_trace_ready)
                self._write_table()
            log.info("profiling stopped: %s%s", self.name, f", traces in {self.config.torch_profiler_dir}"
                     if self.config.profiler == "torch" else "")
        except Exception as exc:               # noqa: BLE001
            log.warning("the profiler did not stop cleanly: %s", exc)
        self.running = False
        self._profile = None

    def _torch_options(self) -> dict[str, Any]:
        c = self.config
        kinds = {"CPU": torch.profiler.ProfilerActivity.CPU, "CUDA": torch.profiler.ProfilerActivity.CUDA}
        schedule = None
        if c.uses_schedule:
            schedule = torch.profiler.schedule(skip_first=0, wait=c.wait_iterations, warmup=c.warmup_iterations,
                                               active=c.active_iterations, repeat=1)
        os.makedirs(c.torch_profiler_dir, exist_ok=True)
        return dict(activities=[kinds[a] for a in self.activities], schedule=schedule,
                    record_shapes=c.torch_profiler_record_shapes, profile_memory=c.torch_profiler_with_memory,
                    with_stack=c.torch_profiler_with_stack, with_flops=c.torch_profiler_with_flops,
                    on_trace_ready=whole_trace_writer(c.torch_profiler_dir, self.name, c.torch_profiler_use_gzip))

    def _schedule_step(self) -> bool:
        """torch's schedule advanced by one step; whether the step was recorded (not warm-up)."""
        if not self.config.uses_schedule or self.config.profiler != "torch":
            return True
        self._profile.step()
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return False
        return True

    def _write_table(self) -> None:
        """The operators by time (the device's when it recorded one, else the CPU's), as vLLM
        writes them: ``<name>.profiler_out.txt``, and printed by the first rank."""
        device = any(a != "CPU" for a in self.activities) and self.config.torch_profiler_dump_cuda_time_total
        cpu_only = self.activities == ("CPU",)
        if not (device or cpu_only):
            return
        try:
            averages = self._profile.key_averages(group_by_input_shape=self.config.torch_profiler_record_shapes)
            if not len(averages):
                return
            table = (averages.table(sort_by="self_device_time_total") if device
                     else averages.table(sort_by="self_cpu_time_total", row_limit=TABLE_ROWS))
        except UnicodeDecodeError as exc:
            # torch keeps the names of functions whose code was freed before it reads them (a module
            # imported during the session): its table fails; the trace file, written by itself, is whole
            log.warning("torch's operator table could not be built (%s): the table is the trace's totals", exc)
            table = trace_table(self.config.torch_profiler_dir, self.name)
        with open(os.path.join(self.config.torch_profiler_dir, f"{self.name}.profiler_out.txt"), "w") as f:
            print(table, file=f)
        if self.print_table:
            print(table, flush=True)


def whole_trace_writer(folder: str, name: str, use_gzip: bool) -> Callable[[Any], None]:
    """torch's ``tensorboard_trace_handler`` (``<name>.<ns>.pt.trace.json[.gz]`` in ``folder``), but
    the file appears whole: written under a hidden name with the same ending, then renamed, so a
    tool watching the folder never opens half a trace."""
    def write(prof: Any) -> None:
        os.makedirs(folder, exist_ok=True)
        final = f"{name}.{time.time_ns()}.pt.trace.json" + (".gz" if use_gzip else "")
        partial = os.path.join(folder, f".{os.getpid()}-{final}")    # gzipped or not by its ending, as torch decides
        prof.export_chrome_trace(partial)
        os.replace(partial, os.path.join(folder, final))
    return write


def trace_table(folder: str, name: str, rows: int = TABLE_ROWS) -> str:
    """The newest trace of ``name`` in ``folder`` as a table: each event name's calls and total
    time, the longest first."""
    import glob
    import gzip
    import json
    paths = sorted(glob.glob(os.path.join(folder, f"{name}.*.pt.trace.json*")), key=os.path.getmtime)
    if not paths:
        return "no trace was written"
    opener = gzip.open if paths[-1].endswith(".gz") else open
    with opener(paths[-1], "rt", encoding="utf-8", errors="replace") as f:
        events = json.load(f).get("traceEvents", [])
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X":
            t = totals.setdefault(str(e.get("name")), [0, 0.0])
            t[0] += 1
            t[1] += float(e.get("dur", 0))
    lines = [f"{'Name':<90} {'Calls':>8} {'Total (ms)':>12}"]
    for n, (calls, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:rows]:
        lines.append(f"{n[:90]:<90} {calls:>8} {us / 1000:>12.3f}")
    return "\n".join(lines)


def worker_profiler(config: ProfilerConfig, name: str, device: str, first_rank: bool) -> StepProfiler:
    """A worker's recorder: torch's activities as configured, else the CPU and, on a GPU, CUDA."""
    if config.profiler == "cuda" and device != "cuda":
        raise ValueError("--profiler-config: profiler 'cuda' needs a CUDA device; on the CPU use 'torch'")
    activities = tuple(config.torch_profiler_activities or (("CPU", "CUDA") if device == "cuda" else ("CPU",)))
    if "CUDA" in activities and device != "cuda":
        raise ValueError("--profiler-config: torch_profiler_activities CUDA needs a CUDA device")
    return StepProfiler(config, name, activities, print_table=first_rank)


def frontend_profiler(config: ProfilerConfig) -> StepProfiler:
    """The frontend process's recorder (vLLM's AsyncLLM one): the CPU, the whole session, no steps."""
    whole = msgspec.structs.replace(config, delay_iterations=0, max_iterations=0, wait_iterations=0,
                                    warmup_iterations=0)
    return StepProfiler(whole, frontend_name(None), ("CPU",), print_table=False)


def frontend_name(prefix: str | None) -> str:
    name = f"{socket.gethostname()}_{os.getpid()}.async_llm"
    return f"{prefix}_{name}" if prefix else name


def rank_name(prefix: str | None, dp: int, pp: int, tp: int, tp_size: int, pp_size: int) -> str:
    """A worker's trace name, vLLM's: ``[prefix_]dp<d>_pp<p>_tp<t>_dcp0_ep<e>_rank<global>``."""
    rank = dp * tp_size * pp_size + pp * tp_size + tp
    name = f"dp{dp}_pp{pp}_tp{tp}_dcp0_ep{dp * tp_size + tp}_rank{rank}"
    return f"{prefix}_{name}" if prefix else name


def step_label(so: SchedulerOutput, in_prompt: Callable[[str], bool], detailed: bool) -> str:
    """vLLM's label of a step: ``execute_context_<prompt requests>(<their tokens>)_generation_
    <decoding requests>(<their tokens>)``; ``detailed``, with each phase's attention sizes (sk: the
    sequence lengths, sqsq and sqsk: query x query and query x sequence). A request is in its
    prompt until it has an output token (``in_prompt``), or when it is new to the worker."""
    computed = {r.req_id: r.num_computed_tokens for r in so.new_reqs}
    computed.update(zip(so.cached_reqs.req_ids, so.cached_reqs.num_computed_tokens))
    new = {r.req_id for r in so.new_reqs}
    phases = {True: [0, 0, 0, 0, 0], False: [0, 0, 0, 0, 0]}    # requests, tokens, sk, sqsq, sqsk
    for rid, q in so.num_scheduled_tokens.items():
        p = phases[rid in new or in_prompt(rid)]
        s = computed.get(rid, 0) + q
        for j, v in enumerate((1, q, s, q * q, q * s)):
            p[j] += v
    c, g = phases[True], phases[False]
    if not detailed:
        return f"execute_context_{c[0]}({c[1]})_generation_{g[0]}({g[1]})"
    return (f"execute_{c[1] + g[1]}_context_{c[0]}(sq{c[1]}sk{c[2]}sqsq{c[3]}sqsk{c[4]})"
            f"_generation_{g[0]}(sq{g[1]}sk{g[2]}sqsq{g[3]}sqsk{g[4]})")
