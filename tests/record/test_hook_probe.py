"""The C++ op observer probe (``benchmarks/record_hook_probe.py``) on this host: it compiles against the
installed torch, the log it keeps holds what the recorder would need (the view's address and
bytes, the user's line), and a replay of it keeps the ops a dispatch mode sees. Its timings are
printed, not judged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_probe_logs_the_fill_with_its_address_and_line(tmp_path):
    out = tmp_path / "probe.json"
    # built under tmp_path, not in torch's cache under the home folder: a test leaves nothing behind
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "record_hook_probe.py"), "--repeats", "1",
                        "--steps", "3", "--json", str(out), "--build-dir", str(tmp_path / "build")],
                       capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    figures = json.loads(out.read_text())
    assert figures["ok"] is True
    check = figures["log_check"]
    assert check["ops"][0] == "aten::slice.Tensor" and check["ops"][-1] == "aten::fill_.Scalar"
    # a replay of the log keeps what a dispatch mode sees: composites dropped, inner calls too
    assert check["replay keeps"] == check["dispatch mode sees"]
    assert "aten::addmm" in check["replay keeps"] and "aten::linear" not in check["replay keeps"]
    assert "aten::native_channel_shuffle" in check["replay keeps"]  # composite, but with a CPU kernel
    assert check["fill at the view's address"] is True and check["fill bytes"] is True
    assert check["fill located"].startswith("record_hook_probe.py:")
    assert check["forwarded"] == ["aten::slice", "aten::fill_"]  # the outermost ops only, not as_strided
    assert check["forwarded fill has its live view and value"] is True
    assert set(figures["per_fill_us"]) == {"plain", "pass-through mode", "C++ observer", "C++ observer + user frame",
                                           "C++ observer -> Python per op"}
    assert all(us > 0 for us in figures["per_fill_us"].values())
    assert "log check: ok" in p.stdout
