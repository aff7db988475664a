"""A fork server for the suite's ``python -m ...`` and ``python -c ...`` subprocesses: one interpreter per test
process that has imported Celery, kombu, billiard, redis-py, amqp, psycopg and Django's non-model modules once,
and forks a child for each worker, beat or CLI start a test asks for.

Why: the suite starts a few hundred ``celery worker``/``beat`` processes and each spent about 1 s of CPU
importing the same libraries before it did anything (2 s with Django). The child is still a real process of
its own: its own pid and session (``setsid``, so ``killpg`` takes it and its pool children, as with
``start_new_session``), its own environment, working directory, ``sys.argv`` and ``sys.path``, its output in
the test's log file, and it runs the module's ``__main__`` as ``python -m`` does (``runpy``) or the code in a
fresh ``__main__`` as ``python -c`` does. What it shares with its siblings is only the imported, untouched
library code: a test whose child checks which modules are loaded (that Django is not, say) keeps a plain
subprocess.

What is preloaded is library code and the project modules Celery's command line loads through its
``celery.commands`` entry point (``celery_guardrails.operations.cli``), never a settings module or a test app. A
start whose environment sets differently from the server a variable read as the interpreter starts
(``PYTHON*`` other than ``PYTHONPATH``) or as a preloaded library is imported (:data:`IMPORT_TIME_VARIABLES`)
runs as a plain subprocess instead (:meth:`ForkServer.can_fork`).

Protocol: the test process holds one end of a socket pair; for each start it sends a new socket pair's end and
the log file's descriptor (``SCM_RIGHTS``) with a pickled request. The server forks, answers the child's pid on
that socket and, when the child ends, its exit status (:func:`os.waitstatus_to_exitcode`: ``-N`` for a signal,
as :class:`subprocess.Popen` reports it). The server exits when the test process's end closes.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Imported once by the server: libraries, and what they import (``celery.bin.celery`` loads the entry points).
PRELOAD = (
    "celery",
    "celery.bin.celery",
    "celery.apps.worker",
    "celery.apps.beat",
    "celery.beat",
    "celery.worker",
    "celery.worker.consumer",
    "celery.worker.request",
    "celery.worker.strategy",
    "celery.concurrency.prefork",
    "celery.concurrency.solo",
    "celery.concurrency.thread",
    "celery.backends.redis",
    "celery.backends.database",
    "celery.fixups.django",
    "celery.contrib.abortable",
    "kombu.transport.redis",
    "kombu.transport.pyamqp",
    "kombu.asynchronous",
    "billiard.pool",
    "redis",
    "redis.cluster",
    "redis.sentinel",
    "amqp",
    "psycopg",
    "psycopg_pool",
    "django",
    "django.conf",
    "django.apps",
    "django.db",
    "django.db.models",
    "django.db.backends.postgresql.base",
    "django.db.backends.sqlite3.base",
    "django.core.management",
    "django.core.management.base",
    "django.core.checks",
    "django.forms",
    "django.template",
    "django.template.defaulttags",
    "django.template.loader_tags",
    "django.urls",
    "django.http",
    "django.utils.timezone",
    "django.utils.translation",
    "django.contrib.admin.checks",
    "django.contrib.admin.filters",
    "django.contrib.admin.helpers",
    "django.contrib.admin.widgets",
    "django_celery_beat.schedulers",
    "click",
    "cryptography.fernet",
)

#: Variables that preloaded libraries read once, as they are imported (celery's and kombu's debugging switches,
#: prometheus_client's multiprocess mode): a start that sets one differently from the server runs as a plain
#: subprocess.
IMPORT_TIME_VARIABLES = frozenset(
    {
        "PROMETHEUS_MULTIPROC_DIR",
        "prometheus_multiproc_dir",
        "PROMETHEUS_DISABLE_CREATED_SERIES",
        "FORKED_BY_MULTIPROCESSING",
        "C_FAKEFORK",
        "C_BENCH",
        "CELERY_BENCH",
        "C_BENCH_EVERY",
        "C_STRICT_APP",
        "C_WARN_APP",
        "CELERY_TRACE_APP",
        "C_WNOCONF",
        "C_REMDEBUG",
        "C_IMPDEBUG",
        "MP_LOG",
        "MP_MAIN_FILE",
        "USE_FAST_LOCALS",
        "TIMER_DEBUG",
        "NOSETPS",
        "REMAP_SIGTERM",
        "DISABLE_TRACEBACKS",
        "KOMBU_LOG_DEBUG",
        "KOMBU_LOG_CONNECTION",
        "KOMBU_LOG_CHANNEL",
        "KOMBU_DISABLE_LIMIT_PROTECTION",
        "PICKLE_PROTOCOL",
        "CELERY_RDB_HOST",
        "CELERY_RDB_PORT",
        "AUTOSCALE_KEEPALIVE",
    }
)

_HEADER = struct.Struct("!I")
_STATUS = struct.Struct("!i")


# --- the server ---------------------------------------------------------------------------------------------


def _preload() -> None:
    for name in PRELOAD:
        # A module that cannot be imported here (an optional library absent, one that needs settings) is
        # left for the child to import; Python drops a module whose import failed from sys.modules.
        with contextlib.suppress(Exception):
            __import__(name)


def _receive(control: socket.socket) -> tuple[dict[str, object], list[int]] | None:
    header, fds, _flags, _address = socket.recv_fds(control, _HEADER.size, 3)
    if not header:
        return None
    (size,) = _HEADER.unpack(header)
    body = b""
    while len(body) < size:
        chunk = control.recv(size - len(body))
        if not chunk:
            return None
        body += chunk
    return pickle.loads(body), list(fds)


def _child(request: dict[str, object], out_fd: int, err_fd: int, closing: Sequence[int], base_path: list[str]) -> None:
    """In the forked child: become the process ``python -m <module> <args>`` (or ``-c <code>``) would have
    been, then run it."""
    code = 1
    try:
        # Undo what the server changed, back to what a fresh interpreter sets up (SIGPIPE and SIGXFSZ stay
        # ignored, as Python leaves them).
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in closing:
            with contextlib.suppress(OSError):
                os.close(fd)
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        for fd in {null, out_fd, err_fd} - {0, 1, 2}:
            os.close(fd)
        cwd = str(request["cwd"])
        env = dict(request["env"])  # type: ignore[call-overload]
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        extra = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
        flag, target = str(request["flag"]), str(request["target"])
        # As the interpreter sets them: `-m` puts the working directory first on the path, `-c` an empty entry.
        sys.path[:] = [cwd if flag == "-m" else "", *extra, *base_path]
        sys.argv = [target if flag == "-m" else "-c", *request["args"]]  # type: ignore[misc]
        try:
            if flag == "-m":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                main = types.ModuleType("__main__")
                sys.modules["__main__"] = main
                exec(compile(target, "<string>", "exec"), main.__dict__)
            code = 0
        except SystemExit as exit_:
            if exit_.code is None:
                code = 0
            elif isinstance(exit_.code, int):
                code = exit_.code
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except BaseException:  # printed as the interpreter would; the exit status says it
            traceback.print_exc()
            code = 1
        # What the interpreter does on its way out: wait for non-daemon threads, run atexit, flush.
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
    except BaseException:  # the child must never return into the server's loop
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


def _account(what: str, usage: object) -> None:
    """With ``GUARDRAILS_TEST_FORK_ACCOUNT=<file>``: a line per child that ended, its CPU seconds (its own and
    its reaped pool children's) and what it was. The children are not the test process's, so nothing else
    counts them while the server runs."""
    path = os.environ.get("GUARDRAILS_TEST_FORK_ACCOUNT")
    if not path:
        return
    seconds = usage.ru_utime + usage.ru_stime  # type: ignore[attr-defined]
    with contextlib.suppress(OSError), open(path, "a") as account:
        account.write(f"{seconds:.3f}\t{what}\n")


def serve(control: socket.socket) -> None:
    base_path = [path for path in sys.path[1:] if path not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    _preload()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C at the terminal is for pytest, which stops us
    children: dict[int, socket.socket] = {}
    #: Each child's module and test, for the CPU account.
    accounts: dict[int, str] = {}
    while True:
        readable, _, _ = select.select([control, wake_r], [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 512)
        while children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _account(accounts.pop(pid, ""), usage)
            answer = children.pop(pid, None)
            if answer is not None:
                with contextlib.suppress(OSError):
                    answer.sendall(_STATUS.pack(os.waitstatus_to_exitcode(status)))
                answer.close()
        if control in readable:
            received = _receive(control)
            if received is None:
                return
            request, fds = received
            if len(fds) != 3:  # not this server's protocol (a test process of another checkout's code)
                for fd in fds:
                    os.close(fd)
                continue
            answer_fd, out_fd, err_fd = fds
            answer = socket.socket(fileno=answer_fd)
            label = f"{request.get('flag')} {str(request.get('target'))[:40]!r} {_test_of(request)}"
            pid = os.fork()
            if pid == 0:
                others = [held.fileno() for held in children.values()]
                _child(request, out_fd, err_fd, [control.fileno(), wake_r, wake_w, answer_fd, *others], base_path)
            os.close(out_fd)
            os.close(err_fd)
            children[pid] = answer
            accounts[pid] = label
            with contextlib.suppress(OSError):  # the test process is gone: the child is reaped all the same
                answer.sendall(_STATUS.pack(pid))


def _test_of(request: dict[str, object]) -> str:
    env = request.get("env")
    return str(env.get("PYTEST_CURRENT_TEST", "")) if isinstance(env, dict) else ""


# --- the test process's side ----------------------------------------------------------------------------------


class ForkedProcess:
    """What :class:`subprocess.Popen` offers the tests (``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``), for a child of the fork server."""

    def __init__(self, args: Sequence[str], pid: int, answer: socket.socket) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self._answer = answer

    def _read_status(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        readable, _, _ = select.select([self._answer], [], [], timeout)
        if not readable:
            return None
        data = b""
        while len(data) < _STATUS.size:
            chunk = self._answer.recv(_STATUS.size - len(data))
            if not chunk:  # the server is gone: nothing can say how the child ended
                raise RuntimeError(f"the fork server stopped before reporting on pid {self.pid}")
            data += chunk
        (self.returncode,) = _STATUS.unpack(data)
        self._answer.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._read_status(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read_status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkServer:
    """The test process's fork server, started on first use (one per test process, ended with it)."""

    def __init__(self) -> None:
        self._owner = os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._env = _server_env()
        self._server = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote", str(theirs.fileno())],
            cwd=ROOT,
            env=self._env,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self._control = ours
        self._lock = threading.Lock()
        #: Set once a start failed: the server is not asked again.
        self._broken = False
        atexit.register(self.close)

    def can_fork(self, env: dict[str, str]) -> bool:
        """Whether a child with ``env`` is the process a plain start would give: the interpreter reads its
        ``PYTHON*`` variables as it starts and the preloaded libraries a few more as they are imported
        (:data:`IMPORT_TIME_VARIABLES`), so they must be the server's (``PYTHONPATH`` is applied in the child)."""
        if self._broken or self._server.poll() is not None:
            return False
        for name in {*env, *self._env}:
            read_at_start = name.startswith("PYTHON") and name != "PYTHONPATH"
            if (read_at_start or name in IMPORT_TIME_VARIABLES) and env.get(name) != self._env.get(name):
                return False
        return True

    def start(
        self, command: Sequence[str], *, cwd: Path, env: dict[str, str], log_fd: int, err_fd: int | None = None
    ) -> ForkedProcess:
        """Start ``command`` (``python -m <module> ...`` or ``python -c <code> ...``), its output (and its error
        output, unless ``err_fd`` is given) into ``log_fd``."""
        if not forkable(command):
            raise ValueError(f"the fork server runs `{sys.executable} -m <module> ...` or `-c <code> ...`: {command}")
        flag, target, *args = command[1:]
        request = pickle.dumps({"flag": flag, "target": target, "args": args, "cwd": str(cwd), "env": env})
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._broken = True  # until the pid is back
        try:
            with self._lock:
                socket.send_fds(
                    self._control,
                    [_HEADER.pack(len(request))],
                    [theirs.fileno(), log_fd, log_fd if err_fd is None else err_fd],
                )
                self._control.sendall(request)
        finally:
            theirs.close()
        data = b""
        while len(data) < _STATUS.size:
            chunk = ours.recv(_STATUS.size - len(data))
            if not chunk:
                raise RuntimeError("the fork server did not start the process")
            data += chunk
        (pid,) = _STATUS.unpack(data)
        self._broken = False
        return ForkedProcess(command, pid, ours)

    def close(self) -> None:
        if os.getpid() != self._owner:
            return
        with contextlib.suppress(OSError):
            self._control.close()
        with contextlib.suppress(Exception):
            self._server.wait(10)


def _server_env() -> dict[str, str]:
    # The server's own environment matters only for the interpreter's start (its PYTHON* variables): each
    # child gets the environment its test asked for. Settings modules are left out so nothing is configured.
    env = {name: value for name, value in os.environ.items() if name != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def enabled() -> bool:
    """Whether the suite's subprocesses start from the fork server (``GUARDRAILS_TEST_FORK=0``: each one a
    fresh interpreter, as before, to compare or to rule the server out)."""
    return os.environ.get("GUARDRAILS_TEST_FORK", "1") != "0"


def forkable(command: Sequence[str]) -> bool:
    """Whether the fork server can run ``command``: this interpreter with ``-m <module>`` or ``-c <code>``."""
    return len(command) >= 3 and command[0] == sys.executable and command[1] in ("-m", "-c")


def spawn(
    command: Sequence[str], *, cwd: Path, env: dict[str, str], stdout: int, stderr: int
) -> subprocess.Popen[bytes] | ForkedProcess:
    """Start ``command`` in a session of its own, output to the descriptors ``stdout`` and ``stderr``: from the
    fork server when it can be (a ``python -m`` whose environment the server can give, the server running), a
    plain subprocess otherwise."""
    if enabled() and forkable(command) and server().can_fork(env):
        try:
            return server().start(command, cwd=cwd, env=env, log_fd=stdout, err_fd=stderr)
        except (OSError, RuntimeError):  # the server is gone: it cannot fork again (can_fork says so from now)
            pass
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, start_new_session=True
    )


def kit_launcher(
    command: Sequence[str], *, env: dict[str, str], stdout: int
) -> subprocess.Popen[bytes] | ForkedProcess:
    """The test kit's launcher for this suite (``guardrails_launcher`` in pyproject.toml): its worker from the fork
    server, in the test's working directory, errors with the output."""
    return spawn(command, cwd=Path.cwd(), env=env, stdout=stdout, stderr=stdout)


def run(command: Sequence[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(command, capture_output=True, text=True, timeout=timeout)`` through :func:`spawn`; on a
    timeout the child's whole process group is SIGKILLed."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = spawn(command, cwd=cwd, env=env, stdout=out.fileno(), stderr=err.fileno())
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(
            list(command), code, out.read().decode(errors="replace"), err.read().decode(errors="replace")
        )


_server: ForkServer | None = None


def server() -> ForkServer:
    """This test process's fork server (started now if it is not yet)."""
    global _server
    if _server is None or _server._owner != os.getpid():
        _server = ForkServer()
    return _server


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
