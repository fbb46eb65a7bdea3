"""The fork-server: one parent that has imported gyges, numpy and the corpus forks a child per
mutant; the child limits its address space (RLIMIT_AS) and runs child.run, and writes its record
as JSON into a pipe. The parent keeps `jobs` children going, kills one that runs past the wall
limit (hang) and classifies one that dies (crash by signal, oom by SIGKILL it did not send).

Forking a process that has threads copies only the forking one, with every lock another held;
so the parent starts no engine (children do) and refuses to fork once it has a second thread."""
import faulthandler
import json
import os
import resource
import select
import shutil
import signal
import time
import traceback

CRASH_SIGNALS = {signal.SIGSEGV: "SIGSEGV", signal.SIGABRT: "SIGABRT", signal.SIGBUS: "SIGBUS",
                 signal.SIGFPE: "SIGFPE", signal.SIGILL: "SIGILL", signal.SIGTRAP: "SIGTRAP"}


def threads():
    return len(os.listdir("/proc/self/task"))


def vm_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


class ForkServer:
    """run(pairs) -> records, one per (seed, index). `target(seed, index, workdir, note)` is
    what a child runs (child.run over a corpus, or a probe); its dict is the record. note(dict)
    sends part of the record at once (what the mutant is), so a child that dies later is still
    named in the report."""

    def __init__(self, target, workroot, timeout_s=10.0, memory_bytes=2 << 30, jobs=1):
        self.target = target
        self.workroot = workroot
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes  # address space a child may add to the parent's
        self.jobs = jobs

    def run(self, pairs, on_record=None):
        pending, running, records = list(pairs), {}, []
        while pending or running:
            while pending and len(running) < self.jobs:
                job = self._spawn(*pending.pop(0))
                running[job["fd"]] = job
            deadline = min(j["start"] + self.timeout_s for j in running.values())
            ready, _, _ = select.select(list(running), [], [], max(0.0, deadline - time.monotonic()))
            for fd in ready:
                job = running[fd]
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    job["out"] += chunk
                    continue
                del running[fd]
                records.append(self._finish(job, killed=False))
                on_record and on_record(records[-1])
            now = time.monotonic()
            for fd, job in list(running.items()):
                if now - job["start"] > self.timeout_s:
                    os.kill(job["pid"], signal.SIGKILL)
                    del running[fd]
                    records.append(self._finish(job, killed=True))
                    on_record and on_record(records[-1])
        return records

    def _spawn(self, seed, index):
        if threads() != 1:
            raise RuntimeError(f"the fork-server has {threads()} threads; forking now could "
                               f"leave a child holding another thread's lock (set "
                               f"OPENBLAS_NUM_THREADS=1 before numpy, start no engine here)")
        workdir = os.path.join(self.workroot, f"{seed}_{index}")
        shutil.rmtree(workdir, ignore_errors=True)
        os.makedirs(self.workroot, exist_ok=True)
        limit = vm_bytes() + self.memory_bytes
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 0
            try:
                os.close(r)
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                # where a crash happened: Python's stack at the signal, for the report
                faulthandler.enable(open(workdir + ".fault", "w"), all_threads=False)
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
                def note(part):
                    _write_all(w, json.dumps(part, default=str).encode() + b"\n")
                try:
                    record = self.target(seed, index, workdir, note)
                except MemoryError as e:
                    record = {"seed": seed, "index": index, "class": "oom", "error": str(e)}
                payload = json.dumps(record, default=str).encode()
            except BaseException:  # noqa: BLE001 (the harness's own failure, reported)
                payload = json.dumps({"seed": seed, "index": index, "class": "harness",
                                      "error": traceback.format_exc()[-1500:]}).encode()
                code = 3
            try:
                _write_all(w, payload + b"\n")
            finally:
                os._exit(code)
        os.close(w)
        return {"pid": pid, "fd": r, "out": b"", "start": time.monotonic(), "seed": seed,
                "index": index, "workdir": workdir}

    def _finish(self, job, killed):
        _, status = os.waitpid(job["pid"], 0)
        os.close(job["fd"])
        elapsed = time.monotonic() - job["start"]
        shutil.rmtree(job["workdir"], ignore_errors=True)
        where = _python_frames(job["workdir"] + ".fault")
        if os.path.exists(job["workdir"] + ".fault"):
            os.remove(job["workdir"] + ".fault")
        base = {"seed": job["seed"], "index": job["index"], "seconds": round(elapsed, 3)}
        record = {}
        for line in job["out"].split(b"\n"):
            try:
                record.update(json.loads(line))
            except ValueError:
                pass  # a line cut short by the child's death
        if killed:
            return {**record, **base, "class": "hang",
                    "error": f"still running after {self.timeout_s} s"}
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig == signal.SIGKILL:
                return {**record, **base, "class": "oom",
                        "error": "killed by SIGKILL (the OOM killer)"}
            return {**record, **base, "class": "crash",
                    "error": f"killed by {CRASH_SIGNALS.get(sig, sig)}",
                    "where": where}
        if "class" not in record:
            return {**record, **base, "class": "crash",
                    "error": f"exited {os.WEXITSTATUS(status)} without a report"}
        return {**record, **base}


def _python_frames(path, n=4):
    """The innermost frames faulthandler wrote at a fatal signal, innermost first."""
    try:
        lines = [ln.strip() for ln in open(path) if ln.strip().startswith("File ")]
    except OSError:
        return None
    return [ln.replace("File ", "") for ln in lines[:n]] or None


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
