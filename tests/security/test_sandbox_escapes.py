"""The escape suite: code a policy could write, run in the real sandbox, trying every route out that we know of.

Each route prints ``ESCAPED`` if it got what it wanted; beyond that the host is checked after every route: the
files outside (a directory of the test's, and the Python installation whose interpreter runs the sandbox) are
unchanged, a host
process is alive and untraced, no marker appeared in ``/tmp`` or ``/dev/shm``, and the loopback TCP and unix
servers got no connection. Routes that would defeat an in-process guard first try to disarm one (the old audit
hook's globals, reachable from ``sys.modules['__main__']`` and through ``gc``), so each tests the kernel layers.
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time

import pytest

from mcore_rl.agent import sandbox as sandbox_module
from mcore_rl.agent.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError

SECRET = "TOPSECRET-7f3a"
DISARM = """
import gc, sys
def _disarm(g):
    for k in ('REFUSED', 'CHANGES', 'LOOKS'):
        if k in g: g[k] = ('\\0',)
    if 'inside' in g: g['inside'] = lambda *a: True
_disarm(vars(sys.modules['__main__']))
for f in gc.get_objects():
    if getattr(f, '__name__', None) == 'hook' and hasattr(f, '__globals__'): _disarm(f.__globals__)
"""
LIBC = "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"

# name -> code; format fields: outside, secret, victim, pid (a host process), port (TCP), unix (socket path)
ROUTES = {
    # ---- reading what is not its own
    "read_outside": "print('ESCAPED' + open({secret!r}).read())",
    "read_python_prefix": "import sys; print('ESCAPED' + open(sys.prefix + '/secret.txt').read())",
    "read_proc_environ_of_init": "open('/proc/1/environ', 'rb').read(); print('ESCAPED')",
    "read_proc_self_root": "print('ESCAPED' + open('/proc/self/root' + {secret!r}).read())",
    "read_proc_self_cwd_up": "import os; print('ESCAPED' + open('/proc/self/cwd/' + os.path.relpath({secret!r})).read())",
    "list_root": "import os; os.listdir('/'); print('ESCAPED')",
    "read_dir_fd": (
        "import os, sys; d = os.open(sys.prefix, os.O_RDONLY)\n"
        "print('ESCAPED' + os.read(os.open('secret.txt', os.O_RDONLY, dir_fd=d), 100).decode())"
    ),
    "read_openat2_dir_fd_dotdot": (
        "import os, sys; d = os.open(os.path.dirname(os.__file__), os.O_RDONLY)\n"
        "print('ESCAPED' + os.read(os.open('../' * 12 + {secret!r}.lstrip('/'), os.O_RDONLY, dir_fd=d), 100).decode())"
    ),
    "read_through_symlink": "import os; os.symlink({secret!r}, 'l'); print('ESCAPED' + open('l').read())",
    "read_through_hardlink": "import os; os.link({secret!r}, 'l'); print('ESCAPED' + open('l').read())",
    "read_after_disarm": DISARM + "print('ESCAPED' + open({secret!r}).read())",
    # ---- changing what is not its own
    "write_outside": "open({victim!r}, 'w').write('pwned'); print('ESCAPED')",
    "create_outside": "open({outside!r} + '/new.txt', 'w').write('pwned'); print('ESCAPED')",
    "write_dir_fd_into_python_prefix": (
        "import os, sys; d = os.open(sys.prefix, os.O_RDONLY)\n"
        "fd = os.open('victim.txt', os.O_WRONLY | os.O_APPEND, dir_fd=d); os.write(fd, b'pwned'); print('ESCAPED')"
    ),
    "rename_destination": "import os; open('x', 'w').write('pwned'); os.rename('x', {victim!r}); print('ESCAPED')",
    "replace_destination": "import os; open('x', 'w').write('pwned'); os.replace('x', {victim!r}); print('ESCAPED')",
    "link_destination": "import os; open('x', 'w').write('pwned'); os.link('x', {outside!r} + '/l'); print('ESCAPED')",
    "symlink_destination": "import os; os.symlink('x', {outside!r} + '/s'); print('ESCAPED')",
    "remove_outside": "import os; os.remove({victim!r}); print('ESCAPED')",
    "truncate_outside": "import os; os.truncate({victim!r}, 0); print('ESCAPED')",
    "chmod_outside": DISARM + "import os; os.chmod({victim!r}, 0o777); print('ESCAPED')",
    "utime_outside": DISARM + "import os; os.utime({victim!r}, (0, 0)); print('ESCAPED')",
    "write_after_disarm": DISARM + "open({victim!r}, 'w').write('pwned'); print('ESCAPED')",
    "write_tmp": "open('/tmp/mcore_rl_escape_marker', 'w').write('x'); print('ESCAPED')",
    "write_dev_shm": "open('/dev/shm/mcore_rl_escape_marker', 'w').write('x'); print('ESCAPED')",
    "write_proc_self_mem": "open('/proc/self/mem', 'r+b'); print('ESCAPED')",
    "environment_secrets": "import os; print(dict(os.environ))",  # the run's variables (the fixture set a secret)
    "inherited_descriptors": (
        "import os\nfor fd in range(3, 1024):\n    try: os.fstat(fd)\n    except OSError: continue\n"
        "    print('ESCAPED: descriptor', fd)"
    ),
    # ---- processes
    "kill_parent": DISARM + "import os; os.kill(os.getppid(), 0); print('ESCAPED')",
    "memfd_exec": DISARM
    + (
        "import os; fd = os.memfd_create('x'); os.write(fd, b'#!/bin/sh\\necho ESCAPED\\n')\n"
        "os.execve(fd, ['sh', '-c', 'echo ESCAPED'], {{}})"
    ),
    "subprocess": "import subprocess; subprocess.run(['/bin/sh', '-c', 'echo pwned > {outside}/marker']); print('ESCAPED')",
    "subprocess_audit_bypass": (
        "import subprocess, sys, types\n"
        "fake = types.ModuleType('sys'); fake.__dict__.update(vars(sys)); fake.audit = lambda *a: None\n"
        "subprocess.sys = fake\n"
        "subprocess.run(['/bin/sh', '-c', 'echo pwned > {outside}/marker']); print('ESCAPED')"
    ),
    "os_system": DISARM + "import os; os.system('echo pwned > {outside}/marker') == 0 and print('ESCAPED')",
    "posix_spawn": DISARM
    + "import os; os.posix_spawn('/bin/sh', ['sh', '-c', 'echo pwned > {outside}/marker'], {{}}); print('ESCAPED')",
    "exec": DISARM + "import os; os.execv('/bin/sh', ['sh', '-c', 'echo ESCAPED'])",
    "fork": DISARM + "import os\npid = os.fork()\nif pid == 0: os._exit(0)\nprint('ESCAPED')",
    "fork_bomb": DISARM
    + (
        "import os\nn = 0\nfor _ in range(64):\n    try: pid = os.fork()\n    except OSError: break\n"
        "    if pid == 0: os._exit(0)\n    n += 1\nif n: print('ESCAPED', n)"
    ),
    "ctypes_fork": DISARM + LIBC + "pid = libc.fork()\nif pid == 0: libc._exit(0)\nif pid > 0: print('ESCAPED')",
    "ctypes_clone_process": DISARM
    + LIBC
    + (
        "import platform; nr = {{'x86_64': 56, 'aarch64': 220}}[platform.machine()]\n"
        "pid = libc.syscall(nr, 17, 0, 0, 0, 0)\nif pid == 0: libc._exit(0)\nif pid > 0: print('ESCAPED')"
    ),
    "ctypes_vfork": DISARM + LIBC + "pid = libc.vfork()\nif pid == 0: libc._exit(0)\nif pid > 0: print('ESCAPED')",
    "kill_host_process": DISARM + "import os; os.kill({pid}, 9); print('ESCAPED')",
    "kill_everyone": DISARM + "import os; os.kill(-1, 0); print('ESCAPED')",
    "pidfd_signal": DISARM
    + LIBC
    + ("fd = libc.syscall(434, {pid}, 0)\nif fd >= 0 and libc.syscall(424, fd, 9, None, 0) == 0: print('ESCAPED')"),
    "ptrace_host_process": DISARM
    + LIBC
    + ("if libc.ptrace(16, {pid}, 0, 0) == 0:\n    libc.ptrace(17, {pid}, 0, 0); print('ESCAPED')"),
    "process_vm_readv": DISARM + LIBC + "libc.process_vm_readv({pid}, 0, 0, 0, 0, 0) >= 0 and print('ESCAPED')",
    # ---- the sandbox's own limits and namespaces
    "raise_cpu_limit": DISARM
    + "import resource as r; r.setrlimit(r.RLIMIT_CPU, (r.RLIM_INFINITY,) * 2); print('ESCAPED')",
    "raise_memory_limit": DISARM
    + "import resource as r; r.setrlimit(r.RLIMIT_AS, (r.RLIM_INFINITY,) * 2); print('ESCAPED')",
    "prlimit_raise": DISARM
    + "import resource as r; r.prlimit(0, r.RLIMIT_FSIZE, (r.RLIM_INFINITY,) * 2); print('ESCAPED')",
    "unshare_user_namespace": DISARM + LIBC + "libc.unshare(0x10000000) == 0 and print('ESCAPED')",
    "setns_host_net": DISARM
    + LIBC
    + ("import os; fd = os.open('/proc/{pid}/ns/net', os.O_RDONLY)\nlibc.setns(fd, 0) == 0 and print('ESCAPED')"),
    "mount_tmpfs": DISARM + LIBC + "libc.mount(b'tmpfs', b'.', b'tmpfs', 0, None) == 0 and print('ESCAPED')",
    "chroot": DISARM + LIBC + "libc.chroot(b'/') == 0 and print('ESCAPED')",
    "io_uring": DISARM + LIBC + "libc.syscall(425, 8, ctypes.create_string_buffer(120)) >= 0 and print('ESCAPED')",
    "bpf": DISARM
    + LIBC
    + "libc.syscall({{'x86_64': 321, 'aarch64': 280}}[__import__('platform').machine()], 0, 0, 0) >= 0 and print('ESCAPED')",
    "userfaultfd": DISARM
    + LIBC
    + "libc.syscall({{'x86_64': 323, 'aarch64': 282}}[__import__('platform').machine()], 0) >= 0 and print('ESCAPED')",
    "open_by_handle_at": DISARM
    + LIBC
    + "libc.syscall({{'x86_64': 304, 'aarch64': 265}}[__import__('platform').machine()], 3, ctypes.create_string_buffer(64), 0) >= 0 and print('ESCAPED')",
    # ---- network
    "tcp_loopback": DISARM
    + "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('ESCAPED')",
    "raw_socket_module": DISARM
    + "import _socket; s = _socket.socket(); s.connect(('127.0.0.1', {port})); print('ESCAPED')",
    "unix_socket_path": DISARM
    + "import socket; s = socket.socket(socket.AF_UNIX); s.connect({unix!r}); print('ESCAPED')",
    "udp_send": DISARM
    + "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port})); print('ESCAPED')",
    "netlink": DISARM + "import socket; socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0); print('ESCAPED')",
}


def _snapshot(*roots) -> dict:
    state = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):  # links are not followed: the stdlib is not walked
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                regular = os.path.isfile(path) and not os.path.islink(path)
                digest = hashlib.sha256(open(path, "rb").read()).hexdigest() if regular else ""
                state[path] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return state


def _python_installation(root) -> str:
    """An interpreter of the test's own whose prefix (``sys.prefix`` under ``-S``, which the old audit hook let the
    code read) is a directory the test can watch: a copy of the binary beside links to the standard library and
    libpython."""
    (root / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    python = root / "bin" / "python3"
    shutil.copy2(os.path.realpath(sys.executable), python)
    os.symlink(os.path.dirname(os.__file__), root / "lib" / os.path.basename(os.path.dirname(os.__file__)))
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    for name in os.listdir(libdir) if os.path.isdir(libdir) else []:
        if name.startswith("libpython"):
            os.symlink(os.path.join(libdir, name), root / "lib" / name)
    (root / "secret.txt").write_text(SECRET)
    (root / "victim.txt").write_text("intact")
    prefix = subprocess.run([python, "-I", "-S", "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True)
    assert prefix.stdout.strip() == str(root), prefix
    return str(python)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The host the code must not touch: a directory with a secret and a victim file, the Python installation that
    runs the sandbox (the same), a host process, and loopback TCP and unix servers."""
    root = tmp_path_factory.mktemp("host")
    outside, pyroot = root / "outside", root / "python"
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET)
    (outside / "victim.txt").write_text("intact")
    python = _python_installation(pyroot)
    os.environ["MCORE_RL_ESCAPE_SECRET"] = SECRET  # the run's environment must not reach the code
    victim = subprocess.Popen(["sleep", "3600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tcp = socket.create_server(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", tcp.getsockname()[1]))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(outside / "sock"))
    unix.listen()
    for server in (tcp, udp, unix):
        server.setblocking(False)
    fields = {
        "outside": str(outside), "secret": str(outside / "secret.txt"), "victim": str(outside / "victim.txt"),
        "pid": victim.pid, "port": tcp.getsockname()[1], "unix": str(outside / "sock"),
    }  # fmt: skip
    watched = (str(outside), str(pyroot))
    yield {"fields": fields, "python": python, "servers": (tcp, udp, unix), "victim": victim, "watched": watched,
           "baseline": _snapshot(*watched)}  # fmt: skip
    victim.kill()
    del os.environ["MCORE_RL_ESCAPE_SECRET"]
    for server in (tcp, udp, unix):
        server.close()


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox.start(SandboxConfig(timeout_s=20, memory_mb=256))


def assert_host_intact(world, output: str) -> None:
    fields = world["fields"]
    assert "ESCAPED" not in output and SECRET not in output, output
    assert _snapshot(*world["watched"]) == world["baseline"]
    assert world["victim"].poll() is None, "the host process was killed"
    with open(f"/proc/{fields['pid']}/status") as f:
        assert next(line for line in f if line.startswith("TracerPid:")).split()[1] == "0", "the host process is traced"
    for marker in ("/tmp/mcore_rl_escape_marker", "/dev/shm/mcore_rl_escape_marker"):
        assert not os.path.exists(marker), marker
    tcp, udp, unix = world["servers"]
    for server in (tcp, unix):
        with pytest.raises(BlockingIOError):
            server.accept()
    with pytest.raises(BlockingIOError):
        udp.recv(1)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_route_is_closed(route, world, sandbox, monkeypatch):
    monkeypatch.setattr(sys, "executable", world["python"])
    output = sandbox.run(ROUTES[route].format(**world["fields"]))
    assert isinstance(output, str)
    assert_host_intact(world, output)


def test_the_code_still_runs(sandbox):
    """The boundary does not cost the policy the standard library, threads, files of its own or its errors."""
    code = (
        "import threading, json, math, fractions, decimal, statistics, random, re, collections, itertools, datetime\n"
        "open('data.txt', 'w').write('41'); out = []\n"
        "t = threading.Thread(target=lambda: out.append(int(open('data.txt').read()) + 1)); t.start(); t.join()\n"
        "import os; os.mkdir('d'); os.rename('data.txt', 'd/x'); print(out[0], os.listdir('d'), math.comb(5, 2))"
    )
    assert sandbox.run(code) == "42 ['x'] 10\n"
    assert sandbox.run("1/0").rstrip().endswith("ZeroDivisionError: division by zero")
    assert sandbox.run("import os, signal; os.kill(os.getpid(), signal.SIGTERM)").endswith(
        "killed by signal 15 (time or memory limit)"
    )


def test_huge_and_undecodable_output_costs_the_host_nothing(sandbox):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, a high-water mark
    flood = "import sys\nchunk = b'x' * (1 << 20)\nwhile True: sys.stdout.buffer.write(chunk)"
    output = sandbox.run(flood)
    assert output.startswith("[...]") and output.endswith("error: the output reached the 16 MB limit")
    assert len(output) < 2100
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 64 << 10
    assert sandbox.run("import sys; sys.stdout.buffer.write(b'\\xff\\xfe\\x80 ok')") == "\ufffd\ufffd\ufffd ok"
    assert sandbox.run("print('\\ud800')").endswith(
        "UnicodeEncodeError: 'utf-8' codec can't encode character '\\ud800' in position 0: surrogates not allowed\n"
    )


def test_resource_bombs_stay_in_the_sandbox(sandbox):
    assert "MemoryError" in sandbox.run("x = bytearray(8 << 30)")
    assert "No space left on device" in sandbox.run(
        "i = 0\nwhile True:\n    open(f'f{i}', 'w').write('x' * 4096); i += 1"
    )
    threads = sandbox.run(
        "import threading, time\nn = 0\ntry:\n    while n < 100000:\n"
        "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); n += 1\n"
        "except Exception as e: print(type(e).__name__)"
    )
    assert "RuntimeError" in threads or "MemoryError" in threads
    start = time.monotonic()
    assert Sandbox(SandboxConfig(timeout_s=1), sandbox.required).run("while True: pass") == "error: timed out after 1 s"
    assert time.monotonic() - start < 60


def _children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:  # the field after the state: its parent
                    found.append(int(entry))
        except (FileNotFoundError, ProcessLookupError):  # gone meanwhile
            pass
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, waiting for init to reap it
    except FileNotFoundError:
        return False


def test_a_killed_parent_leaves_no_process_and_no_directory():
    """A tool actor killed at its timeout: its sandbox child dies with it, and the next start removes its work
    directory."""
    parent = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys; from mcore_rl.agent.sandbox import Sandbox, SandboxConfig\n"
            "s = Sandbox.start(SandboxConfig(timeout_s=600))\n"
            "s.run('import time; time.sleep(600)')"
        )],
    )  # fmt: skip
    deadline = time.monotonic() + 120
    child = None
    while child is None and time.monotonic() < deadline:
        commands = {pid: _cmdline(pid) for pid in _children(parent.pid)}
        running = [pid for pid, c in commands.items() if "jail.main()" in c and "--probe" not in c]  # not the probe
        child = running[0] if running else None
        time.sleep(0.2)
    assert child is not None, "the sandbox child never started"
    workdir = commands[child].split("\0")[5]
    assert os.path.isdir(workdir)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(child), "the sandbox child outlived its parent"
    # The killed parent left it behind; this start removes it (or another test's start already did, in parallel).
    Sandbox.start(SandboxConfig())
    assert not os.path.exists(workdir)


def test_a_run_without_a_required_layer_is_refused(sandbox):
    """The child refuses to run the code when a layer the start-up probe found cannot be applied."""
    output = Sandbox(sandbox.config, (*sandbox.required, "no-such-layer")).run("print('ran')")
    assert output.startswith("error: the sandbox could not start") and "ran" not in output


def test_start_refuses_without_kernel_isolation(monkeypatch, caplog):
    monkeypatch.setattr(
        sandbox_module, "probe", lambda config: sandbox_module.Isolation({"namespaces": "x"}, {"landlock": "ENOSYS"})
    )
    with pytest.raises(SandboxUnavailableError, match="Landlock and seccomp.*unsafe_without_kernel_isolation"):
        Sandbox.start(SandboxConfig())
    unsafe = Sandbox.start(SandboxConfig(unsafe_without_kernel_isolation=True))
    assert unsafe.required == ("namespaces",) and "WITHOUT kernel isolation" in caplog.text


def test_the_same_boundary_as_an_unprivileged_user(tmp_path):
    """Not root: the namespaces come in a user namespace of their own; the same routes stay closed."""
    (tmp_path / "secret.txt").write_text(SECRET)
    code = (
        "from mcore_rl.agent.sandbox import Sandbox, SandboxConfig\n"
        "import os; assert os.getuid() == 1000\n"
        "s = Sandbox.start(SandboxConfig())\n"
        "print(s.required)\n"
        f"print(s.run({ROUTES['read_outside'].format(secret=str(tmp_path / 'secret.txt'))!r}))\n"
        f"print(s.run({ROUTES['fork'].format()!r}))\n"
        f"print(s.run({ROUTES['tcp_loopback'].format(port=1)!r}))\n"
        "print(s.run('print(sum(range(10)))'))"
    )
    done = subprocess.run(
        ["unshare", "--map-user=1000", "--map-group=1000", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "('namespaces', 'capabilities', 'landlock', 'seccomp')" in done.stdout
    assert "ESCAPED" not in done.stdout and SECRET not in done.stdout and done.stdout.endswith("45\n\n")


def _decide(program, nr: int, arch: int, args=()) -> int:
    """What the BPF ``program`` returns for a call (a small interpreter of the instructions the filter uses)."""
    import struct

    args = [a & ((1 << 64) - 1) for a in args] + [0] * (6 - len(args))  # as the kernel passes them: unsigned
    data = struct.pack("iIQ6Q", nr, arch, 0, *args)  # struct seccomp_data
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("I", data, k)[0]
        elif code == 0x06:  # ret k
            return k
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        pc += 1


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_seccomp_filter_decides_as_designed_on_each_architecture(machine):
    """The filter the child installs, run here instruction by instruction, on both architectures' numbers (the
    escape routes above exercise x86_64's in the kernel)."""
    from mcore_rl.agent import jail

    column, arch = jail._ARCH[machine]
    nr = {name: n[column] for name, n in jail._NR.items() if n[column] is not None}
    program, pid = jail.seccomp_filter(machine, 4242), 4242
    allow, eperm, enosys, kill = 0x7FFF0000, 0x50001, 0x50026, 0x80000000
    read = {"x86_64": 0, "aarch64": 63}[machine]
    assert _decide(program, read, arch) == allow
    for name in ("execve", "socket", "ptrace", "unshare", "mount", "setrlimit", "io_uring_setup", "bpf", "fchmodat"):
        assert _decide(program, nr[name], arch) == eperm, name
    assert _decide(program, nr["clone3"], arch) == enosys
    thread = 0x3D0F00  # glibc's pthread_create flags: VM FS FILES SIGHAND THREAD SYSVSEM SETTLS PARENT/CHILD_*TID
    assert _decide(program, nr["clone"], arch, (thread,)) == allow
    assert _decide(program, nr["clone"], arch, (17,)) == eperm  # fork: SIGCHLD alone
    assert _decide(program, nr["clone"], arch, (thread | 0x40000000,)) == eperm  # a thread in a new namespace
    for name in ("kill", "tgkill"):
        assert _decide(program, nr[name], arch, (pid,)) == allow
        assert _decide(program, nr[name], arch, (1,)) == eperm
        assert _decide(program, nr[name], arch, (-1,)) == eperm
    assert _decide(program, nr["prlimit64"], arch, (0, 0, 0, 0x7FFC0000)) == allow  # reading a limit
    assert _decide(program, nr["prlimit64"], arch, (0, 0, 0x7FFC0000, 0)) == eperm  # setting one
    assert _decide(program, nr["prlimit64"], arch, (0, 0, 1 << 40, 0)) == eperm  # a pointer above 4 GiB
    assert _decide(program, read, 0x40000003) == kill  # i386 calls
    if machine == "x86_64":
        assert _decide(program, 0x40000000 + 59, arch) == kill  # the x32 ABI
