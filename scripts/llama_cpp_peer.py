"""llama.cpp as a benchmark peer: build it, requantize the GGUF to F32, drive ``llama-server``.

    python scripts/llama_cpp_peer.py [BUILD_DIR]   # find (or build) llama.cpp and the F32 GGUF; print their paths

llama.cpp is the CPU engine people pick, so it is the peer that says how far jaxpaged is
from the state of the art on this machine. It is never committed: the ``llama-cpp-python``
sdist vendors a pinned llama.cpp (``vendor/llama.cpp``), which is built once (~10 minutes
on 2 cores) into ``~/.cache/jaxpaged/llama.cpp-<version>`` and reused after that.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxpaged"
TARGETS = ("llama-server", "llama-quantize", "llama-batched-bench")
CMAKE_FLAGS = ("-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON")


# ---- build ----------------------------------------------------------------------------


def _bin_dir(root: Path) -> Path | None:
    """The folder holding ``llama-server`` under a build root (``bin/`` or ``build/bin/``), if built."""
    for d in (root, root / "bin", root / "build" / "bin"):
        if all((d / t).is_file() for t in TARGETS[:2]):
            return d
    return None


def find_or_build(llama_cpp_dir: str | None = None) -> Path:
    """The ``bin`` folder of a llama.cpp build: ``llama_cpp_dir``'s, a cached one, or a fresh build.

    A cached build is reused without asking the network which version is newest: the
    benchmark must not rebuild for ten minutes because a release came out.
    """
    if llama_cpp_dir:
        found = _bin_dir(Path(llama_cpp_dir).expanduser())
        if found is None:
            raise FileNotFoundError(f"--llama-cpp-dir {llama_cpp_dir}: no {' and '.join(TARGETS[:2])} under it, "
                                    f"bin/ or build/bin/")
        return found
    cached = sorted((d for d in CACHE.glob("llama.cpp-*") if d.is_dir() and _bin_dir(d)), key=os.path.getmtime)
    return _bin_dir(cached[-1]) if cached else build()


def build() -> Path:
    """Download the ``llama-cpp-python`` sdist, unpack its vendored llama.cpp, cmake the targets.

    The compiler output goes to ``build.log`` beside the build (it is long); on failure
    its tail is raised so the reason shows without opening the file.
    """
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "-q",
                        "-d", tmp, "llama-cpp-python"], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
        root = CACHE / f"llama.cpp-{version}"
        src = root / "src"
        if not src.is_dir():
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            root.mkdir(parents=True, exist_ok=True)
            shutil.move(str(Path(tmp) / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"), src)
    log = root / "build.log"
    jobs = str(os.cpu_count() or 1)
    print(f"building llama.cpp {version} in {root} (~10 minutes on 2 cores); log: {log}", flush=True)
    t = time.perf_counter()
    with open(log, "w") as f:
        for cmd in (["cmake", "-S", str(src), "-B", str(root / "build"), *CMAKE_FLAGS],
                    ["cmake", "--build", str(root / "build"), "-j", jobs, "--target", *TARGETS]):
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode:
                raise RuntimeError(f"llama.cpp build failed: {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    print(f"built llama.cpp in {time.perf_counter() - t:.0f} s", flush=True)
    return root / "build" / "bin"


# The GGUF types a comparison requantizes to, by the dtype jaxpaged runs in.
WEIGHTS = {"float32": "F32", "bfloat16": "BF16"}


def requantized_gguf(bin_dir: Path, gguf: Path, qtype: str = "F32") -> Path:
    """``gguf`` requantized to ``qtype`` (``"F32"`` or ``"BF16"``, cached), so llama.cpp's
    weights are the precision jaxpaged's are.

    The cache name carries a hash of the source's path, size and mtime: another file of the
    same name never reuses a stale conversion.
    """
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = CACHE / f"{gguf.stem}-{key}.{qtype}.gguf"
    if not out.is_file():
        tmp = out.with_suffix(".tmp")
        r = subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(tmp), qtype],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"llama-quantize failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        tmp.rename(out)
    return out


def cpu_flags() -> str:
    """The SIMD extensions a ``GGML_NATIVE`` build uses: ``lscpu``'s model name ("AMD EPYC") does not say."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "?"
    return " ".join(f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile"))


# ---- the server ------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """A ``llama-server`` setting of its KV cache and attention (its flags), and whether it
    keeps K/V and activations in float32 like jaxpaged (its weights are the GGUF's:
    :func:`requantized_gguf`)."""

    flags: tuple[str, ...]
    float32: bool
    note: str


# llama.cpp keeps K and V in f16 by default (``-ctk``/``-ctv``), whatever the weights: with the
# F32 GGUF alone it is not float32 on every side. With an f32 cache its two attention paths
# trade places (this machine, 48 x 128: flash attention ~270 generated tok/s, the plain path
# ~330; with f16 the other way round, ~390 vs ~315), so both float32 settings run and the
# faster is the peer. The f16 default runs too, for reference, outside the ratios.
CONFIGS = {
    "kv-f32": Config(("-ctk", "f32", "-ctv", "f32", "-fa", "off"), True, "KV f32, no flash attention"),
    "kv-f32-fa": Config(("-ctk", "f32", "-ctv", "f32", "-fa", "on"), True, "KV f32, flash attention"),
    "kv-f16-fa": Config(("-ctk", "f16", "-ctv", "f16", "-fa", "on"), False,
                        "KV f16, flash attention: llama.cpp's defaults, not float32"),
}


class LlamaServer:
    """``llama-server`` with ``slots`` continuous-batching slots, as a context manager.

    The process is started on a free local port, waited for until ``/health`` answers, and
    always terminated on exit (killed if it does not stop), so a failed benchmark leaves
    no server behind. Its log goes to a file, shown in the error when it does not start.
    ``flags``: more ``llama-server`` arguments (a :data:`CONFIGS` entry's).
    """

    def __init__(self, bin_dir: Path, gguf: Path, *, slots: int, ctx_per_slot: int, threads: int,
                 flags: tuple[str, ...] = ()):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "-np", str(slots), "-c", str(slots * ctx_per_slot),
                    "-t", str(threads), "-cb", "--host", "127.0.0.1", "--port", str(self.port), "--no-webui",
                    *flags]
        self.log = Path(tempfile.gettempdir()) / f"jaxpaged-llama-server-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy(timeout=300)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {' '.join(self.cmd)}\n"
                                   f"{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:  # refused while starting, 503 while loading the model
                pass
            time.sleep(0.25)
        raise TimeoutError(f"llama-server did not answer /health in {timeout:.0f} s; log: {self.log}")

    def complete(self, prompt: list[int], n_predict: int) -> dict:
        """One greedy completion of token ids: exactly ``n_predict`` tokens, no prompt cache."""
        body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.load(r)


# ---- measurements ----------------------------------------------------------------------


def run_batch(server: LlamaServer, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    """Every request submitted at once (one thread each); generated tok/s over the wall
    clock from the first submit to the last response, as jaxpaged's offline mode counts."""
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        t0 = time.perf_counter()
        res = list(pool.map(server.complete, prompts, max_tokens))
        wall = time.perf_counter() - t0
    got = [r["tokens_predicted"] for r in res]
    return {"wall_s": wall, "num_generated": sum(got), "num_requests": len(res),
            "as_asked": sum(g == m for g, m in zip(got, max_tokens)),
            "prompt_tokens_evaluated": sum(r["tokens_evaluated"] for r in res),
            "outputs": [r.get("tokens", []) for r in res]}


def single_stream(server: LlamaServer, prompts: list[list[int]], n_predict: int) -> dict:
    """Decode tok/s of one request alone (llama.cpp's own ``predicted_per_second``, prefill
    excluded), one prompt after the other; the median, as the machine is shared."""
    runs = [server.complete(p, n_predict) for p in prompts]
    rates = sorted(r["timings"]["predicted_per_second"] for r in runs)
    return {"decode_tok_s": rates[len(rates) // 2], "decode_tok_s_runs": rates,
            "prefill_tok_s": sorted(r["timings"]["prompt_per_second"] for r in runs)[len(runs) // 2],
            "as_asked": all(r["tokens_predicted"] == n_predict for r in runs)}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from jaxpaged.default_model import default_model_path

    bin_dir = find_or_build(sys.argv[1] if len(sys.argv) > 1 else None)  # an existing build to check
    print(f"llama.cpp: {bin_dir}\nF32 GGUF: {requantized_gguf(bin_dir, default_model_path())}")


if __name__ == "__main__":
    main()
