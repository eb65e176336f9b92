"""The benchmarks' shared parts on the CPU, so that a GPU run does not meet a broken script: the
indexer benchmark's code paths on tiny shapes (pure JAX), the device-time reader on a synthetic
profiler trace, result names and the copy-ceiling check."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def test_bench_indexer_smoke():
    result = subprocess.run([sys.executable, "-P", os.path.join(BENCHMARKS, "bench_indexer.py"),
                             "--smoke"], capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                filter(None, [BENCHMARKS, os.environ.get("PYTHONPATH")]))))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "smoke OK" in result.stdout


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
