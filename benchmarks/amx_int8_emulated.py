"""Check the int8 GEMM's AMX path (``PAGEDLLM_INT8_ISA=amx_int8``) on a CPU without AMX.

Copies the ``pagedllm`` package to a temporary folder, replaces the AMX tile intrinsics the int8
path uses (``_tile_zero``, ``_tile_loadd``, ``_tile_stored``, ``_tile_dpbusd``,
``_tile_loadconfig``, ``_tile_release``) in that copy's ``amx_tiles.h`` by C++ emulations written
from the Intel SDM's pseudo-code (TDPBUSD: C[m][n] += sum over 64 k of u8 A[m][k] times s8
B[k / 4][4 n + k % 4]), declares the int8 tiles usable, builds that copy's kernels (a few
minutes, cached by source hash) and runs, in it, the fresh-process reference check of
``tests/model/test_int8.py`` (every int8 loop: values against the reference, each row the same
alone as in a batch) with the AMX tiles forced, at 1 and 2 threads. What it checks: the path's
layouts (A rows, B tiles in place, the zero-padded last tile), zero point and threading; what it
cannot: the instructions themselves, which the real-AMX run of the same test covers.

    .venv/bin/python benchmarks/amx_int8_emulated.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

EMULATION = r"""
#include <cstring>
namespace amx_emu {  // the AMX tiles in C++ (scratch check, benchmarks/amx_int8_emulated.py)
inline thread_local uint8_t T[8][16][64];
inline void zero(int t) { std::memset(T[t], 0, sizeof(T[t])); }
inline void load(int t, const void* base, long stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(T[t][r], (const char*)base + r * stride, 64);
}
inline void store(int t, void* base, long stride) {
  for (int r = 0; r < 16; ++r) std::memcpy((char*)base + r * stride, T[t][r], 64);
}
inline void dpbusd(int c, int a, int b) {
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      int32_t acc;
      std::memcpy(&acc, &T[c][m][4 * n], 4);
      for (int k = 0; k < 64; ++k)
        acc += (int32_t)(uint8_t)T[a][m][k] * (int32_t)(int8_t)T[b][k / 4][4 * n + k % 4];
      std::memcpy(&T[c][m][4 * n], &acc, 4);
    }
}
}  // namespace amx_emu
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbusd
#define _tile_zero(t) amx_emu::zero(t)
#define _tile_loadd(t, b, s) amx_emu::load(t, b, s)
#define _tile_stored(t, b, s) amx_emu::store(t, b, s)
#define _tile_dpbusd(c, a, b) amx_emu::dpbusd(c, a, b)
#define _tile_loadconfig(p) ((void)(p))
#define _tile_release() ((void)0)
"""


def emulated_copy(dst: Path) -> None:
    """``pagedllm`` under ``dst`` with the emulated tiles in its ``amx_tiles.h``."""
    shutil.copytree(
        ROOT / "pagedllm", dst / "pagedllm", ignore=shutil.ignore_patterns("__pycache__")
    )
    header = dst / "pagedllm" / "csrc" / "cpu" / "amx_tiles.h"
    text = header.read_text()
    marker = "#define PAGEDLLM_AMX 1\n"
    usable = "static const bool ok = cpu_has_amx_int8() && request_tile_state();"
    if marker not in text or usable not in text:
        raise SystemExit(f"{header} changed: update this script's patch points")
    text = text.replace(marker, marker + EMULATION, 1)
    header.write_text(text.replace(usable, "static const bool ok = true;  // emulated", 1))


def main() -> None:
    test = (ROOT / "tests" / "model" / "test_int8.py").read_text()
    check = re.search(r'_ISA_PATH_CHECK = """(.*?)"""', test, re.S)
    if check is None:
        raise SystemExit("tests/model/test_int8.py has no _ISA_PATH_CHECK")
    with tempfile.TemporaryDirectory(prefix="pagedllm-amx-emu-") as tmp:
        emulated_copy(Path(tmp))
        # -S: no site, so no .pth file's editable finder can import the installed pagedllm
        # instead of the copy; the copy, then site-packages (torch) by path.
        path = os.pathsep.join([tmp, sysconfig.get_paths()["purelib"]])
        for threads in ("1", "2"):
            env = {
                **os.environ,
                "PYTHONPATH": path,
                "PAGEDLLM_INT8_ISA": "amx_int8",
                "OMP_NUM_THREADS": threads,
            }
            out = subprocess.run(
                [sys.executable, "-S", "-c", check.group(1), "amx_int8"],
                env=env,
                cwd=tmp,
                capture_output=True,
                text=True,
                timeout=3600,
            )
            ok = out.returncode == 0 and out.stdout.strip().endswith("ok")
            print(f"emulated amx_int8, {threads} thread(s): {'ok' if ok else 'FAILED'}")
            if not ok:
                raise SystemExit(out.stderr[-3000:])


if __name__ == "__main__":
    main()
