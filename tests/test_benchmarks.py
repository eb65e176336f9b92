"""The benchmarks' shared parts on the CPU, so that a GPU run does not meet a broken script: the
indexer benchmark's code paths on tiny shapes (pure JAX), the device-time reader on a synthetic
profiler trace, result names and the copy-ceiling check."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def run_benchmark(script: str, *args: str) -> str:
    """Runs benchmarks/<script> as the README runs it (-P, benchmarks/ on PYTHONPATH, the installed
    package); returns its stdout after checking it exited 0."""
    result = subprocess.run([sys.executable, "-P", os.path.join(BENCHMARKS, script), *args],
                            capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                filter(None, [BENCHMARKS, os.environ.get("PYTHONPATH")]))))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


def test_bench_indexer_smoke():
    assert "smoke OK" in run_benchmark("bench_indexer.py", "--smoke")


def _benchmark_module(name):
    sys.path.insert(0, BENCHMARKS)
    try:
        return __import__(name)
    finally:
        sys.path.remove(BENCHMARKS)


def _write_trace(directory, events):
    import gzip
    import json

    run = directory / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_device_times_from_a_trace(tmp_path):
    """The trace reader keeps the GPU's stream events only and gives each call the events that start
    inside its host annotation."""
    timing = _benchmark_module("timing")
    meta = lambda kind, pid, name, tid=0: dict(ph="M", name=kind, pid=pid, tid=tid,  # noqa: E731
                                                args=dict(name=name))
    x = lambda pid, tid, name, ts, dur: dict(ph="X", pid=pid, tid=tid, name=name, ts=ts,  # noqa: E731
                                              dur=dur)
    annotation = timing._ANNOTATION
    _write_trace(tmp_path, [
        meta("process_name", 1, "/device:GPU:0"), meta("process_name", 7, "/host:CPU"),
        meta("thread_name", 1, "Stream #14(Compute)", 14), meta("thread_name", 1, "XLA Ops", 2),
        x(7, 3, annotation, 1000.0, 100.0), x(7, 3, annotation, 1200.0, 50.0),
        x(7, 3, "PjitFunction", 1001.0, 5.0),             # host work: not a device event
        x(1, 14, "kernel_a", 1010.0, 5.0), x(1, 14, "kernel_b", 1030.0, 7.5),
        x(1, 2, "custom-call.1", 1010.0, 27.5),            # the op line repeats the kernels
        x(1, 14, "kernel_a", 1210.0, 6.0),
    ])
    windows, kernels = timing.read_trace(str(tmp_path))
    assert windows == [(1000.0, 1100.0), (1200.0, 1250.0)]
    assert kernels == [(1010.0, 5.0), (1030.0, 7.5), (1210.0, 6.0)]
    times = timing.per_call_times(windows, kernels, [120.0, 60.0])
    assert times.busy_us == (12.5, 6.0) and times.span_us == (27.5, 6.0)
    assert times.kernels_per_call == 1.5 and times.us == (12.5 + 6.0) / 2
    assert abs(times.spread - 6.5 / 9.25) < 1e-12
    with pytest.raises(RuntimeError, match="no device event for call 1"):
        timing.per_call_times(windows, kernels[:2], [1.0, 1.0])


def _decode_trace(tmp_path):
    """Three decode steps 100 us apart on one GPU stream (plus a copy on a second stream in step 1),
    a one-off H2D copy before them, and host events during the step boundaries."""
    meta = lambda kind, pid, name, tid=0: dict(ph="M", name=kind, pid=pid, tid=tid,  # noqa: E731
                                                args=dict(name=name))
    x = lambda pid, tid, name, ts, dur: dict(ph="X", pid=pid, tid=tid, name=name, ts=ts,  # noqa: E731
                                              dur=dur)
    events = [meta("process_name", 1, "/device:GPU:0"), meta("process_name", 7, "/host:CPU"),
              meta("thread_name", 1, "Stream #14(Compute)", 14),
              meta("thread_name", 1, "Stream #15(MemcpyD2D)", 15), meta("thread_name", 1, "XLA Ops", 2),
              meta("thread_name", 7, "python", 3), meta("thread_name", 7, "tf_XLAGpuClient", 4),
              x(1, 14, "MemcpyH2D", 990.0, 4.0)]
    for step in range(3):
        t = 1000.0 + 100 * step
        events += [x(1, 14, "embed", t, 5.0), x(1, 14, "fusion", t + 8, 20.0),
                   x(1, 14, "fusion", t + 28, 10.0), x(1, 14, "argmax", t + 40, 2.0),
                   x(1, 2, "decode_step", t, 42.0)]  # the op line repeats the kernels: not counted
    events += [x(1, 15, "MemcpyD2D", 1130.0, 15.0),  # overlaps step 1's last kernels
               x(7, 3, "PjitFunction(decode)", 1045.0, 54.0), x(7, 3, "ParseArguments", 1050.0, 10.0),
               x(7, 4, "cuLaunchKernel", 1098.0, 3.0), x(7, 3, "PjitFunction(decode)", 1150.0, 45.0),
               x(7, 3, "after the trace", 1300.0, 5.0)]
    _write_trace(tmp_path, events)


def test_decode_gaps_from_a_trace(tmp_path):
    """Per step: busy time, span, the gaps with the events around them (the boundary gap belongs to
    the step it delays; a copy on another stream closes gaps it covers) and the host events during
    the large gaps, innermost first."""
    timing = _benchmark_module("timing")
    _decode_trace(tmp_path)
    gaps = timing.decode_gaps(str(tmp_path), 3)
    assert gaps.marker == "embed"  # MemcpyH2D runs once in the trace, fusion twice a step
    s0, s1, s2 = gaps.steps
    assert [s.kernels for s in gaps.steps] == [5, 5, 4]
    assert [s.busy_us for s in gaps.steps] == [41.0, 52.0, 37.0]
    assert (s0.start, s0.end, s1.span_us, s2.span_us) == (990.0, 1042.0, 45.0, 42.0)
    assert [(g.start, g.us, g.before, g.after) for g in s0.gaps] == [
        (994.0, 6.0, "MemcpyH2D", "embed"), (1005.0, 3.0, "embed", "fusion"),
        (1038.0, 2.0, "fusion", "argmax")]
    assert [(g.us, g.before, g.after) for g in s1.gaps] == [(58.0, "argmax", "embed"),
                                                            (3.0, "embed", "fusion")]
    assert [(g.us, g.before, g.after) for g in s2.gaps] == [
        (55.0, "MemcpyD2D", "embed"), (3.0, "embed", "fusion"), (2.0, "fusion", "argmax")]
    assert s1.largest.host == (("python", "PjitFunction(decode)", 54.0),
                               ("python", "ParseArguments", 10.0),
                               ("tf_XLAGpuClient", "cuLaunchKernel", 2.0))
    assert s2.largest.host == (("python", "PjitFunction(decode)", 45.0),)
    assert s0.largest.us == 6.0 and s0.largest.host == ()  # each step's largest is looked up
    assert s1.gaps[1].host == ()  # a 3 us gap is not (large_us=10)
    assert gaps.busy_us == 130.0 and gaps.span_us == 252.0 and gaps.periods_us == (100.0, 100.0)
    p = gaps.per_step()
    assert p["kernels_per_step"] == 5 and p["period_ms"] == 0.1 and p["largest_gap_us"] == 55.0
    assert abs(p["idle_ms"] - (11.0 + 61.0 + 60.0) / 3e3) < 1e-12 and p["gaps_per_step"] == 8 / 3
    before, after, us, per_step, host = gaps.by_pair()[0]
    assert (before, after, us, per_step) == ("argmax", "embed", 58.0 / 3, 1 / 3)
    assert host[0] == ("python", "PjitFunction(decode)", 18.0)
    assert "most idle between argmax -> embed (19.3 us/step)" in gaps.summary()
    table = "\n".join(gaps.table())
    assert "[python] PjitFunction(decode)" in table and "58.0  argmax -> embed" in table


def test_decode_gaps_script_reads_a_trace(tmp_path, capsys):
    _decode_trace(tmp_path)
    _benchmark_module("decode_gaps").main(["--trace-dir", str(tmp_path), "--steps", "3",
                                           "--json", str(tmp_path / "gaps.json")])
    out = capsys.readouterr().out
    assert out.startswith("gaps: 3 steps, 5 device events/step: kernels 0.043 ms/step")
    assert "[python] PjitFunction(decode)" in out
    import json

    with open(tmp_path / "gaps.json") as f:
        assert json.load(f)["period_ms"] == 0.1


def test_decode_gaps_need_a_step_marker(tmp_path):
    timing = _benchmark_module("timing")
    _decode_trace(tmp_path)
    with pytest.raises(ValueError, match="no device event runs exactly once in each of 4 steps"):
        timing.decode_gaps(str(tmp_path), 4)
    with pytest.raises(ValueError, match="marker 'fusion' occurs 6 times"):
        timing.decode_gaps(str(tmp_path), 3, marker="fusion")
    # Steps begin at the marker; events before the first one belong to the first step.
    gaps = timing.decode_gaps(str(tmp_path), 3, marker="argmax")
    assert [s.kernels for s in gaps.steps] == [9, 4, 1]
    assert [(g.us, g.before, g.after) for g in gaps.steps[2].gaps] == [(2.0, "fusion", "argmax")]
    with pytest.raises(ValueError, match="no device events"):
        timing.kernel_gaps([], 3)


@pytest.mark.parametrize("kind,card", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                       ("NVIDIA B200", "b200"), ("cpu", "cpu"),
                                       ("NVIDIA RTX PRO 6000 Blackwell", "nvidia_rtx_pro_6000_blackwell")])
def test_results_are_named_for_the_card(kind, card):
    assert _benchmark_module("records").card_name(kind) == card


def test_a_row_over_the_copy_ceiling_is_measured_again_then_flagged():
    records, timing = _benchmark_module("records"), _benchmark_module("timing")
    lines = []
    record = records.Recorder(lines.append, peak_gbps=1000.0)
    calls = []

    def measure(us):
        def run():
            calls.append(us)
            return timing.DeviceTimes((us,), (us,), (us,), 1.0)
        return run

    # 1 MB in 0.5 us is 2000 GB/s: twice the ceiling, measured twice, then flagged.
    row = record.measure("fast", measure(0.5), 1e6, op="x")
    assert calls == [0.5, 0.5] and row["us"] is None and row["flagged_us"] == 0.5
    assert "exceeds the run's copy ceiling" in row["flag"] and "FLAGGED" in lines[-1]
    row = record.measure("ok", measure(2.0), 1e6, op="x")
    assert row["us"] == 2.0 and row["gbps"] == 500.0 and "flag" not in row and calls[-1] == 2.0
    assert len(calls) == 3


def test_prefill_flops_count_each_token(tmp_path):
    """bench_prefill's FLOP count against a token-by-token sum: token p attends min(p + 1, top-k) keys
    and scores p + 1 indexer keys; and its kernel kinds from a synthetic trace."""
    bench = _benchmark_module("bench_prefill")
    for prompt_len in (5, bench.TOPK, bench.TOPK + 37):
        keys = sum(min(p + 1, bench.TOPK) for p in range(prompt_len))
        scored = sum(p + 1 for p in range(prompt_len))
        flops = bench.flops_by_kind(prompt_len, batch=3, layers=2)
        assert flops["attention"] == 3 * 2 * 2 * bench.HEADS * (512 + 64 + 512) * keys
        assert flops["logits"] == 3 * 2 * 2 * 64 * 128 * scored
        assert flops["gemm"] == 3 * 2 * prompt_len * bench.gemm_flops_per_token()
    meta = lambda kind, pid, name, tid=0: dict(ph="M", name=kind, pid=pid, tid=tid,  # noqa: E731
                                                args=dict(name=name))
    x = lambda name, dur, tid=14: dict(ph="X", pid=1, tid=tid, name=name, ts=0.0, dur=dur)  # noqa: E731
    _write_trace(tmp_path, [
        meta("process_name", 1, "/device:GPU:0"), meta("thread_name", 1, "Stream #14(Compute)", 14),
        meta("thread_name", 1, "XLA Ops", 2),
        x("void jax_sparse_mla::MqaLogitsKernel<...>", 10.0), x("TopKClusterKernel", 4.0),
        x("BatchMLAPageAttentionHopperKernel", 6.0), x("PackAndClamp", 1.0),
        x("nvjet_tst_256x128_64x4_2x1_v_bz_TNT", 20.0), x("loop_add_fusion", 3.0),
        x("custom-call.3", 99.0, tid=2),  # the op line repeats the kernels: not counted
    ])
    by_kind, top = bench.kernel_time_by_kind(str(tmp_path))
    assert by_kind == {"logits": 10.0, "top-k": 4.0, "attention": 7.0, "GEMMs": 20.0, "rest": 3.0}
    assert top[0] == ("nvjet_tst_256x128_64x4_2x1_v_bz_TNT", 20.0)


def test_bench_mixed_step_smoke(tmp_path):
    """bench_mixed_step's three steps on the tiny preset (wall times on the CPU): the JSON holds the
    decode, chunk and mixed rows and their sum apart."""
    import json

    run_benchmark("bench_mixed_step.py", "--preset", "tiny", "--decodes", "2", "--context", "200",
                  "--chunk", "64", "--layers", "1", "--calls", "1", "--kv-cache-dtypes", "auto",
                  "--out", str(tmp_path))
    (path,) = tmp_path.glob("mixed_step_*.json")
    (row,) = json.load(open(path))["rows"]
    assert row["decodes"] == 2 and row["kv_cache_dtype"] == "auto"
    for step in ("decode", "chunk", "mixed"):
        assert row[step]["us"] > 0 and row[step]["calls"] == 1
    assert row["apart"]["us"] == row["decode"]["us"] + row["chunk"]["us"]


def test_bench_ds_mla_workspace_smoke():
    """bench_ds_mla_workspace's two routes at a tiny shape in pure JAX: they agree and it runs."""
    assert "smoke OK" in run_benchmark("bench_ds_mla_workspace.py", "--smoke")


# ---- CUB's batched top-k beside ours (bench_indexer.py --cub, benchmarks/cub_topk.cu) -------------

_CUB_LINES = (
    "cub_topk mode=default rows=32 width=65536 k=2048 us=23.610 min_us=23.580 max_us=23.660 calls=50 "
    "check=ok ws_bytes=1\n"
    "cub_topk mode=ties_to_lower rows=32 width=65536 k=2048 us=23.810 min_us=23.790 max_us=23.880 "
    "calls=50 check=FAIL ws_bytes=1\n"
    "cub_topk mode=flashinfer_radix rows=32 width=65536 k=2048 us=19.420 min_us=19.400 "
    "max_us=19.500 calls=50 check=ok ws_bytes=1048576\n"
    "cub_topk mode=flashinfer_radix_deterministic rows=32 width=65536 k=2048 us=21.080 "
    "min_us=21.000 max_us=21.300 calls=50 check=FAIL ws_bytes=1048576\n")


def test_cub_result_lines_are_parsed():
    bench = _benchmark_module("bench_indexer")
    row = bench.parse_cub_line(_CUB_LINES.splitlines()[1])
    assert row == dict(mode="ties_to_lower", backend="cub_lower", rows=32, width=65536, k=2048,
                       us=23.81, min_us=23.79, max_us=23.88, calls=50, check="FAIL", ws_bytes=1)
    assert bench.parse_cub_line(_CUB_LINES.splitlines()[0])["backend"] == "cub"
    assert bench.parse_cub_line("cub_topk mode=ascending rows=1 width=8192 k=2048 us=9.5")["backend"] == (
        "cub_ascending")
    assert bench.parse_cub_line(_CUB_LINES.splitlines()[3]) == dict(
        mode="flashinfer_radix_deterministic", backend="fi_radix_det", rows=32, width=65536, k=2048,
        us=21.08, min_us=21.0, max_us=21.3, calls=50, check="FAIL", ws_bytes=1048576)
    assert bench.parse_cub_line(_CUB_LINES.splitlines()[2])["backend"] == "fi_radix"
    assert bench.parse_cub_line("building CUB's batched top-k: nvcc ...") is None
    assert bench.parse_cub_line("cub_topk: no shape given") is None


def test_every_cub_topk_mode_has_a_backend_name():
    """The modes cub_topk.cu runs (its kModes) are the ones CUB_BACKENDS names, each its own."""
    import re

    bench = _benchmark_module("bench_indexer")
    with open(os.path.join(BENCHMARKS, "cub_topk.cu")) as f:
        source = f.read()
    modes = re.search(r"kModes\[\] = \{([^}]*)\}", source)
    assert modes, "no kModes array in cub_topk.cu"
    assert re.findall(r'"(\w+)"', modes.group(1)) == list(bench.CUB_BACKENDS)
    assert len(set(bench.CUB_BACKENDS.values())) == len(bench.CUB_BACKENDS)


def test_cub_topk_is_built_with_flashinfer_headers(monkeypatch, tmp_path):
    """The nvcc command has the CCCL headers and FlashInfer's own (include/, for
    flashinfer/topk.cuh) of the data/ folder; a data/ folder without FlashInfer's top-k header is
    refused."""
    bench = _benchmark_module("bench_indexer")
    data = str(tmp_path / "data")
    command = bench.cub_compile_command("nvcc", data, "out")
    includes = [arg[2:] for arg in command if arg.startswith("-I")]
    assert includes == [os.path.join(data, "cccl", "cub"),
                        os.path.join(data, "cccl", "libcudacxx", "include"),
                        os.path.join(data, "cccl", "thrust"), os.path.join(data, "include")]
    assert command[-1] == bench.CUB_SOURCE and command[command.index("-o") + 1] == "out"
    cub_header = tmp_path / "data" / "cccl" / "cub" / "cub" / "device" / "device_batched_topk.cuh"
    cub_header.parent.mkdir(parents=True)
    cub_header.write_text("")
    monkeypatch.setenv("FLASHINFER_DATA_DIR", data)
    with pytest.raises(bench.CubUnavailable, match="no FlashInfer top-k"):
        bench.flashinfer_data_dir()
    topk_header = tmp_path / "data" / "include" / "flashinfer" / "topk.cuh"
    topk_header.parent.mkdir(parents=True)
    topk_header.write_text("")
    assert bench.flashinfer_data_dir() == data


def test_cub_rows_are_recorded_beside_ours(tmp_path):
    """bench_cub runs the program (here a stand-in printing canned lines) and records one topk row
    per mode, with its check; the side-by-side table shows them."""
    bench = _benchmark_module("bench_indexer")
    records = _benchmark_module("records")
    fake = tmp_path / "cub_topk"
    fake.write_text("#!/bin/sh\necho \"$@\" > " + str(tmp_path / "args") + "\nprintf '%s' '"
                    + _CUB_LINES + "'\nexit 3\n")
    fake.chmod(0o755)
    lines = []
    record = records.Recorder(lines.append)
    record.rows.append(dict(op="topk", backend="auto", B=32, context=65536, us=30.1))
    bench.bench_cub((str(fake), 50), record, "topk", "B=  32 L= 65536", 0, rows=32, width=65536,
                    calls=50, B=32, context=65536)
    assert (tmp_path / "args").read_text().split() == ["-k", "2048", "--calls", "50", "--inputs", "4",
                                                       "32x65536"]
    cub = [r for r in record.rows if "cub_mode" in r]
    assert [(r["backend"], r["cub_mode"], r["us"], r["check"], r["ws_bytes"]) for r in cub] == [
        ("cub", "default", 23.61, "ok", 1), ("cub_lower", "ties_to_lower", 23.81, "FAIL", 1),
        ("fi_radix", "flashinfer_radix", 19.42, "ok", 1048576),
        ("fi_radix_det", "flashinfer_radix_deterministic", 21.08, "FAIL", 1048576)]
    assert all(r["op"] == "topk" and r["B"] == 32 and r["context"] == 65536 for r in cub)
    failed = [line for line in lines if "differs from the host top-k" in line]
    assert len(failed) == 2
    assert "cub_lower (ties_to_lower)" in failed[0]
    assert "fi_radix_det (flashinfer_radix_deterministic)" in failed[1]
    lines.clear()
    bench.topk_table(record.rows, lines.append)
    assert lines[1].split() == ["B", "x", "L", "auto", "cub", "cub_lower", "fi_radix",
                                "fi_radix_det"]
    assert lines[2].split() == ["32", "x", "65536", "30.1", "23.6", "23.8", "19.4", "21.1"]
    assert len(lines[1]) == len(lines[2])  # columns as wide as their names


def test_cub_prefill_rows_use_the_causal_lengths(tmp_path):
    """On the prefill rows CUB runs with --causal (row i holds N - M + 1 + i positions, as ours) and
    its rows are recorded as prefill_topk rows of that M x N."""
    bench = _benchmark_module("bench_indexer")
    records = _benchmark_module("records")
    fake = tmp_path / "cub_topk"
    fake.write_text("#!/bin/sh\necho \"$@\" > " + str(tmp_path / "args") + "\necho 'cub_topk mode=ascending "
                    "rows=4096 width=65536 causal=1 k=2048 us=300.5 check=ok'\n")
    fake.chmod(0o755)
    record = records.Recorder(lambda line: None)
    bench.bench_cub((str(fake), 50), record, "prefill_topk", "M=4096 N= 65536", 0, rows=4096,
                    width=65536, calls=6, inputs=2, causal=True, B=1, context=65536, M=4096)
    assert (tmp_path / "args").read_text().split() == ["-k", "2048", "--calls", "6", "--inputs", "2",
                                                       "--causal", "4096x65536"]
    [row] = record.rows
    assert (row["op"], row["backend"], row["M"], row["context"], row["us"], row["check"]) == (
        "prefill_topk", "cub_ascending", 4096, 65536, 300.5, "ok")


def test_cub_is_skipped_without_nvcc(monkeypatch, tmp_path):
    bench = _benchmark_module("bench_indexer")
    monkeypatch.setattr(bench, "find_nvcc", lambda: None)
    with pytest.raises(bench.CubUnavailable, match="no nvcc"):
        bench.build_cub(str(tmp_path), print)
    monkeypatch.setenv("FLASHINFER_DATA_DIR", str(tmp_path))
    with pytest.raises(bench.CubUnavailable, match="no cub::DeviceBatchedTopK"):
        bench.flashinfer_data_dir()


def test_cub_topk_compiles_for_sm90a(tmp_path):
    """benchmarks/cub_topk.cu builds with nvcc for sm_90a against FlashInfer's CCCL headers, the
    command bench_indexer.py --cub runs (compile only: no GPU needed)."""
    bench = _benchmark_module("bench_indexer")
    if bench.find_nvcc() is None:
        pytest.skip("no nvcc")
    try:
        bench.flashinfer_data_dir()
    except bench.CubUnavailable as error:
        pytest.skip(f"no CCCL headers: {error}")
    binary = bench.build_cub(str(tmp_path), print)
    assert os.path.isfile(binary) and os.access(binary, os.X_OK)


def test_gpu_check_summary_puts_wall_beside_kernels_and_cub_beside_ours(tmp_path):
    """gpu-check's summary (what README's tables are read from): each decode shape's wall and kernel
    time and their ratio, auto against pure JAX per shape, and the top-k beside CUB's rows."""
    import json

    gpu_check = _benchmark_module("gpu_check")
    rows = [dict(op="topk", backend="auto", B=32, context=65536, us=24.7),
            dict(op="topk", backend="cub_lower", B=32, context=65536, us=23.9),
            dict(op="topk", backend="cub", B=32, context=65536, us=23.6),
            dict(op="topk", backend="cub_ascending", B=32, context=65536, us=27.1),
            dict(op="topk", backend="fi_radix", B=32, context=65536, us=19.4),
            dict(op="topk", backend="fi_radix_det", B=32, context=65536, us=21.2),
            dict(op="prefill_topk", backend="auto", B=1, context=65536, M=4096, us=850.0),
            dict(op="prefill_topk", backend="cub_lower", B=1, context=65536, M=4096, us=900.0),
            dict(op="prefill_topk", backend="cub", B=1, context=65536, M=4096, us=880.0),
            dict(op="prefill_topk", backend="cub_ascending", B=1, context=65536, M=4096, us=990.0),
            dict(op="prefill_topk", backend="fi_radix_det", B=1, context=65536, M=4096, us=870.0)]
    (tmp_path / "indexer_h100.json").write_text(json.dumps(dict(rows=rows)))
    state = dict(device="H100", minutes=1.0, steps={"example": dict(status=0, seconds=9)},
                 example=[dict(implementation="auto", batch=32, context=65536, status=0,
                               wall_ms=2.0, device_ms=1.6),
                          dict(implementation="xla", batch=32, context=65536, status=0,
                               wall_ms=8.0, device_ms=8.0),
                          dict(implementation="auto", batch=1, context=131072, status=1)])
    text = "\n".join(gpu_check.summary_lines(str(tmp_path), "h100", state))
    assert ("top-k (us; auto / CUB ties to the lower index / CUB default / CUB ties to the lower "
            "index, then sorted ascending / FlashInfer's top-k / FlashInfer's top-k, deterministic)"
            in text)
    assert "32 x  65536: 24.7 / 23.9 / 23.6 / 27.1 / 19.4 / 21.2\n" in text
    assert "prefill 4096 x  65536: 850.0 / 900.0 / 880.0 / 990.0 / - / 870.0\n" in text
    assert "32 x  65536 auto     2.00   1.60  1.25x    16,000" in text
    assert "1 x 131072 auto   failed (exit 1" in text
    assert "32 x 65536: auto / pure JAX 4.00x tokens/s (wall), 5.00x (kernels)" in text


def test_flashmla_anchor_rules():
    """FlashMLA's SM90 sparse kernels: heads padded to 64 or 128, K a multiple of 128 (bf16) or 64
    (fp8_ds_mla), caches it has kernels for; every index outside the cache becomes exactly -1."""
    import numpy as np

    anchor = _benchmark_module("flashmla_anchor")
    assert [anchor.padded_heads(h) for h in (1, 16, 64, 65, 128, 129)] == [64, 64, 64, 128, 128, None]
    assert anchor.why_not("bf16", 16, 2048) is None and anchor.why_not("fp8_ds_mla", 128, 2048) is None
    assert "multiple of 128" in anchor.why_not("bf16", 128, 2112)
    assert anchor.why_not("fp8_ds_mla", 128, 2112) is None
    assert "fp8" in anchor.why_not("fp8", 16, 2048)
    assert "at most 128" in anchor.why_not("bf16", 256, 2048)
    sets = np.array([[[0, 5, -3, 10], [9, -1, 11, 2]]], np.int32)  # [S=1, T=2, K=4], 10 rows
    np.testing.assert_array_equal(anchor.flashmla_indices(sets, 10)[:, :, 0],
                                  [[[0, 5, -1, -1], [9, -1, -1, 2]]])


def test_sm90_index_sets_share_regions_only_past_512_tokens():
    import numpy as np

    bench = _benchmark_module("bench_sm90")
    small = np.asarray(bench.index_sets(128))
    assert small.shape == (4, 128, bench.K)
    regions = small // bench.REGION_ROWS
    assert (regions == regions[..., :1]).all()  # a token's rows lie in one region
    assert len(np.unique(regions[..., 0])) == 4 * 128  # no region shared below 512 tokens
    large = np.asarray(bench.index_sets(1024))
    assert large.shape == (1, 1024, bench.K)
    np.testing.assert_array_equal(large[0, :512], large[0, 512:])  # tokens 512 apart share a region
