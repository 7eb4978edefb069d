"""What a corpus case is (``Case``) and what its native run saw (``Witness``): standard library only,
so that the corpus can be listed on any machine."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

FORMS = ("broken", "fixed")
CAPTURES = ("recorded", "native")
KINDS = ("RAW", "WAR", "WAW", "FREE")

# The classes of the corpus's races (docs/corpus.md, "The cases"): class -> what goes wrong.
HAZARDS = {
    "store-order": "a store that does not wait for compute, or reads its GPU source with ANY",
    "load-order": "a load not ordered after compute's zero-fill of fresh blocks",
    "block-reuse": "a block reused while another request's attention or a previous round still uses it",
    "worker-thread": "device work issued from a worker thread, host bookkeeping taken for device ordering",
    "release": "memory released (unmapped, evicted, freed) under in-flight copies",
    "host-write": "the host writing pinned memory that an H2D copy still reads",
    "forward-race": "a D2H copy on its own stream racing the forward pass",
    "polling": "completion learned by polling Event.query(): ordered only when it returned true",
}

PUBLIC_SOURCE = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)#(?P<number>\d+)$")
PUBLIC_URL = re.compile(r"^https://github\.com/(?P<repo>[\w.-]+/[\w.-]+)/(pull|issues)/(?P<number>\d+)$")
DEMO_SOURCE = "kvverify.record.demo"
FUNCTION_NAME = re.compile(r"^[A-Za-z_]\w*$")


@dataclass(frozen=True)
class Witness:
    """What the device did in one native run of a form: ``corrupted`` of ``total`` checked units
    (``unit``, "pages" unless a case says otherwise) did not hold what a correct run leaves there.
    ``note``: what qualifies the count (a form that was not run: ``total`` is 0 and the note says
    why; a run whose window could not open, such as an allocator that handed out other memory)."""

    corrupted: int
    total: int
    unit: str = "pages"
    note: str | None = None


@dataclass(frozen=True)
class Case:
    """One known race (of a public report, or of kvverify's demo), re-created in ``module`` in a
    broken and a fixed form.

    - ``name``: ``vllm-31341``; ``source``: ``owner/repo#N`` (or ``kvverify.record.demo`` for the
      demo's own forms); ``url``: the public report (or the docs page of the demo);
    - ``root_cause``: one line; ``hazard``: a key of ``HAZARDS``;
    - ``capture``: ``"recorded"`` when ``kvverify record`` sees the race today (torch's dispatcher
      and callbacks, the threads a recording follows, the cuda-python driver calls and ``os``
      reads it watches: docs/record.md), ``"native"`` when only native capture can; ``unseen``
      then says what a recording misses;
    - ``kind``: the race's kind in the checker's words (``KINDS``); ``pair``: the functions of
      ``module`` whose lines issue the first and the second racing op;
    - ``witness``: what the native run counts;
    - ``not_run``: why the broken form is never executed ("" when both forms run).

    Raises ValueError for a field outside its vocabulary.
    """

    name: str
    source: str
    url: str
    root_cause: str
    hazard: str
    capture: str
    kind: str
    pair: tuple[str, str]
    witness: str
    module: str
    unseen: str = ""
    not_run: str = ""

    def __post_init__(self) -> None:
        problems = []
        if self.hazard not in HAZARDS:
            problems.append(f"hazard {self.hazard!r} is none of {', '.join(HAZARDS)}")
        if self.capture not in CAPTURES:
            problems.append(f"capture {self.capture!r} is none of {', '.join(CAPTURES)}")
        if self.kind not in KINDS:
            problems.append(f"kind {self.kind!r} is none of {', '.join(KINDS)}")
        if len(self.pair) != 2 or not all(FUNCTION_NAME.match(f) for f in self.pair):
            problems.append(f"pair {self.pair!r} must name two functions")
        if (self.capture == "native") != bool(self.unseen):
            problems.append("a native case says what a recording misses (unseen), a recorded case does not")
        if problems:
            raise ValueError(f"case {self.name}: " + "; ".join(problems))

    @property
    def file(self) -> str:
        """The case module's file name, as a recorded op's ``at`` shows it (``vllm_31341.py``)."""
        return self.module.rsplit(".", 1)[-1] + ".py"

    def run(self, form: str) -> Witness:
        """Run ``form`` (``"broken"`` or ``"fixed"``) natively on ``cuda:0``: the case module's
        ``run``. Needs torch with a CUDA device and ``kvverify._C``; raises ValueError for an
        unknown form."""
        if form not in FORMS:
            raise ValueError(f"unknown form {form!r}; use one of {', '.join(FORMS)}")
        return importlib.import_module(self.module).run(form)
