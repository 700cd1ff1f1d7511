"""Install a seccomp filter that makes io_uring_setup fail with EPERM (x86_64 and aarch64),
as a container runtime's default profile does. Used by test_hardening.py in a subprocess."""

import ctypes
import errno
import platform
import struct

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
NR_IO_URING_SETUP = 425  # the same number on x86_64 and aarch64 (new syscalls are unified)
BPF_LD_W_ABS = 0x20
BPF_JEQ_K = 0x15
BPF_RET_K = 0x06


def refuse_io_uring() -> None:
    assert platform.machine() in ("x86_64", "aarch64"), platform.machine()

    def insn(code, jt, jf, k):
        return struct.pack("HBBI", code, jt, jf, k)

    prog = b"".join([
        insn(BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        insn(BPF_JEQ_K, 0, 1, NR_IO_URING_SETUP),
        insn(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM),
        insn(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ])
    buf = ctypes.create_string_buffer(prog)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
