"""A warm interpreter for tests that run code in a process of its own: one server process per pytest worker
imports the heavy modules once, then forks a child for every piece of code a test sends. The child starts
from the server's state (the modules imported, nothing run) as a fresh ``python -c`` would after the same
imports, and what it changes dies with it, so tests stay independent. A new ``python -c`` per test paid the
imports (torch, transformers, Triton, the package: 2.5-5.5 s of CPU here) every time. Used for the code that
must run under TRITON_INTERPRET=1 (Triton picks its interpreter when it decorates the kernels, at import), a
process that never imports cast_llm, the benchmarks' --quick runs, and the commands a test signals or kills
(:meth:`WarmInterpreter.start`, Popen-like). conftest.py holds the shared servers.

Run as a script, this file is the server: it reads one JSON request per line on stdin, forks, and answers one
JSON line per request on stdout (the child's pid at once, then its exit status)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


class WarmInterpreter:
    """``run(code)`` is ``subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **overrides),
    capture_output=True)`` in a child forked from a server that has imported ``preload`` under that environment
    (``path`` goes first on PYTHONPATH). The child takes the environment of the moment of ``run`` (a test's own
    variables, e.g. its kernel-verdict file); the modules the server imported read theirs at its start."""

    def __init__(self, overrides: dict[str, str], preload: list[str], path: list[str] = ()):
        self.overrides = dict(overrides, PYTHONPATH=os.pathsep.join([*map(str, path),
                                                                     os.environ.get("PYTHONPATH", "")]))
        self._dir = tempfile.TemporaryDirectory(prefix="warm-interpreter-")
        self.proc = subprocess.Popen([sys.executable, __file__, *preload], env=dict(os.environ, **self.overrides),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1)
        self._n = 0
        self._buf = b""
        self._running: WarmProcess | None = None

    def run(self, code: str, timeout: float = 600) -> Result:
        proc = self.start(code)
        try:
            out, err = proc.communicate(timeout)
        except TimeoutError:
            proc.kill()
            out, err = proc.communicate(60)
            return Result(-9, out, err + f"\nkilled after {timeout:.0f} s")
        return Result(proc.returncode, out, err)

    def start(self, code: str, unbuffered: bool = False) -> WarmProcess:
        """The child running ``code`` (``sys.argv`` as the code sets it), at once, as ``subprocess.Popen`` would
        return it: ``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``, ``communicate``, ``returncode``.
        ``unbuffered``: its stdout and stderr written through at once, as ``python -u`` writes them."""
        if self._running is not None and self._running.poll() is None:
            raise RuntimeError("the warm interpreter runs one child at a time")
        self._n += 1
        out, err = (Path(self._dir.name) / f"{self._n}.{k}" for k in ("out", "err"))
        env = dict(os.environ, **self.overrides)
        try:
            self.proc.stdin.write(json.dumps({"code": code, "out": str(out), "err": str(err), "env": env,
                                              "unbuffered": unbuffered}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the server has ended: the read below says why
        reply = self._read(600)
        self._running = WarmProcess(self, reply, out, err)
        return self._running

    def _read(self, timeout: float) -> dict:
        """The server's next reply line. Read from the pipe's descriptor with a buffer of our own: a buffered file
        may already hold the next line (a quick child's pid and status come together), which select() would not
        see."""
        import select
        import time

        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the server died: its stderr says why
                return {"error": "the warm interpreter ended:\n" + self.proc.stderr.read()[-4000:]}
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def reap(self) -> None:
        """Kill the child still running, if any (the server waits for it before it takes the next request)."""
        running = self._running
        if running is not None and running.poll() is None:
            running.kill()
            with contextlib.suppress(TimeoutError):
                running.wait(30)

    def close(self) -> None:
        self.reap()
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._dir.cleanup()


class WarmProcess:
    """One child of the warm interpreter, used as a ``subprocess.Popen`` is (see :meth:`WarmInterpreter.start`)."""

    def __init__(self, server: WarmInterpreter, reply: dict, out: Path, err: Path):
        self._server, self._out, self._err = server, out, err
        self.pid = reply.get("pid")
        self.returncode: int | None = None
        self._error = reply.get("error")
        if self._error is not None:  # the server itself failed (an import of preload): the child's failure
            self.returncode = 1

    def _status(self, timeout: float) -> None:
        reply = self._server._read(timeout)  # TimeoutError while the child runs
        if "error" in reply:  # the server died with the child
            self._error, self.returncode = reply["error"], 1
        else:
            self.returncode = reply["status"]

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self._status(0)
            except TimeoutError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._status(600 if timeout is None else timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        if self._error is not None:
            return "", self._error
        return _text(self._out), _text(self._err)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmRanks:
    """``run(argv, nproc)`` is ``torchrun --nproc_per_node NPROC ARGV`` on one machine without the launcher's
    processes: each rank is forked from a warm server of its own (:class:`WarmInterpreter`, one per rank, made on
    first use) with the variables torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    GROUP_RANK, MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS=1 from the start). As torchrun's agent does, the other
    ranks are stopped once one fails. Each real launch paid the launcher's and every rank's imports: the tests
    moved here took 155 CPU-s under torchrun and 84 CPU-s this way (measured 2026-12-07, one pytest process). The
    tests that signal a launcher or start `accelerate launch` keep the real one."""

    def __init__(self, preload: list[str], path: list[str] = ()):
        self.preload, self.path, self.servers = preload, path, []

    def _server(self, rank: int) -> WarmInterpreter:
        while len(self.servers) <= rank:
            self.servers.append(WarmInterpreter({"OMP_NUM_THREADS": "1"}, preload=self.preload, path=self.path))
        return self.servers[rank]

    def run(self, argv: list[str], nproc: int = 2, env: dict[str, str] | None = None,
            timeout: float = 600) -> Result:
        """``argv``: ``["-m", "module", *args]`` or ``["script.py", *args]``, as torchrun takes them. Result: the
        first failing rank's status (else 0), the ranks' stdout and stderr one after another (rank 0 first)."""
        import time

        from run_helpers import free_port

        port = free_port()
        if argv[0] == "-m":
            run = f"sys.argv = {[argv[1], *argv[2:]]!r}\nrunpy.run_module({argv[1]!r}, run_name='__main__', alter_sys=True)"
        else:
            run = f"sys.argv = {list(argv)!r}\nrunpy.run_path({argv[0]!r}, run_name='__main__')"
        procs = []
        for rank in range(nproc):
            ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                     "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port), **(env or {})}
            procs.append(self._server(rank).start(f"import os, runpy, sys\nos.environ.update({ranks!r})\n{run}\n",
                                                  unbuffered=True))
        deadline, status = time.monotonic() + timeout, 0
        while [p.poll() for p in procs].count(None):  # every rank polled (any() would stop at the first running)
            status = status or next((p.returncode for p in procs if p.returncode), 0)  # the first to fail
            if status or time.monotonic() > deadline:  # torchrun's agent stops every worker once one fails
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.05)
        outs = [p.communicate(60) for p in procs]
        status = status or next((p.returncode for p in procs if p.returncode), 0)
        return Result(status, "".join(o for o, _ in outs), "".join(e for _, e in outs))

    def close(self) -> None:
        for server in self.servers:
            server.close()


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _child(code: str, out: str, err: str, env: dict[str, str], unbuffered: bool) -> None:
    """In the forked child: the request's code as ``python -c`` runs it, in the request's environment,
    stdout/stderr to the given files."""
    import io

    os.environ.clear()
    os.environ.update(env)
    for fd, name in ((1, out), (2, err)):
        f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the child's stdin must not be the request pipe

    def stream(fd: int, err: bool):
        raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)  # noqa: SIM115
        return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace" if err else "strict",
                                line_buffering=err, write_through=unbuffered)

    sys.stdout, sys.stderr = stream(1, False), stream(2, True)
    sys.argv = ["-c"]  # as python -c has it (the code may set its own)
    status = 0
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:  # sys.exit(n) exits with n, sys.exit("message") prints it and exits with 1
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    import atexit

    atexit._run_exitfuncs()  # as an interpreter's exit runs them; then leave without returning to the server loop
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _serve(preload: list[str]) -> None:
    import importlib

    sys.path.insert(0, "")  # as python -c has it
    try:
        for name in preload:
            importlib.import_module(name)
    except BaseException:
        print(json.dumps({"error": traceback.format_exc()}), flush=True)
        return
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req["code"], req["out"], req["err"], req["env"], req.get("unbuffered", False))
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    _serve(sys.argv[1:])
