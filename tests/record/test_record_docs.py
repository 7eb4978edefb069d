"""The sample report in docs/record.md is the demo's own, regenerated here: it cannot go stale.

``KVVERIFY_UPDATE_DOCS=1 python -m pytest tests/record/test_record_docs.py`` writes the block anew
after a change to the demo or to the report; without it, a difference fails the test."""

from __future__ import annotations

import os
import re
from pathlib import Path

from fake_cuda import DemoDevice, FakeCuda

from kvverify.record import demo, recording

DOC = Path(__file__).resolve().parents[2] / "docs" / "record.md"
BEGIN, END = "<!-- sample-report:begin -->", "<!-- sample-report:end -->"
ROOT = str(Path(demo.__file__).resolve().parents[2])


def sample() -> str:
    """The report of the demo's ``load-no-wait`` form on the stand-in: its header, first race and
    summary, with addresses, the count of allocations seen and the checkout's path made
    independent of the run."""
    fake = FakeCuda()
    engine = demo.Engine(demo.Shape(), "load-no-wait", cuda=DemoDevice(fake))
    with recording(platform=fake, skip=fake.skip()) as rec:
        engine.run()
    lines = rec.report("python -m kvverify.record.demo --mistake load-no-wait").splitlines()
    second = next(i for i, line in enumerate(lines) if line.startswith("race 2:"))
    summary = next(i for i, line in enumerate(lines) if line.startswith("recorded "))
    kept = lines[:second] + ["..."] + lines[summary:]
    text = "\n".join(kept).replace(ROOT + os.sep, "")
    # how many allocations the map saw depends on where the CPU allocator put the demo's temporaries
    text = re.sub(r"buffers of \d+ allocations seen", "buffers of N allocations seen", text)
    return re.sub(r"0x[0-9a-f]{6,}", "0x...", text)


def test_the_sample_report_in_docs_record_md_is_the_demos():
    doc = DOC.read_text(encoding="utf-8")
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    block = f"\n```\n{sample()}\n```\n"
    if os.environ.get("KVVERIFY_UPDATE_DOCS") == "1":
        DOC.write_text(doc[:start] + block + doc[end:], encoding="utf-8")
    assert doc[start:end] == block, "docs/record.md's sample report is stale: rerun with KVVERIFY_UPDATE_DOCS=1"
