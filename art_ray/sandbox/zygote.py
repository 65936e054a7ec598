"""One sandbox slot's fork-server, run as a script by `namespaces.py` (stdlib only: it is started with the
interpreter alone and nothing of art_ray is imported inside the sandbox).

Process chain, all started once per slot:
- the outer process (host root, started by the pool without `preexec_fn`) forks a helper that stays in the
  host's user namespace, then enters new user, mount, network, IPC, UTS and pid namespaces; the helper
  writes the maps `0 <slot uid> 1` (root inside is the slot's own unprivileged uid outside, never host
  root) and exits;
- the outer process forks the slot's init (pid 1 of the new pid namespace), which builds a new root (a
  read-only tmpfs with read-only binds of the system paths, a fresh /proc, a minimal /dev, tmpfs /workspace
  and /tmp), pivots into it, drops to the slot uid, and serves requests on fds 3 (in) and 4 (out);
- each request forks a child that drops every capability, sets rlimits, no_new_privs and seccomp (when
  libseccomp loads), then runs bash or the Python code (forked from the warm interpreter: no start cost).

Killing: the outer process and the init die with their parent (PR_SET_PDEATHSIG), and the init dies when the
request pipe closes; killing the init kills every process of the pid namespace. A timeout or a reset kills
every process of the slot (`kill(-1)` from pid 1), a reset also remounts the workspace and /tmp.

Frames on the pipes: a 4-byte big-endian length, then UTF-8 JSON.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import json
import os
import resource
import select
import signal
import struct
import sys
import time
import traceback

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
# flags a bind remount inside a user namespace must keep (the kernel locks them): nosuid..relatime
LOCKED_MOUNT_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 28, 38
# SECBIT_NOROOT, NO_SETUID_FIXUP, KEEP_CAPS, NO_CAP_AMBIENT_RAISE and their locks: uid 0 inside gains no
# capability by exec
SECUREBITS_LOCKED_NOROOT = 0x3F | 0xC0
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
# denied to the model's code when libseccomp loads: kernel attack surface a sandboxed program never needs
DENIED_SYSCALLS = [
    "ptrace",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "bpf",
    "keyctl",
    "add_key",
    "request_key",
    "userfaultfd",
    "perf_event_open",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "swapon",
    "swapoff",
    "reboot",
    "open_by_handle_at",
    "process_vm_readv",
    "process_vm_writev",
    "acct",
    "quotactl",
]
DRAIN_AFTER_EXIT_S = 0.05
CHUNK = 65536

libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> int:
    if result == -1:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda value: None if value is None else value.encode()  # noqa: E731
    check(libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


# ---------------------------------------------------------------------------------------------- framing


def read_exactly(fd: int, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = os.read(fd, left)
        if not part:
            raise EOFError
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def read_frame(fd: int) -> dict:
    (size,) = struct.unpack(">I", read_exactly(fd, 4))
    return json.loads(read_exactly(fd, size))


def write_frame(fd: int, message: dict) -> None:
    data = json.dumps(message, ensure_ascii=False).encode()  # output cut to the cap stays near it
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


# --------------------------------------------------------------------------------- the outer process


def outer(config: dict) -> None:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != config["parent_pid"]:  # the pool died before the line above
        os._exit(1)
    from_outer, to_helper = os.pipe()
    helper = os.fork()
    if helper == 0:  # still in the host's user namespace, with the right to map another uid
        os.close(to_helper)
        read_exactly(from_outer, 1)
        uid, outer_pid = config["uid"], os.getppid()
        if os.geteuid() != 0:  # a normal user may map only itself, and must give up setgroups for that
            with open(f"/proc/{outer_pid}/setgroups", "w") as handle:
                handle.write("deny")
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{outer_pid}/{name}", "w") as handle:
                handle.write(f"0 {uid} 1\n")
        os._exit(0)
    os.close(from_outer)
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID
    check(libc.unshare(flags), "unshare")
    os.write(to_helper, b"x")
    _, status = os.waitpid(helper, 0)
    if status != 0:
        os._exit(1)
    init = os.fork()
    if init == 0:
        slot_init(config)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1):  # the init alone holds the request and reply pipes
        os.dup2(null, fd)
    _, status = os.waitpid(init, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


# ----------------------------------------------------------------------------------- building the root


def bind_read_only(source: str, target: str, opened: dict[str, int]) -> None:
    """`opened`: O_PATH fds of the sources, taken while the init was still host root's uid (the paths may
    lie under a folder only root may enter, as /root/.pyenv does)."""
    if source in opened:
        source = f"/proc/self/fd/{opened[source]}"
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(source, target, None, MS_BIND | MS_REC)
    locked = os.statvfs(target).f_flag & LOCKED_MOUNT_FLAGS
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | locked)


def mount_scratch(target: str, size_mb: int, mode: str) -> None:
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode={mode}")


def open_sources(config: dict) -> dict[str, int]:
    sources = [*config["read_only_paths"], *(f"/etc/{name}" for name in ETC_FROM_HOST)]
    return {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path in sources if os.path.exists(path)}


ETC_FROM_HOST = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "localtime",
    "ssl",
    "nsswitch.conf",
)


def build_root(config: dict, opened: dict[str, int]) -> None:
    """As the slot's uid (files made on the new tmpfs must belong to a uid mapped inside)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = "/mnt" if os.path.isdir("/mnt") else "/tmp"
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # usr-merged systems: symlinks
        if os.path.islink(f"/{name}"):
            os.symlink(os.readlink(f"/{name}"), f"{root}/{name}")
        elif os.path.isdir(f"/{name}"):
            bind_read_only(f"/{name}", f"{root}/{name}", opened)
    # a read-only path under a scratch mount (a virtual environment in /tmp) would be covered by it: it is
    # bound at a hidden place, and bound again onto its own path after every scratch mount
    config["shadowed"] = []
    for path in config["read_only_paths"]:
        if path not in opened:
            continue
        if any(path.startswith(scratch + "/") for scratch in SCRATCHES):
            hidden = f"/.host/{len(config['shadowed'])}"
            bind_read_only(path, root + hidden, opened)
            config["shadowed"].append((hidden, path))
        else:
            bind_read_only(path, root + path, opened)
    os.makedirs(f"{root}/etc", exist_ok=True)
    etc = {
        "passwd": "root:x:0:0:sandbox:/workspace:/bin/bash\n",
        "group": "root:x:0:\n",
        "hostname": "sandbox\n",
        "hosts": "127.0.0.1 localhost sandbox\n",
    }
    for name, text in etc.items():
        with open(f"{root}/etc/{name}", "w") as handle:
            handle.write(text)
    for name in ETC_FROM_HOST:
        if f"/etc/{name}" in opened:
            bind_read_only(f"/etc/{name}", f"{root}/etc/{name}", opened)
    names = root + config["interpreter_names"]
    os.makedirs(names)
    for name in ("python", "python3"):
        os.symlink(config["interpreter"], f"{names}/{name}")
    os.makedirs(f"{root}/dev", exist_ok=True)
    mount("tmpfs", f"{root}/dev", "tmpfs", MS_NOSUID, "size=64k,mode=755")
    for name in ("null", "zero", "full", "random", "urandom"):
        open(f"{root}/dev/{name}", "a").close()
        mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
    ):
        os.symlink(target, f"{root}/dev/{name}")
    os.symlink("/proc/self/fd/2", f"{root}/dev/stderr")
    os.makedirs(f"{root}/dev/shm")
    for name in ("proc", "workspace", "tmp"):
        os.makedirs(f"{root}/{name}", exist_ok=True)
    mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    check(libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    mount(None, "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID)
    mount_scratches(config)


SCRATCHES = {"/workspace": "755", "/tmp": "1777", "/dev/shm": "1777"}


def mount_scratches(config: dict) -> None:
    for path, mode in SCRATCHES.items():
        mount_scratch(path, config["limits"]["workspace_mb"], mode)
    for hidden, path in config["shadowed"]:
        bind_read_only(hidden, path, {})


def unmount_scratches() -> None:
    for path in SCRATCHES:
        check(libc.umount2(path.encode(), MNT_DETACH), f"umount {path}")


# ---------------------------------------------------------------------------------- the model's side


class Seccomp:
    """A deny list compiled once in the init and loaded in every child (libseccomp via ctypes)."""

    def __init__(self) -> None:
        self.context = None
        try:
            library = ctypes.CDLL("libseccomp.so.2")
        except OSError:
            return
        library.seccomp_init.restype = ctypes.c_void_p
        library.seccomp_load.argtypes = [ctypes.c_void_p]
        library.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
        context = library.seccomp_init(0x7FFF0000)  # SCMP_ACT_ALLOW
        for name in DENIED_SYSCALLS:
            number = library.seccomp_syscall_resolve_name(name.encode())
            if number >= 0 and library.seccomp_rule_add(context, 0x00050000 | errno.EPERM, number, 0) != 0:
                return
        self.library, self.context = library, context

    def load(self) -> None:
        if self.context is not None and self.library.seccomp_load(self.context) != 0:
            raise OSError("seccomp_load failed")


def drop_privileges(limits: dict, seccomp: Seccomp) -> None:
    """In a child, before the model's code: no capability (not even after exec as uid 0 inside), rlimits,
    no_new_privs, seccomp."""
    for capability in range(64):
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) == -1:
            break  # past the kernel's last capability
    check(libc.prctl(PR_SET_SECUREBITS, SECUREBITS_LOCKED_NOROOT, 0, 0, 0), "securebits")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    empty = (ctypes.c_uint32 * 6)()
    check(libc.syscall(SYS_CAPSET[os.uname().machine], header, empty), "capset")
    mb = 1024 * 1024
    for limit, value in (
        (resource.RLIMIT_CPU, limits["cpu_s"]),
        (resource.RLIMIT_DATA, limits["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mb),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
        (resource.RLIMIT_CORE, 0),
        # per uid, counted over the whole slot; the init and the request's child are two of them
        (resource.RLIMIT_NPROC, limits["processes"] + 2),
    ):
        resource.setrlimit(limit, (value, value))
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    seccomp.load()


ENVIRONMENT = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/workspace",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
}


def run_child(request: dict, fds: tuple[int, int, int], config: dict, seccomp: Seccomp) -> None:
    """The forked child of one exec: never returns."""
    code = 126
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)
        for number in (signal.SIGINT, signal.SIGPIPE, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(number, signal.SIG_DFL)
        os.chdir("/workspace")
        environment = dict(ENVIRONMENT, PATH=config["path"])
        drop_privileges(config["limits"], seccomp)
        if "argv" in request:
            os.execve(request["argv"][0], request["argv"], environment)
        os.environ.clear()
        os.environ.update(environment)
        sys.argv = ["main.py"]
        sys.path.insert(0, "/workspace")  # as `python main.py` there: the workspace's modules import
        code = 0
        try:
            exec(compile(request["python"], "main.py", "exec"), {"__name__": "__main__"})
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if not isinstance(exit_.code, int | None):
                print(exit_.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        try:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)
    os._exit(code)


class Capture:
    """One output stream kept up to `cap` bytes while it is read; the rest is read and counted, not kept."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd, self.cap, self.kept, self.total = fd, cap, bytearray(), 0

    def read(self) -> bool | None:
        """True: read some; False: the end (every writer closed it); None: nothing to read now."""
        try:
            data = os.read(self.fd, CHUNK)
        except BlockingIOError:
            return None
        if data:
            self.total += len(data)
            room = self.cap - len(self.kept)
            if room > 0:
                self.kept += data[:room]
        return bool(data)

    def text(self) -> str:
        return self.kept.decode(errors="replace")


def kill_everything_but_me() -> None:
    """From pid 1: SIGKILL every other process of the pid namespace and reap them all."""
    with contextlib.suppress(ProcessLookupError):  # none left
        os.kill(-1, signal.SIGKILL)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def reap_zombies() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def execute(request: dict, config: dict, seccomp: Seccomp, control: int) -> dict:
    started = time.monotonic()
    cap = config["limits"]["output_bytes"]
    stdin_read, stdin_write = os.pipe()
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        run_child(request, (stdin_read, out_write, err_write), config, seccomp)
    for fd in (stdin_read, out_write, err_write):
        os.close(fd)
    stdin = request.get("stdin") or ""
    with contextlib.suppress(
        BrokenPipeError
    ):  # small inputs only (the pipe's buffer): larger ones go in files
        os.write(stdin_write, stdin.encode()[:CHUNK])
    os.close(stdin_write)
    captures = {fd: Capture(fd, cap) for fd in (out_read, err_read)}
    for fd in captures:
        os.set_blocking(fd, False)
    exited = os.pidfd_open(child)
    deadline = started + request["timeout_s"]
    timed_out, status = False, None
    open_fds = set(captures)
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([*open_fds, exited, control], [], [], left)
        if control in ready:  # the pool closed the pipe: it is gone, and so is this slot
            os._exit(0)
        for fd in ready:
            if fd in open_fds and captures[fd].read() is False:
                open_fds.discard(fd)
        if exited in ready:
            status = os.waitpid(child, 0)[1]
    if timed_out:
        kill_everything_but_me()
        for fd in open_fds:  # what the pipes still hold; every writer is dead, so this ends
            while captures[fd].read():
                pass
    else:  # what the program wrote before it ended; processes it left behind may keep the pipes open
        drain_until = time.monotonic() + DRAIN_AFTER_EXIT_S
        while open_fds and time.monotonic() < drain_until:
            ready, _, _ = select.select(list(open_fds), [], [], max(0.0, drain_until - time.monotonic()))
            for fd in ready:
                if not captures[fd].read() or len(captures[fd].kept) >= cap:
                    open_fds.discard(fd)
        reap_zombies()
    for fd in (*captures, exited):
        os.close(fd)
    exit_code = None if timed_out else os.waitstatus_to_exitcode(status)
    if exit_code in (-signal.SIGXCPU, -signal.SIGKILL) and not timed_out:
        timed_out = True  # the CPU-time limit: out of time too
    out, err = captures[out_read], captures[err_read]
    return {
        "stdout": out.text(),
        "stderr": err.text(),
        "exit_code": exit_code,
        "timed_out": timed_out,
        "truncated": out.total > cap or err.total > cap,
        "duration_s": time.monotonic() - started,
    }


def file_operation(request: dict, config: dict, seccomp: Seccomp) -> dict:
    """Files are read and written by a child with the model's own rights: the init's capabilities never
    touch a path the model chose."""
    result_read, result_write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(result_read)
        try:
            os.chdir("/workspace")
            drop_privileges(config["limits"], seccomp)
            path = request["path"]
            if request["op"] == "write_file":
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                with open(path, "wb") as handle:
                    handle.write(base64.b64decode(request["data"]))
                reply: dict = {}
            elif request["op"] == "read_file":
                with open(path, "rb") as handle:
                    data = handle.read(config["limits"]["file_size_mb"] * 1024 * 1024 + 1)
                if len(data) > config["limits"]["file_size_mb"] * 1024 * 1024:
                    raise OSError(errno.EFBIG, f"{path} is larger than the file size limit")
                reply = {"data": base64.b64encode(data).decode()}
            else:
                reply = {"entries": sorted(os.listdir(path))}
        except Exception as error:  # the model's path: reported, never a crash of the slot
            reply = {"error": f"{type(error).__name__}: {error}"}
        write_frame(result_write, reply)
        os._exit(0)
    os.close(result_write)
    try:
        reply = read_frame(result_read)
    except EOFError:
        reply = {"error": "the file operation ended without a reply"}
    os.close(result_read)
    os.waitpid(child, 0)
    return reply


def leftover_processes() -> int:
    return sum(1 for name in os.listdir("/proc") if name.isdigit() and name != "1")


def slot_init(config: dict) -> None:
    try:
        control_in, control_out = os.dup(0), os.dup(1)
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1):
            os.dup2(null, fd)
        os.close(null)
        opened = open_sources(config)
        if config["drop_groups"]:  # started by root: root's groups go too (a normal user has none to drop)
            os.setgroups([])
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)  # root inside is the slot's uid outside; the capabilities stay inside
        # after the uid change, which clears it: the init (and so the namespace) dies with the outer process
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        build_root(config, opened)
        for fd in opened.values():
            os.close(fd)
        libc.prctl(PR_SET_DUMPABLE, 0)  # the model's processes (same uid) cannot ptrace or read its memory
        for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(number, signal.SIG_IGN)
        seccomp = Seccomp()
        sys.path.extend(config["site_packages"])
    except Exception:
        traceback.print_exc()
        os._exit(1)
    write_frame(control_out, {"ready": True, "seccomp": seccomp.context is not None})
    while True:
        try:
            request = read_frame(control_in)
        except EOFError:
            os._exit(0)
        op = request["op"]
        if op in ("exec", "python"):
            reply = execute(request, config, seccomp, control_in)
        elif op == "reset":
            started = time.monotonic()
            kill_everything_but_me()
            unmount_scratches()
            mount_scratches(config)
            reply = {"leftover": leftover_processes(), "duration_s": time.monotonic() - started}
        elif op == "processes":
            reply = {"count": leftover_processes()}
        else:
            reply = file_operation(request, config, seccomp)
        write_frame(control_out, reply)


if __name__ == "__main__":
    outer(json.loads(sys.argv[1]))
