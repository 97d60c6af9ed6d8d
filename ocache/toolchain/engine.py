"""Build the (patched) llama-server from the pinned llama.cpp source, offline, cached by its inputs.

The source is the ``vendor/llama.cpp`` tree of the PyPI sdist ``llama-cpp-python==0.3.36`` (llama.cpp
build ``0c1e570``), fetched with pip and checked against a pinned sha256. Every ``patches/*.patch`` is
applied in name order, then CMake builds the ``llama-server`` target with the offline recipe of
``docs/llama-server.md`` §17 (``LLAMA_USE_PREBUILT_UI=OFF``, ``LLAMA_OPENSSL=OFF``, tests
and examples off, static libraries so the binary is self-contained).

Layout under ``cache_root()/engine``::

    src-<sdist8>/                 pristine source, a private git repo so patches are applied and
                                  reverted touching only the files they change (incremental builds)
    build-<sdist8>-<backend>/     the CMake build directory
    llama-server-<key16>/bin/llama-server   installed result; stamp.json describes it

``key16`` hashes (sdist sha256, each patch's bytes, the CMake flags, the CPU's feature flags), so a
second call with the same inputs finds the installed binary and returns at once.

The build stamps itself: ``/props.build_info`` reads ``b1-0c1e570`` for a stock build and
``b1-0c1e570+ocache.<patch8>`` for a patched one (``LLAMA_BUILD_COMMIT``, CMakeLists.txt:153-158).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from ocache.paths import cache_root, file_lock, repo_root, sha256_file

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_FILE = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_COMMIT = "0c1e570"

#: CMake ``-D`` options per backend. Only ``cpu`` is built and tested here; the others are the
#: documented one-flag switch for users with a GPU (not exercised in CI).
BACKENDS: dict[str, list[str]] = {
    "cpu": [],
    # the CPU build without AVX-512 (and without tuning to this CPU): the same suite against it
    # shows that exactness does not depend on the vector extensions (README "Tests")
    "cpu-avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                 "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"],
    "cuda": ["-DGGML_CUDA=ON"],
    "hip": ["-DGGML_HIP=ON"],
    "metal": ["-DGGML_METAL=ON"],
    "vulkan": ["-DGGML_VULKAN=ON"],
}

BASE_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_NUMBER=1",
]


class EngineError(RuntimeError):
    """The engine could not be fetched, patched or built (the message says which step)."""


@dataclass(frozen=True)
class EngineBuild:
    """An installed llama-server: its binary, build id (as ``/props.build_info`` reports it) and key."""

    binary: Path
    build_info: str
    key: str
    patched: bool
    patches: tuple[str, ...]


def _log(msg: str) -> None:
    print(f"[ocache engine] {msg}", file=sys.stderr, flush=True)


def engine_dir() -> Path:
    path = cache_root() / "engine"
    path.mkdir(parents=True, exist_ok=True)
    return path




#: Where an installed package (``pip install <checkout>``, not editable) carries the patches: the
#: wheel's copy of ``patches/`` (``ocache/data/patches`` is a link to it in the checkout, followed
#: when the wheel is built: ``pytest tests/test_engine_find.py -k wheel``).
PACKAGED_PATCHES = Path(__file__).resolve().parent.parent / "data" / "patches"


def patches_dir() -> Path:
    """``patches/`` of the checkout this package runs from, else the installed package's copy.
    Raises FileNotFoundError when neither holds a patch: a build from such an install would be
    the stock server under the patched server's name."""
    for d in (repo_root() / "patches", PACKAGED_PATCHES):
        if any(d.glob("*.patch")):
            return d
    raise FileNotFoundError(f"no llama.cpp patches in {repo_root() / 'patches'} or {PACKAGED_PATCHES}: "
                            "reinstall ocache from its checkout")


def patch_files(patches_dir: Path | None = None) -> list[Path]:
    """The project's patches, in the order they are applied (sorted by file name)."""
    d = patches_dir or globals()["patches_dir"]()
    return sorted(d.glob("*.patch"))




def _cpu_flags() -> str:
    """The CPU feature flags (GGML_NATIVE compiles for them, so they are part of the key)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def fetch_sdist() -> Path:
    """Download the pinned sdist with pip (hash-checked) into the cache; return its path.

    Raises EngineError if pip fails or the file's sha256 differs from ``SDIST_SHA256``.
    """
    dest = cache_root() / "sdist"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / SDIST_FILE
    if path.exists() and sha256_file(path) == SDIST_SHA256:
        return path
    req = dest / "requirements.txt"
    req.write_text(f"{SDIST_NAME}=={SDIST_VERSION} --hash=sha256:{SDIST_SHA256}\n")
    _log(f"downloading {SDIST_NAME}=={SDIST_VERSION} sdist with pip (hash-checked)...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--require-hashes", "-r", str(req), "-d", str(dest), "-q"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 or not path.exists():
        raise EngineError(f"pip download failed:\n{res.stdout}\n{res.stderr}")
    if sha256_file(path) != SDIST_SHA256:
        path.unlink()
        raise EngineError("sdist sha256 mismatch: refusing to build from it")
    return path


def _git(src: Path, *args: str) -> str:
    res = subprocess.run(["git", "-C", str(src), *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise EngineError(f"git {' '.join(args)} failed in {src}: {res.stderr.strip()}")
    return res.stdout


def source_dir() -> Path:
    """The unpacked pristine llama.cpp tree (a private git repo), unpacking it on first use."""
    src = engine_dir() / f"src-{SDIST_SHA256[:8]}"
    if (src / ".git" / "ocache-pristine").exists():
        return src
    sdist = fetch_sdist()
    if src.exists():
        shutil.rmtree(src)
    tmp = src.with_name(src.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    prefix = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"
    _log("unpacking vendor/llama.cpp from the sdist...")
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and len(m.name) > len(prefix):
                m.name = m.name[len(prefix):]
                members.append(m)
        tar.extractall(tmp, members=members, filter="data")
    gitfile = tmp / ".git"  # a submodule pointer in the sdist; replaced by our own repo
    if gitfile.is_file():
        gitfile.unlink()
    for args in (["init", "-q"], ["add", "-A", "-f"],
                 ["-c", "user.email=ocache@localhost", "-c", "user.name=ocache",
                  "commit", "-q", "-m", "pristine llama.cpp " + LLAMA_COMMIT]):
        _git(tmp, *args)
    (tmp / ".git" / "ocache-pristine").write_text(SDIST_SHA256 + "\n")
    tmp.rename(src)
    return src


def vocab_gguf() -> Path:
    """The real Qwen tokenizer vocabulary shipped in the sdist (``models/ggml-vocab-qwen35.gguf``)."""
    return source_dir() / "models" / "ggml-vocab-qwen35.gguf"


def chat_template_file(name: str) -> Path:
    """A chat template shipped with the pinned source (``models/templates/NAME``, e.g.
    ``Qwen3.5-4B.jinja``), for ``llama-server --chat-template-file``: the templates users run, as
    opposed to ocache's append-only ``ocache/data/chat_template.jinja`` that the tiny models embed.
    The patches never touch ``models/``, so the work tree's copy is the pristine one. Raises
    FileNotFoundError for a name the source does not have."""
    path = source_dir() / "models" / "templates" / name
    if not path.is_file():
        raise FileNotFoundError(f"no chat template {name!r} in {path.parent}")
    return path


def gguf_py_dir() -> Path:
    """The ``gguf-py`` package of the pinned source (knows the ``qwen35`` arch)."""
    return source_dir() / "gguf-py"


def build_key(patches: list[Path], backend: str) -> tuple[str, str]:
    """Return (key16, patch8): the install key and the short hash of the patch set."""
    ph = hashlib.sha256()
    for p in patches:
        ph.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    patch8 = ph.hexdigest()[:8] if patches else ""
    k = hashlib.sha256()
    k.update(json.dumps({
        "sdist": SDIST_SHA256, "patches": ph.hexdigest() if patches else "",
        "flags": BASE_CMAKE_FLAGS + BACKENDS[backend], "cpu": _cpu_flags(),
    }, sort_keys=True).encode())
    return k.hexdigest()[:16], patch8


def build(stock: bool = False, backend: str = "cpu", jobs: int | None = None,
          patches_dir: Path | None = None) -> EngineBuild:
    """Build (or find cached) llama-server; return what was installed.

    ``stock=True`` builds the unpatched source (tests compare against it). Raises EngineError on any
    failed step; the cache is only written after a successful build, so a failed or interrupted build
    is never mistaken for a good one.
    """
    if backend not in BACKENDS:
        raise EngineError(f"unknown backend {backend!r}; choose one of {sorted(BACKENDS)}")
    patches = [] if stock else patch_files(patches_dir)
    key, patch8 = build_key(patches, backend)
    commit = LLAMA_COMMIT + (f"+ocache.{patch8}" if patches else "")
    build_info = f"b1-{commit}"
    install = engine_dir() / f"llama-server-{key}"
    found = _installed(install, build_info, patches)
    if found:
        return found
    def waiting(s: float) -> None:
        _log(f"waiting for another build of llama-server to finish (lock {engine_dir() / '.build.lock'}, "
             f"{s:.0f} s so far)...")

    with file_lock(engine_dir() / ".build.lock", waiting=waiting):
        found = _installed(install, build_info, patches)
        if found:
            return found
        t0 = time.monotonic()
        src = source_dir()
        _apply_patches(src, patches)
        bdir = engine_dir() / f"build-{SDIST_SHA256[:8]}-{backend}"
        flags = BASE_CMAKE_FLAGS + BACKENDS[backend] + [f"-DLLAMA_BUILD_COMMIT={commit}"]
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        _log(f"configuring ({'stock' if stock else f'{len(patches)} patch(es)'}, {backend})...")
        _run(["cmake", "-S", str(src), "-B", str(bdir), *gen, *flags], quiet=True)
        _log(f"building target llama-server ({_estimate(bdir, backend)})...")
        _run(["cmake", "--build", str(bdir), "--target", "llama-server",
              "-j", str(jobs or os.cpu_count() or 2)], quiet=False)
        tmp = install.with_name(install.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "bin").mkdir(parents=True)
        shutil.copy2(bdir / "bin" / "llama-server", tmp / "bin" / "llama-server")
        stamp = {"build_info": build_info, "key": key, "sdist_sha256": SDIST_SHA256,
                 "patches": [p.name for p in patches], "backend": backend,
                 "built_at": time.time(), "build_seconds": round(time.monotonic() - t0, 1)}
        (tmp / "stamp.json").write_text(json.dumps(stamp, indent=1))
        if install.exists():
            shutil.rmtree(install)
        tmp.rename(install)
        _log(f"installed {install / 'bin' / 'llama-server'} ({build_info}) "
             f"in {stamp['build_seconds']} s")
        return EngineBuild(install / "bin" / "llama-server", build_info, key, bool(patches),
                           tuple(p.name for p in patches))


def _estimate(bdir: Path, backend: str) -> str:
    """What to expect from the coming build, when the build folder is kept
    (an incremental build recompiles only what the patches touch): the range of the earlier builds'
    ``build_seconds`` (their stamp.json), else the README's measured first build (10.4 min stock +
    1.4 min patched on 2 cores)."""
    if not (bdir / "CMakeCache.txt").exists():
        return "a first build: about 11 minutes on 2 cores"
    took = []
    for stamp in engine_dir().glob("llama-server-*/stamp.json"):
        try:
            d = json.loads(stamp.read_text())
        except (OSError, ValueError):
            continue
        if d.get("backend") == backend and isinstance(d.get("build_seconds"), (int, float)):
            took.append(d["build_seconds"])
    if took:
        lo, hi = min(took), max(took)
        return (f"incremental; earlier builds here took {lo:.0f} s" if hi - lo < 10 else
                f"incremental; earlier builds here took {lo:.0f}-{hi:.0f} s")
    return "incremental: 38-83 s measured on 2 cores"


def _installed(install: Path, build_info: str, patches: list[Path]) -> EngineBuild | None:
    binary = install / "bin" / "llama-server"
    stamp = install / "stamp.json"
    if binary.exists() and stamp.exists():
        key = install.name.removeprefix("llama-server-")
        return EngineBuild(binary, build_info, key, bool(patches), tuple(p.name for p in patches))
    return None


def _apply_patches(src: Path, patches: list[Path]) -> None:
    """Reset the tree to pristine (rewriting only changed files) and apply ``patches`` in order."""
    _git(src, "checkout", "-q", "-f", "HEAD", "--", ".")
    _git(src, "clean", "-q", "-f", "-d")
    for p in patches:
        res = subprocess.run(["git", "-C", str(src), "apply", "--whitespace=nowarn", str(p)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise EngineError(f"patch {p.name} does not apply: {res.stderr.strip()}")
        _log(f"applied {p.name}")


def _run(cmd: list[str], quiet: bool) -> None:
    """Run a build command, relaying progress lines (``[n/N] ...``) so a long build is not silent."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    last = 0.0
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-40:]
        if not quiet and line.startswith("[") and time.monotonic() - last > 5:
            last = time.monotonic()
            _log(line.strip()[:120])
    if proc.wait() != 0:
        raise EngineError(f"{' '.join(cmd[:3])} failed:\n" + "\n".join(tail))


def find(stock: bool = False, backend: str = "cpu") -> EngineBuild | None:
    """Return the installed build of ``backend`` (a ``BACKENDS`` name) for the current patches
    without building, or None. The key is the one ``build(stock, backend)`` installs under, so a
    ``--backend cuda`` build is found by every command that finds the CPU one. Raises EngineError
    for an unknown backend."""
    if backend not in BACKENDS:
        raise EngineError(f"unknown backend {backend!r}; choose one of {sorted(BACKENDS)}")
    patches = [] if stock else patch_files()
    key, patch8 = build_key(patches, backend)
    commit = LLAMA_COMMIT + (f"+ocache.{patch8}" if patches else "")
    return _installed(engine_dir() / f"llama-server-{key}", f"b1-{commit}", patches)
