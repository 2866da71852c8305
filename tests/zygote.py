"""A launcher for the tests' ``tune run`` launches that skips the imports: a process that has
imported torch, torchtune, torchao, datasets and exactga once forks each launch.

Most of a tiny launch is start-up: importing torch, torchtune, torchao and datasets costs about
4 s of CPU, and a 2-rank launch pays it three times (``tune`` and each rank) before a step of
milliseconds. Here one server per test worker pays it once (``serve``), and a launch is a small
stand-in for the ``tune`` script (``CLIENT``, stdlib only) that hands the server its command line,
environment, working directory and standard streams; the server forks a child that runs
torchtune's ``tune`` main with them. Under ``--nproc_per_node`` that child is torchrun's agent, and
it asks the server to fork each rank too (``python -u <recipe> ...`` as torchrun starts it), so no
rank imports either.

What the launching test sees is a launch's: the stand-in exits with the child's exit status (or
dies of the signal the child died of), the child writes into the stand-in's own stdout and
stderr, SIGINT, SIGTERM and SIGHUP sent to the stand-in reach the child, and the child dies when
the stand-in does (SIGKILL included). Each child is what a fresh process would be after those
imports: its own session, the stand-in's environment and working directory, ``sys.argv`` and
``sys.path[0]`` as ``tune`` (or ``python -u <recipe>``) sets them, signal handlers at Python's
defaults, the exit path of an interpreter (non-daemon threads joined, ``atexit`` run, streams
flushed). One difference, on purpose: the imports' objects are frozen (``gc.freeze``), so the
child's garbage collections skip them: each frees the same garbage at a fraction of the cost.

Note (fork safety): the server forks from a process of one thread, so no lock is held across a
fork and a child has no thread's half-done work. It starts no thread and runs no tensor
operation; the imports start none either: numpy's BLAS pool stays unstarted under the launches'
``OMP_NUM_THREADS=1`` (tests/recipe_utils.py), and pyarrow's jemalloc, whose background thread
is the only other one they start, is told not to start it (``JE_ARROW_MALLOC_CONF``, in the
server's environment only: arrow's memory pool is mimalloc either way). ``serve`` checks it
before it listens; a server with another thread (``OMP_NUM_THREADS=4 pytest ...`` starts
numpy's pool) ends, saying which, and every launch of that test worker is a real one.

What only a fresh process shows stays a real launch (``recipe_utils.run_tune`` decides): a launch
whose environment differs from the server's in anything read at import (``HF_DATASETS_CACHE``,
say) or asked to be real (``EXACTGA_TESTS_REAL_LAUNCH=1``); ``EXACTGA_TESTS_ZYGOTE=0`` makes every
launch real. A ``PYTHONPATH`` that puts entries before the server's (a test's own modules: the
GRPO tests' reward components in tests/) still forks where a fresh interpreter would import
nothing else than the server did (``path_is_safe``: absolute folders, holding no start-up hook and
no other file for a module the server imported); the child puts them on ``sys.path`` where a
fresh interpreter puts ``PYTHONPATH``. Any other ``PYTHONPATH`` is a real launch.
tests/test_quiet_torchao.py and two of tests/test_stop_on_signal.py's launches check the console
of a fresh process.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import gc
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Variables a launch may set differently from the server without a real launch: none of them is
# read when a module is imported (each is read by the run itself, or by nothing in the child).
# Any other difference makes a real launch, so a variable missing here costs time, never truth.
# torch sets TORCHINDUCTOR_CACHE_DIR in the test worker once inductor is used there, to the
# default it reads afresh at each use.
RUNTIME_VARIABLES = {
    "PYTEST_CURRENT_TEST",
    "EXACTGA_COUNT_COLLECTIVES_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
}
REAL_LAUNCH = "EXACTGA_TESTS_REAL_LAUNCH"  # set to 1 in a launch's environment: a real process
SWITCH = "EXACTGA_TESTS_ZYGOTE"  # set to 0: every launch real
SOCKET = "EXACTGA_TESTS_ZYGOTE_SOCKET"  # the stand-in's: the server's socket (not passed on)
# The server's own environment on top of a launch's: no jemalloc background thread (see Note).
SERVER_ONLY = {"JE_ARROW_MALLOC_CONF": "background_thread:false"}
UNSAFE_TO_FORK = 3  # the server's exit status when its imports left it more than one thread
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)

# The stand-in for ``tune``: stdlib only, so it starts in milliseconds. Written next to the
# server's socket as an executable named ``tune`` (tests/conftest.py recognises a launch by that
# name). It sends one JSON line and its three standard streams, reads the child's pid, forwards
# signals to it, and ends as the child ended.
CLIENT = r"""
import array, json, os, signal, socket, sys

def main():
    env = dict(os.environ)
    path = env.pop("%(socket)s")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    request = {"mode": "tune", "argv": [%(tune)r, *sys.argv[1:]], "env": env, "cwd": os.getcwd()}
    fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))]
    sock.sendmsg([json.dumps(request).encode() + b"\n"], fds)
    lines = sock.makefile("rb")
    pid = int(lines.readline())
    for signum in %(forwarded)r:
        signal.signal(signum, lambda signum, frame: os.kill(pid, signum))
    status = int(lines.readline())
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    sys.exit(os.waitstatus_to_exitcode(status))

main()
"""

_lock = threading.Lock()
_server: dict[str, object] = {}


# --- the test worker's side ---------------------------------------------------------------------


def tune_command(
    env: dict[str, str], tune: Path, base: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a ``tune`` launch with ``env``: the stand-in and its
    server's socket where the server can make it, else ``[tune]`` and ``env`` unchanged. The
    server starts, on first use, with ``base`` (a plain launch's environment; ``env`` if None)."""
    if env.get(SWITCH, "1") == "0" or env.get(REAL_LAUNCH) == "1":
        return [str(tune)], env
    with _lock:
        if not _server:
            _start(env if base is None else base, tune)
    if _server["process"].poll() is not None:  # the server ended: launch as before
        return [str(tune)], env
    base = _server["env"]
    keys = (env.keys() | base.keys()) - RUNTIME_VARIABLES - {"PYTHONPATH"}
    if any(env.get(key) != base.get(key) for key in keys):  # read at import: a real launch
        return [str(tune)], env
    extra = extra_path(env.get("PYTHONPATH"), base.get("PYTHONPATH"))
    if extra is None or not path_is_safe(extra, _server["modules"]):
        return [str(tune)], env
    return [str(_server["client"])], {**env, SOCKET: str(_server["socket"])}


def extra_path(path: str | None, base: str | None) -> list[str] | None:
    """The entries ``PYTHONPATH`` ``path`` puts before the server's (``base``), or None where
    it is not those entries followed by exactly the server's."""
    entries = path.split(os.pathsep) if path else []
    tail = base.split(os.pathsep) if base else []
    if len(entries) < len(tail) or entries[len(entries) - len(tail) :] != tail:
        return None
    return entries[: len(entries) - len(tail)]


def path_is_safe(extra: list[str], modules: dict[str, list[str]]) -> bool:
    """Whether a child of the server, with ``extra`` put before its ``sys.path`` (after
    ``sys.path[0]``, as a fresh interpreter puts ``PYTHONPATH``), is what a fresh process would
    be: each entry an absolute folder, none holding a start-up hook (``sitecustomize``,
    ``usercustomize``: a fresh process runs it at start, the server did not) nor another file
    for a module the server has imported (``modules``: top-level name -> its files, its
    ``__init__.py`` or a namespace package's folders), which a fresh process would import from
    there instead. A name the server has not imported is found through the entries as afresh."""
    for entry in extra:
        folder = Path(entry)
        if not folder.is_absolute() or not folder.is_dir():
            return False
        for item in folder.iterdir():
            name = item.name.split(".")[0]
            if name in ("sitecustomize", "usercustomize"):
                return False
            if name not in modules:
                continue
            found = item / "__init__.py" if item.is_dir() else item
            if not found.exists() or str(found.resolve()) not in modules[name]:
                return False  # shadows what the server imported (a namespace folder too)
    return True


def _imported() -> dict[str, list[str]]:
    """The server's top-level modules: name -> the files (or a namespace package's folders)
    a fresh process would have to find first for it; builtins have none."""
    found: dict[str, list[str]] = {}
    for name, module in list(sys.modules.items()):
        if "." in name or module is None:
            continue
        file = getattr(module, "__file__", None)
        files = [file] if file else list(getattr(module, "__path__", []) or [])
        found[name] = [str(Path(f).resolve()) for f in files]
    return found


def _start(env: dict[str, str], tune: Path) -> None:
    folder = Path(tempfile.mkdtemp(prefix="exactga_zygote_"))
    client = folder / "tune"
    client.write_text(
        f"#!{sys.executable} -S\n"
        + CLIENT
        % {"socket": SOCKET, "tune": str(tune), "forwarded": [int(s) for s in FORWARDED_SIGNALS]}
    )
    client.chmod(0o755)
    socket_path = folder / "socket"
    with open(folder / "server.log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, __file__, str(socket_path), str(os.getpid())],
            env={**env, **SERVER_ONLY},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    _server.update(process=process, env=dict(env), client=client, socket=socket_path)
    atexit.register(_stop, process, folder)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        while True:  # ready once it listens (the imports take a few seconds)
            try:
                probe.connect(str(socket_path))
                probe.sendall(b'{"mode": "ping"}\n')
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if process.poll() is not None:
                    log = (folder / "server.log").read_text()[-2000:]
                    if process.returncode == UNSAFE_TO_FORK:  # every launch real: slower, true
                        print(f"tests/zygote.py: {log.strip()}; launching afresh", file=sys.stderr)
                        return
                    message = f"the tests' launch server ended at start-up:\n{log}"
                    raise RuntimeError(message) from None
                threading.Event().wait(0.05)
        # The answer: the modules it imported (what an extra PYTHONPATH entry may not shadow).
        _server["modules"] = json.loads(probe.makefile("rb").readline())


def _stop(process: subprocess.Popen, folder: Path) -> None:
    process.terminate()
    process.wait()
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()


# --- the server ---------------------------------------------------------------------------------


def _preload() -> None:
    """What a launch imports before its first step, imported once here."""
    import pkgutil

    import datasets  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch
    import torch.distributed.run  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401
    import torchao  # noqa: F401
    import torchtune._cli.tune  # noqa: F401
    from torchtune import config, models, modules, training  # noqa: F401
    from torchtune import datasets as tt_datasets  # noqa: F401

    import exactga

    def skip(name: str) -> None:  # a module that needs what this machine lacks (a GPU kernel)
        pass

    for module in pkgutil.walk_packages(exactga.__path__, "exactga.", onerror=skip):
        try:
            __import__(module.name)
        except Exception:  # noqa: BLE001, S112 - the launch that needs it says why
            continue
    del torch


def serve(socket_path: str, parent: int) -> None:
    # The imports' warnings go to the server's log (filters that modules install as they are
    # imported must stay, so none are silenced here); no launch shows them.
    _preload()
    threads = [Path(task, "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    if len(threads) != 1:
        print(f"the launch server has threads {threads} after its imports", file=sys.stderr)
        sys.exit(UNSAFE_TO_FORK)
    # The imports' 400,000 objects the collector tracks are never garbage: frozen, a launch's
    # full collections (gc.collect calls and the automatic ones) skip them, 0.27 s of CPU each.
    gc.freeze()
    Server(socket_path).run(parent)


class Server:
    """One thread, one loop: a connection asks for a child (``tune`` or a rank), or for every
    process of a launch to be killed; a child's pidfd says it ended."""

    def __init__(self, socket_path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(socket_path)
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.children: dict[int, tuple[socket.socket, int]] = {}  # pid -> (its launcher's
        # connection, the launcher's pid: the stand-in's, or the agent's for a rank)
        # Who waits for which children to end, and the other processes killed with them.
        self.kills: list[tuple[socket.socket, set[int], list[int]]] = []

    def run(self, parent: int) -> None:
        while os.getppid() == parent:  # the test worker is gone: so is the server
            for key, _ in self.selector.select(timeout=1.0):
                if key.fileobj is self.listener:
                    conn, _ = self.listener.accept()
                    self._serve(conn)
                else:  # a child's pidfd: it ended
                    self._reap(key.data, key.fileobj)

    def _serve(self, conn: socket.socket) -> None:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 8)
        while not message.endswith(b"\n"):  # a long environment comes in several reads
            more = conn.recv(1 << 20)
            if not more:
                break
            message += more
        request = json.loads(message)
        if request["mode"] == "ping":
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(_imported()).encode() + b"\n")
            conn.close()
        elif request["mode"] == "kill":
            self._kill(conn, request["launcher"])
        else:
            self._fork(conn, request, fds)

    def _fork(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        launcher = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        pid = os.fork()
        if pid == 0:  # the child: none of the server's other files
            for key in list(self.selector.get_map().values()):
                if key.fileobj is not self.listener:  # another launch's pidfd
                    os.close(key.fileobj)
            for other in [c for c, _ in self.children.values()] + [k[0] for k in self.kills]:
                other.close()
            self.listener.close()
            _child(conn, request, fds)  # never returns
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        self.children[pid] = (conn, launcher[0])
        self.selector.register(os.pidfd_open(pid), selectors.EVENT_READ, pid)

    def _kill(self, conn: socket.socket, launcher: int) -> None:
        """SIGKILL every child of the stand-in ``launcher`` (its ``tune``, and that one's ranks);
        answer once all have ended."""
        doomed: set[int] = set()
        found = {launcher}
        while found:
            doomed |= found
            found = {pid for pid, (_, peer) in self.children.items() if peer in found} - doomed
        doomed.discard(launcher)
        # Any process a child started itself (not through here) dies with it: the caller
        # waits for those, named in the answer.
        started = {pid for child in doomed for pid in descendants(child)}
        for pid in [*doomed, *started]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.kills.append((conn, doomed, sorted(started)))
        self._answer_kills()

    def _reap(self, pid: int, pidfd: int) -> None:
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        conn, _ = self.children.pop(pid)
        with contextlib.suppress(OSError):  # its launcher may be gone
            conn.sendall(f"{status}\n".encode())
        conn.close()
        for _, waiting, _ in self.kills:
            waiting.discard(pid)
        self._answer_kills()

    def _answer_kills(self) -> None:
        for conn, _, started in [kill for kill in self.kills if not kill[1]]:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(started).encode() + b"\n")
            conn.close()
        self.kills = [kill for kill in self.kills if kill[1]]


def kill_launch(launcher: int, timeout_s: float = 60.0) -> None:
    """SIGKILL every process of the stand-in ``launcher``'s launch (what the server forked
    for it, and what those started) and wait until all have ended."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(_server["socket"]))
        sock.sendall(json.dumps({"mode": "kill", "launcher": launcher}).encode() + b"\n")
        started = json.loads(sock.makefile("rb").readline())
    deadline = time.monotonic() + timeout_s
    while any(is_running(pid) for pid in started):
        assert time.monotonic() < deadline, f"processes {started} outlived SIGKILL"
        time.sleep(0.02)


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs (Linux: read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):  # a process that ended meanwhile
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        started = children.get(todo.pop(), [])
        found += started
        todo += started
    return found


def is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def is_stand_in(args: list[str]) -> bool:
    """Whether a launch's command is the stand-in's."""
    return bool(_server) and str(args[0]) == str(_server["client"])


def _child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    code = 1
    try:
        os.setsid()  # a session of its own, as torchrun's ranks (and a killpg of its pid works)
        for target, fd in zip((0, 1, 2), fds, strict=False):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        # The interpreter's own command line, as a fresh one would have it: ``python <tune>
        # run ...`` (the shebang's), or ``python -u <recipe> ...`` for a rank; a stopped run
        # prints the command that resumes it from this.
        head = [sys.executable] if request["mode"] == "tune" else [sys.executable, "-u"]
        sys.orig_argv = [*head, *sys.argv]
        threading.Thread(target=_die_with_launcher, args=(conn,), daemon=True).start()
        code = _run(request)
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except KeyboardInterrupt:  # as Python ends on an uncaught one: by SIGINT
        import traceback

        traceback.print_exc()
        _finish(1, signal.SIGINT)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish(code)


def _run(request: dict) -> int:
    import runpy

    # PYTHONPATH entries before the server's (tune_command checked them), where a fresh
    # interpreter puts them: after sys.path[0], which is set below.
    extra = extra_path(request["env"].get("PYTHONPATH"), _SERVER_PYTHONPATH) or []
    sys.path[1:1] = extra
    if request["mode"] == "tune":
        sys.path[0] = str(Path(request["argv"][0]).parent)  # as the ``tune`` script's
        _ranks_from_the_server()
        from torchtune._cli.tune import main

        main()
        return 0
    # A rank: ``python -u <script> args`` or ``python -u -m <module> args``, as torchrun
    # starts it; sys.argv[0] and sys.path[0] as Python sets them for each.
    if request["argv"][0] == "-m":
        module = request["argv"][1]
        sys.argv = [module, *request["argv"][2:]]  # runpy puts the module's file first
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    script = request["argv"][0]
    sys.path[0] = str(Path(script).resolve().parent)
    runpy.run_path(script, run_name="__main__")
    return 0


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _finish(code: int, signum: int | None = None) -> None:
    """End as the interpreter ends a process: join non-daemon threads, run ``atexit``, flush;
    then exit with ``code``, or die of ``signum``."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        if signum is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
    finally:
        os._exit(code)


def _die_with_launcher(conn: socket.socket) -> None:
    """The launching stand-in closed its end (it ended, or was killed): so does this child."""
    try:
        while conn.recv(1024):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


# --- torchrun's ranks, forked by the server -----------------------------------------------------


def _ranks_from_the_server() -> None:
    """Make torchrun's agent (this child, under ``--nproc_per_node``) ask the server for each
    rank instead of starting ``python -u <script>``."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    real_popen = subprocess_handler.SubprocessHandler._popen
    socket_path = _SOCKET_PATH  # the server's own: this child is a fork of it

    def popen(self, args: tuple, env: dict[str, str]):
        argv = [str(a) for a in args]
        if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-u":
            return real_popen(self, args, env)
        return RankProcess(socket_path, argv[2:], env, self._stdout, self._stderr)

    subprocess_handler.SubprocessHandler._popen = popen


class RankProcess:
    """The part of ``subprocess.Popen`` torchrun's agent uses, for a rank the server forked."""

    def __init__(self, path: str, argv: list[str], env: dict, stdout, stderr) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        fds = [0, (stdout or sys.stdout).fileno(), (stderr or sys.stderr).fileno()]
        request = {"mode": "script", "argv": argv, "env": env, "cwd": os.getcwd()}
        self._sock.sendmsg(
            [json.dumps(request).encode() + b"\n"],
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))],
        )
        self._lines = self._sock.makefile("rb")
        self.pid = int(self._lines.readline())
        self.args = argv
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            ready = selectors.DefaultSelector()
            ready.register(self._sock, selectors.EVENT_READ)
            if ready.select(timeout=0):
                self._read_status()
            ready.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            ready = selectors.DefaultSelector()
            ready.register(self._sock, selectors.EVENT_READ)
            found = ready.select(timeout=timeout)
            ready.close()
            if not found:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        line = self._lines.readline()
        self.returncode = os.waitstatus_to_exitcode(int(line)) if line else -signal.SIGKILL
        self._sock.close()

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_SOCKET_PATH = ""
_SERVER_PYTHONPATH = os.environ.get("PYTHONPATH")

if __name__ == "__main__":
    _SOCKET_PATH = sys.argv[1]
    sys.modules.setdefault("zygote", sys.modules["__main__"])
    serve(sys.argv[1], int(sys.argv[2]))
