"""Child processes of the GPU tests: compute-sanitizer runs (racecheck beside a second process that
keeps the GPU busy) and XLA command-buffer dumps.

A child runs the way a user's script runs: from a temporary folder (not the checkout, whose
jax_sparse_mla has no compiled extension), importing the installed package, with tests/kernels and
tests/ on its path for the test modules, and without JAX's preallocation (the parent pytest process
holds the GPU too; tests/conftest.py caps what the parent may take). A child that fails or outlives
its time limit fails the test with its own output (the sanitizer's report), its exit status and the
device memory the parent process holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))


def run_script(args: list[str], *, xla_flags: str, cwd, timeout: int) -> subprocess.CompletedProcess:
    """Runs the child; a child still running after `timeout` seconds is killed and fails the test
    with what it printed so far."""
    path = [_HERE, os.path.dirname(_HERE), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_FLAGS=xla_flags,
               PYTHONPATH=os.pathsep.join(p for p in path if p))
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)  # the parent's cap is not the child's
    try:
        return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{' '.join(args[:4])} ... still ran after {timeout} s and was killed\n"
                    + _report(_text(error.stdout), _text(error.stderr)))


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def _parent_memory() -> str:
    """The device memory this (parent) process holds, for failure reports."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_in_use" not in stats:
        return "parent process: no device memory statistics"
    return (f"parent process: {stats['bytes_in_use'] / 2**30:.2f} GiB in use, "
            f"{stats.get('bytes_reserved', stats.get('pool_bytes', 0)) / 2**30:.2f} GiB reserved, "
            f"limit {stats.get('bytes_limit', 0) / 2**30:.2f} GiB")


def _report(stdout: str, stderr: str, returncode: int | None = None) -> str:
    status = "" if returncode is None else f"exit status {returncode}; "
    return (f"{status}{_parent_memory()}\n--- child stdout (end) ---\n{stdout[-4000:]}\n"
            f"--- child stderr (end) ---\n{stderr[-4000:]}")


# Seconds a sanitizer child may run (JAX_SPARSE_MLA_SANITIZER_TIMEOUT overrides): each passes in
# under 20 s alone on an H100.
SANITIZER_TIMEOUT = int(os.environ.get("JAX_SPARSE_MLA_SANITIZER_TIMEOUT", "300"))
# What each compute-sanitizer tool prints when it found nothing.
_CLEAN_SUMMARY = {"memcheck": "ERROR SUMMARY: 0 errors",
                  "racecheck": "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"}


@contextlib.contextmanager
def _one_sanitizer_at_a_time():
    """Holds a machine-wide lock while a sanitizer child runs, so that the workers of a `pytest -n`
    run never run two at once: on an H100, with 8 workers' children sharing the GPU, an
    index-conversion memcheck child stalled in XLA's compilation until killed after 300 s (8 s
    alone)."""
    with open(os.path.join(tempfile.gettempdir(), "jax_sparse_mla_sanitizer.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


# A second GPU context that keeps the GPU busy (bf16 matrix products) until it is killed; it
# prints "BUSY" once its first product is done.
_BUSY_SCRIPT = """
import jax, jax.numpy as jnp
step = jax.jit(lambda x: (x @ x) * (1.0 / 4096))
x = step(jnp.ones((4096, 4096), jnp.bfloat16)).block_until_ready()
print("BUSY", flush=True)
while True:
    for _ in range(50):
        x = step(x)
    x.block_until_ready()
"""


_BUSY_START_TIMEOUT = 120  # seconds; it starts in a few


@contextlib.contextmanager
def _beside_another_context(cwd):
    """Runs _BUSY_SCRIPT in its own process while the body runs. Racecheck reported hazards on the
    paired 64-head fp8 kernel only while another process ran kernels on the GPU, in every such run,
    and never alone (docs/kernels/sm90-fp8.md, Tests): a racecheck child alone would miss them, as
    it would on a GPU that a served model shares."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    errors = os.path.join(cwd, "busy_stderr.txt")
    with open(errors, "w") as stderr:  # a file, not a pipe: nothing reads it while the body runs
        busy = subprocess.Popen([sys.executable, "-c", _BUSY_SCRIPT], env=env, cwd=cwd,
                                stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        started, _, _ = select.select([busy.stdout], [], [], _BUSY_START_TIMEOUT)
        if not started or busy.stdout.readline().strip() != "BUSY":
            busy.kill()
            pytest.fail(f"the busy GPU process gave no first product (waited up to "
                        f"{_BUSY_START_TIMEOUT} s; exit status {busy.wait()}):\n"
                        f"{open(errors).read()[-3000:]}")
        yield
    finally:
        busy.kill()
        busy.wait()
        busy.stdout.close()


def assert_sanitizer_clean(script: str, tmp_path, tool: str = "memcheck") -> None:
    """Runs `script` (which prints "MEMCHECK GRID PASSED" when its cases match) under
    compute-sanitizer --tool `tool` (memcheck or racecheck) as a plain script (pytest under the
    sanitizer crashes in the interpreter) and asserts that the tool reports nothing. Racecheck runs
    beside a second process that keeps the GPU busy (_beside_another_context)."""
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not on PATH")
    beside = _beside_another_context(tmp_path) if tool == "racecheck" else contextlib.nullcontext()
    # No autotuning: under the sanitizer every candidate kernel XLA times would be instrumented too.
    with _one_sanitizer_at_a_time(), beside:
        result = run_script([sanitizer, "--tool", tool, "--error-exitcode", "3", sys.executable,
                             "-c", script], xla_flags="--xla_gpu_autotune_level=0", cwd=tmp_path,
                            timeout=SANITIZER_TIMEOUT)
    report = _report(result.stdout, result.stderr, result.returncode)
    assert result.returncode == 0, report
    assert "MEMCHECK GRID PASSED" in result.stdout, report
    assert _CLEAN_SUMMARY[tool] in result.stdout + result.stderr, report


def run_with_command_buffers(script: str, args: list[str], tmp_path) -> subprocess.CompletedProcess:
    """Runs `script DUMP_DIR *args` with XLA forming command buffers around fusions and custom calls
    (even single ones) and dumping its HLO and thunk sequences into DUMP_DIR."""
    dump = tmp_path / "dump"
    flags = (f"--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1 "
             f"--xla_dump_to={dump} --xla_dump_hlo_as_text")
    result = run_script([sys.executable, "-c", script, str(dump), *args], xla_flags=flags,
                        cwd=tmp_path, timeout=300)
    assert result.returncode == 0, _report(result.stdout, result.stderr, result.returncode)
    return result


def assert_matches_inside_command_buffers(script: str, tmp_path) -> None:
    """Runs `script` under run_with_command_buffers; the script prints "RESULT <matches> <custom-call
    thunks> <captured>" (its native and reference results agreed; custom_calls_in_command_buffers'
    counts). Asserts that they agreed and that every custom call of our targets ran inside a command
    buffer."""
    result = run_with_command_buffers(script, [], tmp_path)
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT"))
    _, matches, custom_calls, captured = line.split()
    assert matches == "True", line
    assert int(custom_calls) > 0 and captured == custom_calls, (
        "no XLA dump shows the custom calls inside a command buffer:\n" + result.stdout[-3000:])


def custom_calls_in_command_buffers(dump_dir: str, targets) -> tuple[int, int, list[str]]:
    """(custom-call thunks, those inside a command buffer, the first thunk lines) over the modules
    of an XLA dump whose optimised HLO calls any of `targets`.

    XLA forms command buffers on the thunk sequence after its HLO passes (CommandBufferConversionPass)
    and dumps the result as *thunk_sequence_after_thunk_passes.txt, one thunk per line
    ("<indent>NNN: kKind"), the thunks a command buffer holds indented below its kCommandBuffer line.
    A custom call is captured when it has a kCommandBuffer ancestor (nested ones included: a loop
    body gets command buffers of its own). Called in the child process that made the dump.
    """
    modules = {os.path.basename(path).split(".")[0]
               for path in glob.glob(dump_dir + "/*after_optimizations.txt")
               if any(target in open(path).read() for target in targets)}
    custom_calls, captured, shown = 0, 0, []
    for path in sorted(glob.glob(dump_dir + "/*thunk_sequence_after_thunk_passes.txt")):
        if os.path.basename(path).split(".")[0] not in modules:
            continue
        stack = []
        for line in open(path):
            match = re.match(r"^( *)\d+: (k\w+)", line)
            if not match:
                continue
            depth, kind = len(match.group(1)), match.group(2)
            while stack and stack[-1][0] >= depth:
                stack.pop()
            if kind == "kCustomCall":
                custom_calls += 1
                captured += any(k == "kCommandBuffer" for _, k in stack)
            stack.append((depth, kind))
            if len(shown) < 40:
                shown.append(line.rstrip())
    return custom_calls, captured, shown
