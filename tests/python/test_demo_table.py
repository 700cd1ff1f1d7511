"""The demo's table marks a mode another mode beat on both peak memory and step time (pure
logic over fabricated rows: this tests the marking, not measurements), and the demo runs end to
end on the SDPA model at its tiny size."""

import json

import torch

from spillover.demo import _table, dominated, main


def _row(mode, step_seconds, peak_mib):
    return {
        "mode": mode, "step_seconds": step_seconds, "peak_bytes": int(peak_mib * 2**20),
        "prefetch_hits": 0, "prefetch_misses": 0, "uses_context": False,
        "bytes_offloaded_host": 0, "bytes_offloaded_nvme": 0, "stall_seconds": 0.0,
        "check": "✓ identical",
    }


ROWS = [
    _row("none", 1.0, 400),       # fastest, most memory: not dominated
    _row("full", 1.4, 100),       # least memory: not dominated
    _row("selective", 1.2, 150),  # between the two on both: not dominated
    _row("nvme", 1.5, 200),       # slower and bigger than selective (and full): dominated
    _row("host", 1.2, 300),       # ties selective's time: not strictly beaten
    _row("adamw", 1.04, 404),     # within the margins of none (noise): not beaten
]


def test_dominated_names_a_mode_beaten_on_both_counts():
    assert dominated(ROWS) == {"nvme": "full"}  # the first of its dominators in table order


def test_ties_and_trade_offs_are_not_dominated():
    assert dominated(ROWS[:3]) == {}
    assert dominated([_row("a", 1.0, 100), _row("b", 1.0, 100)]) == {}
    # more by less than the margins (1 % of peak, 5 % of time) is not "more"
    assert dominated([_row("a", 1.0, 100), _row("b", 1.049, 100.9)]) == {}
    assert dominated([_row("a", 1.0, 100), _row("b", 1.06, 102)]) == {"b": "a"}
    # A negative peak (RSS fell during the step) is shown, and compared, as zero.
    assert dominated([_row("a", 1.0, 0), _row("b", 2.0, 0) | {"peak_bytes": -5}]) == {}


def test_table_shows_the_marker_and_a_footnote():
    table = _table(ROWS, torch.device("cpu"))
    lines = table.splitlines()
    assert "dominated by" in lines[0]
    rows = {line.split()[0]: line for line in lines[2:len(ROWS) + 2]}
    assert rows["nvme"].rstrip().endswith("full")
    for mode in ("none", "full", "selective", "host"):
        assert rows[mode].rstrip().endswith("-"), rows[mode]
    assert lines[-1].startswith("dominated by X:") and "nvme: full" in lines[-1]


def test_no_footnote_when_nothing_is_dominated():
    table = _table(ROWS[:3], torch.device("cpu"))
    assert "dominated by X" not in table


def test_demo_runs_on_sdpa_and_records_the_marking(tmp_path, capsys):
    """End to end at the tiny size: --attn reaches the model, the JSON says what was marked."""
    assert main(["--size", "tiny", "--attn", "sdpa", "--modes", "none,full,auto", "--steps", "2",
                 "--device", "cpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "sdpa attention" in out and "dominated by" in out
    with open(tmp_path / "results.json") as f:
        res = json.load(f)
    assert res["model"]["attn"] == "sdpa"
    assert res["dominated_by"] == dominated(res["rows"])
    # the picture's inputs: each mode's forward end inside its measured step, and a predicted
    # curve per mode (spillover.estimate ran for none, full and auto)
    for r in res["rows"]:
        assert 0 < r["marks"]["forward"] < r["marks"]["backward"]
        assert r["marks"]["backward"] <= r["timeline"][-1][0] + 1e-6
    assert "predicted each mode's memory" in out and "no predicted curve" not in out
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_predicted_curve_drawn_on_the_measured_clock():
    """Forward onto forward, backward onto backward; a curve without marks is left as it is."""
    from spillover.demo_plot import _stretch

    curve = [(0.0, 0), (1.0, 10), (2.0, 20), (4.0, 5)]
    out = _stretch(curve, {"forward": 2.0, "backward": 4.0}, {"forward": 0.5, "backward": 1.5})
    assert out == [(0.0, 0), (0.25, 10), (0.5, 20), (1.5, 5)]
    assert _stretch(curve, {}, {"forward": 0.5, "backward": 1.5}) == curve
