"""Build of flashmla_backend: compiles csrc/ with nvcc into flashmla_backend/_C (pybind11, no libtorch).

Needs nvcc (CUDA 12.8 or newer) but no GPU. Environment variables:
  CUDA_HOME / CUDA_PATH            CUDA toolkit root (default: the nvcc on PATH, then /usr/local/cuda)
  FLASHMLA_BACKEND_CUTLASS_INCLUDE folder holding cute/ and cutlass/ (default: the nvidia-cutlass wheel's
                                   cutlass_library/source/include)
  FLASHMLA_BACKEND_CUDA_ARCHS      ';'-separated targets, default "80;90a". "80" builds the portable kernel
                                   for Ampere (sm_80 machine code plus compute_80 PTX for newer GPUs);
                                   "90a" builds it and the wgmma/TMA kernel for Hopper.
  FLASHMLA_BACKEND_SM90_KERNEL=0   leave out the Hopper wgmma/TMA kernel (faster build; Hopper then runs the
                                   portable kernel)
  MAX_JOBS                         parallel nvcc processes (default: number of CPUs)
The Hopper kernel's files are compiled with ptxas warnings as errors and spill warnings on: a register spill
there fails the build (SM90_PTXAS_FLAGS below).
  FLASHMLA_BACKEND_NVCC_FLAGS      extra nvcc flags
Each compile prints one progress line; unchanged objects are reused (the build folder keeps them).
"""
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
MIN_CUDA = (12, 8)
SUPPORTED_ARCHS = ("80", "90a")


def log(msg):
    print(f"[flashmla_backend build] {msg}", file=sys.stderr, flush=True)


class BuildError(RuntimeError):
    pass


def find_nvcc():
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    for home in homes:
        if home:
            nvcc = Path(home) / "bin" / "nvcc"
            if nvcc.exists():
                return str(nvcc)
            raise BuildError(f"CUDA_HOME/CUDA_PATH is {home!r} but {nvcc} does not exist: flashmla_backend needs "
                             f"nvcc from the CUDA toolkit {MIN_CUDA[0]}.{MIN_CUDA[1]}+ to compile its kernels "
                             "(set CUDA_HOME to the folder holding bin/nvcc)")
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    default = Path("/usr/local/cuda/bin/nvcc")
    if default.exists():
        return str(default)
    raise BuildError(
        "nvcc (the CUDA compiler) was not found: flashmla_backend compiles CUDA kernels at install time and "
        f"needs the CUDA toolkit {MIN_CUDA[0]}.{MIN_CUDA[1]} or newer (no GPU is needed to build). Install the "
        "toolkit and put nvcc on PATH, or set CUDA_HOME to the toolkit root (the folder holding bin/nvcc)."
    )


def nvcc_version(nvcc):
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise BuildError(f"cannot read the CUDA version from `{nvcc} --version`:\n{out}")
    return int(m.group(1)), int(m.group(2))


def find_cutlass_include():
    env = os.environ.get("FLASHMLA_BACKEND_CUTLASS_INCLUDE")
    if env:
        path = Path(env)
    else:
        try:
            import cutlass_library
        except ImportError as e:
            raise BuildError(
                "CUTLASS/CuTe headers not found: install the build requirement `nvidia-cutlass==4.2.0.0` "
                "(pip does it by itself under build isolation; with --no-build-isolation install it first), "
                "or set FLASHMLA_BACKEND_CUTLASS_INCLUDE to a folder holding cute/ and cutlass/"
            ) from e
        path = Path(cutlass_library.__file__).resolve().parent / "source" / "include"
    if not (path / "cute").is_dir() or not (path / "cutlass").is_dir():
        raise BuildError(f"{path} does not hold cute/ and cutlass/ (CUTLASS headers)")
    return str(path)


def requested_archs():
    archs = [a.strip() for a in os.environ.get("FLASHMLA_BACKEND_CUDA_ARCHS", "80;90a").split(";") if a.strip()]
    bad = [a for a in archs if a not in SUPPORTED_ARCHS]
    if bad or not archs:
        raise BuildError(f"FLASHMLA_BACKEND_CUDA_ARCHS has {bad or archs}; supported targets: {';'.join(SUPPORTED_ARCHS)}")
    return archs


def gencode_flags(archs):
    flags = []
    if "80" in archs:
        flags += ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_80,code=compute_80"]
    if "90a" in archs:
        flags += ["-gencode", "arch=compute_90a,code=sm_90a"]
    return flags


# The sm90 kernel runs at 248-254 of its 255 registers; a register spill there costs it most of its speed (and
# usually serializes every wgmma). ptxas reports spills as warnings only with --warn-on-spills, and
# --warning-as-error makes those (and its wgmma serialization warnings, C7510..C7515) fail the compile, so a change
# that makes the kernel spill cannot build. (Its C7519 "warpgroup.arrive is injected" lines are infos, not warnings.)
SM90_PTXAS_FLAGS = ["-Xptxas=--warn-on-spills,--warning-as-error"]
# Translation units whose spills are reported but do not fail the build. The FP8 tensor-core kernel's accurate mode
# (two e4m3 terms of q and of P; behind FLASHMLA_BACKEND_FP8_KERNEL=tensorcore while it is measured) keeps 40 bytes of
# loop-invariant values (metadata fields, the request index) on the stack: stored before the main loop and reloaded
# at request boundaries, never inside a step (checked in the SASS: no LDL/STL between the first and the last wgmma
# of a step). It goes back under the gate before it becomes a default.
SM90_SPILL_REPORTED_ONLY = {
    "csrc/sm90/decode_fp8/instantiations/accurate_bf16.cu",
    "csrc/sm90/decode_fp8/instantiations/accurate_fp16.cu",
}


def sm90_ptxas_flags(src):
    rel = src.relative_to(ROOT).as_posix()
    return ["-Xptxas=--warn-on-spills"] if rel in SM90_SPILL_REPORTED_ONLY else SM90_PTXAS_FLAGS


def header_stamp():
    """Newest modification time of any header under csrc/ (a header change rebuilds everything)."""
    stamps = [p.stat().st_mtime for ext in ("*.h", "*.cuh", "*.hpp") for p in CSRC.rglob(ext)]
    return max(stamps, default=0.0)


class NvccBuildExt(build_ext):
    def build_extension(self, ext):
        t_start = time.time()
        nvcc = find_nvcc()
        version = nvcc_version(nvcc)
        if version < MIN_CUDA:
            raise BuildError(f"{nvcc} is CUDA {version[0]}.{version[1]}; flashmla_backend needs CUDA "
                             f"{MIN_CUDA[0]}.{MIN_CUDA[1]} or newer (sm_90a wgmma/TMA and CUDA 13 headers)")
        archs = requested_archs()
        cutlass_inc = find_cutlass_include()
        import pybind11

        def sources(pattern):  # files under a `checks/` folder are standalone device checks, not the module
            return sorted(p for p in CSRC.glob(pattern) if "checks" not in p.relative_to(CSRC).parts)

        portable = sources("portable/**/*.cu") + sources("smxx/*.cu")
        with_sm90 = "90a" in archs and os.environ.get("FLASHMLA_BACKEND_SM90_KERNEL", "1") != "0"
        sm90 = sources("sm90/**/*.cu") if with_sm90 else []
        binding = [CSRC / "binding" / "module.cpp"]
        defines = [f'-DFLASHMLA_BACKEND_ARCH_LIST="{";".join(archs)}"']
        if sm90:
            defines.append("-DFLASHMLA_BACKEND_WITH_SM90")

        common = ["-O3", "-std=c++17", "-DNDEBUG", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
                  f"-I{CSRC}", f"-I{cutlass_inc}"] + defines
        cuda_flags = ["--expt-relaxed-constexpr", "-lineinfo"] + os.environ.get("FLASHMLA_BACKEND_NVCC_FLAGS", "").split()
        # Longest compiles first (the CuTe/wgmma translation units), so that parallel jobs finish together.
        jobs = [(src, common + cuda_flags + gencode_flags(["90a"]) + sm90_ptxas_flags(src)) for src in sm90]
        jobs += [(src, common + cuda_flags + gencode_flags(archs)) for src in portable]
        py_inc = [f"-I{sysconfig.get_paths()['include']}", f"-I{pybind11.get_include()}"]
        jobs += [(src, common + py_inc) for src in binding]

        obj_dir = Path(self.build_temp) / "flashmla_backend_obj"
        obj_dir.mkdir(parents=True, exist_ok=True)
        headers_mtime = header_stamp()
        n_jobs = int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))
        log(f"nvcc {version[0]}.{version[1]} at {nvcc}; targets {';'.join(archs)}; CUTLASS {cutlass_inc}; "
            f"{len(jobs)} files, {n_jobs} parallel jobs")

        def compile_one(index_job):
            index, (src, flags) = index_job
            rel = src.relative_to(ROOT)
            cmd = [nvcc, "-c", str(src)] + flags
            key = hashlib.sha1(" ".join(cmd).encode()).hexdigest()[:12]
            obj = obj_dir / (str(rel).replace(os.sep, "_") + f".{key}.o")
            if obj.exists() and obj.stat().st_mtime > max(src.stat().st_mtime, headers_mtime):
                log(f"[{index}/{len(jobs)}] {rel}: up to date")
                return obj
            log(f"[{index}/{len(jobs)}] {rel}: compiling ...")
            t0 = time.time()
            tmp = obj.with_suffix(".tmp.o")
            res = subprocess.run(cmd + ["-o", str(tmp)], capture_output=True, text=True)
            if res.returncode != 0:
                raise BuildError(f"compiling {rel} failed:\n{' '.join(cmd)}\n{res.stdout}{res.stderr}")
            tmp.replace(obj)
            log(f"[{index}/{len(jobs)}] {rel}: done in {time.time() - t0:.1f} s")
            return obj

        with ThreadPoolExecutor(max_workers=max(1, n_jobs)) as pool:
            objects = list(pool.map(compile_one, enumerate(jobs, start=1)))

        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        # The CUDA runtime is linked statically: the module then needs only the driver (libcuda), not a
        # particular libcudart, and no torch library at all.
        link = [nvcc, "-shared", "--cudart", "static", "-o", str(target)] + [str(o) for o in objects]
        res = subprocess.run(link, capture_output=True, text=True)
        if res.returncode != 0:
            raise BuildError(f"linking failed:\n{' '.join(link)}\n{res.stdout}{res.stderr}")
        log(f"linked {target.name} in {time.time() - t_start:.1f} s total")


setup(
    ext_modules=[Extension("flashmla_backend._C", sources=[])],
    cmdclass={"build_ext": NvccBuildExt},
)
