"""bench/train_speed.py: both timings (forward+backward inside the full step), the round-by-round ratios with
their range, and an engine that fails reported with its reason while the others are measured."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("train_speed", ROOT / "bench" / "train_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rows_hold_both_timings_and_paired_ratios(monkeypatch, capsys):
    bench = _bench()
    monkeypatch.setitem(bench.SHAPES, "small", (2, 16))   # a few-millisecond step
    res = bench.run_preset("small", ["ours", "eager"], steps=3, warmup=1, log=lambda msg: None, pause=0)
    assert res["failed"] == {}
    ours, eager = res["engines"]["ours"], res["engines"]["eager"]
    for row in (ours, eager):
        assert len(row["times"]) == len(row["fb_times"]) == 3
        assert all(0 < fb < full for fb, full in zip(row["fb_times"], row["times"]))   # AdamW comes after
        assert row["full"]["min_s"] <= row["full"]["median_s"] <= row["full"]["max_s"]
        assert row["fb_tokens_per_s"] > row["tokens_per_s"] and 0 < row["mfu"] < row["fb_mfu"]
    ratios = [e / o for o, e in zip(ours["times"], eager["times"])]
    assert eager["ours_over_this"]["full"] == {"median": sorted(ratios)[1], "min": min(ratios), "max": max(ratios)}
    assert ours["ours_over_this"] is None and abs(ours["first_loss"] - eager["first_loss"]) < 1e-4
    bench.print_table([res])
    out = capsys.readouterr().out
    assert "fwd+bwd ms" in out and "eager" in out


def test_a_failing_engine_is_reported_with_its_reason(monkeypatch, capsys):
    bench = _bench()
    monkeypatch.setitem(bench.SHAPES, "small", (1, 200))   # longer than small's context: every engine fails
    res = bench.run_preset("small", ["ours"], steps=2, warmup=1, log=lambda msg: None, pause=0)
    assert res["engines"] == {} and "ours" in res["failed"]
    assert "UserError" in res["failed"]["ours"] and "200" in res["failed"]["ours"]
    bench.print_table([res])
    assert "ours         did not run: UserError" in capsys.readouterr().out
