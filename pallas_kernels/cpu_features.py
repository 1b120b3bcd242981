"""What the native CPU kernels (`pallas_kernels.cpu_gemv`) can run on this CPU, and their environment switches,
without importing jax (the engine's config checks them at start-up, before jax loads).

- `JAXINFER_NATIVE_KERNELS=0` (or off / false / no): the kernels are off; unset, 1, on, true or yes: on; any other
  value is refused (`check_environment`).
- `JAXINFER_NATIVE_ISA`: an ISA level of `ISA_LEVELS` this CPU runs (default: its highest).
- `JAXINFER_NATIVE_THREADS`: a positive integer, the threads per kernel call (default: the CPUs this process may use).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

# The ISA levels the source builds for, lowest first: compiler flags and the /proc/cpuinfo flags each needs.
ISA_LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx2": (("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
    # 32 vector registers (EVEX) and the integer dot products vpdpbusd / vpdpwssd on 256-bit vectors
    "avx512_vnni": (("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                     "-mavx512vnni"),
                    ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")),
    # the above + Intel AMX tiles (bf16 and int8 tile dot products: Sapphire Rapids and later); Linux must also
    # grant the process the tile state (`amx_permitted`)
    "amx": (("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
             "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
            ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "amx_tile",
             "amx_bf16", "amx_int8")),
}
_OFF = ("0", "off", "false", "no")
_ON = ("", "1", "on", "true", "yes")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def amx_permitted() -> bool:
    """Whether Linux grants this process the AMX tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`, kernel
    5.16 and later; asked once, and the grant holds for the whole process). False off Linux or x86-64."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        return False


def supported_levels() -> list[str]:
    """The ISA levels this CPU can run, lowest first (`amx` only where Linux grants the tiles: `amx_permitted`)."""
    flags = cpu_flags()
    return [level for level, (_, needs) in ISA_LEVELS.items()
            if set(needs) <= flags and (level != "amx" or amx_permitted())]


def check_environment() -> None:
    """Validates the kernels' environment variables, all three whether or not the kernels are on.

    Raises:
      ValueError: naming the variable: a `JAXINFER_NATIVE_KERNELS` that is not a switch (0 / off / false / no,
        1 / on / true / yes), an unknown or unsupported ISA level, or a thread count that is not a positive
        integer.
    """
    switch = os.environ.get("JAXINFER_NATIVE_KERNELS", "").strip().lower()
    if switch not in _OFF + _ON:
        raise ValueError(f"JAXINFER_NATIVE_KERNELS={switch!r} is not a switch: 0 / off / false / no turn the "
                         "native CPU kernels off, 1 / on / true / yes (or unset) leave them on")
    threads = os.environ.get("JAXINFER_NATIVE_THREADS", "").strip()
    if threads and (not threads.isdigit() or int(threads) < 1):
        raise ValueError(f"JAXINFER_NATIVE_THREADS={threads!r} must be a positive integer")
    _forced_level()


def isa_level() -> str | None:
    """The ISA level the kernels run at: `JAXINFER_NATIVE_ISA`, else the highest this CPU supports; None when
    `JAXINFER_NATIVE_KERNELS` turns them off or the CPU has no supported level.

    Raises:
      ValueError: `JAXINFER_NATIVE_ISA` names an unknown level or one this CPU cannot run.
    """
    if os.environ.get("JAXINFER_NATIVE_KERNELS", "1").strip().lower() in _OFF:
        return None
    levels = supported_levels()
    return _forced_level() or (levels[-1] if levels else None)


def _forced_level() -> str | None:
    """`JAXINFER_NATIVE_ISA` (trimmed, lower case), None when unset or empty.

    Raises:
      ValueError: an unknown level, or one this CPU cannot run.
    """
    forced = os.environ.get("JAXINFER_NATIVE_ISA", "").strip().lower()
    if not forced:
        return None
    if forced not in ISA_LEVELS:
        raise ValueError(f"JAXINFER_NATIVE_ISA={forced!r} is not a level; known: {', '.join(ISA_LEVELS)}")
    levels = supported_levels()
    if forced not in levels:
        raise ValueError(f"JAXINFER_NATIVE_ISA={forced!r}: this CPU cannot run it (it runs: "
                         f"{', '.join(levels) or 'none'})")
    return forced
