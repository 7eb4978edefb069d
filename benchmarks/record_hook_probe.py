"""A feasibility probe for the recorder's next hook: what a C++ op observer costs per op, against
the pass-through ``TorchDispatchMode`` that bounds today's recorder (docs/record.md, "Overhead").

    python benchmarks/record_hook_probe.py                 # CPU tensors: the host's cost per op
    python benchmarks/record_hook_probe.py --device cuda   # CUDA tensors, with the current stream

It compiles (``torch.utils.cpp_extension.load_inline``, a minute on first use) a thread-local
``at::RecordFunction`` start/end callback pair that appends, for every op the dispatcher calls, what
the recorder needs from it to a flat log: the op's name, each tensor argument and output as (data
pointer, bytes, device), the device's current stream, and the innermost frame of the user's code as
(code object, last instruction), found by walking the Python stack past frames whose file a Python
predicate calls library code (asked once per code object). Python would turn that log into trace
ops after the program, not per op. It then times ``layer[0:8].fill_(1)`` over 32 tensors (a view
and an in-place op, two dispatcher calls), CPU time, best of ``--repeats``:

- plain; under a dispatch mode that only calls the op (today's floor);
- under the C++ observer without frames, and with them;
- under the observer in its forwarding mode: no log; each outermost op goes to a Python function
  (that does nothing) at its end, its inputs and outputs as Python objects: what an observer that
  calls the recorder's existing handlers would pay before they run;
- under the real recorder (``kvverify.record.recording``), on CUDA only.

On CUDA it then runs the recorder's engine-style loop (``benchmarks/bench_record.py``'s two loads,
32 layers, 16 transfers in flight, ``--loop-steps`` steps) plain, under the pass-through mode and
under the observer with frames, in turn, and prints medians in ms per step: the floor a recorder
built on the observer would start from. It also checks the log: the fill's tensor at the view's
address and size, its frame in this file, and that a replay of the log keeps the ops a dispatch
mode sees (``replay_keeps``) over a few kinds of op (composite, with inner calls, views, in
place, composite on one backend only), and that the forwarding mode hands over the fill with its
live view and value. It prints microseconds per fill. Not a test, and not the product: the observer here
records, it does not resolve allocations or write a trace.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_record import engine_shapes, pass_through_mode, time_loop  # noqa: E402

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/record_function.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <Python.h>
#include <exception>
#include <frameobject.h>
#include <unordered_map>
#include <vector>

namespace {

// One flat log of 64-bit words per thread, an entry at each op's start and end (nested ops interleave):
// start: [1, name, overload, n, (ptr, bytes, device) * n, stream, code, lasti]
// end:   [2, name, overload, n, (ptr, bytes, device) * n, stream]
thread_local std::vector<uint64_t> log_words;
std::unordered_map<PyObject*, bool> is_library;  // code object -> its file is library code
PyObject* library_predicate = nullptr;
bool want_frames = false;
at::CallbackHandle handle = 0;
// With forward_to set nothing is logged: each outermost op goes to Python at its end, with its
// inputs (held from its start: RecordFunction shows them only there) and outputs as Python
// objects; the ops inside it, and those Python issues meanwhile, are skipped.
PyObject* forward_to = nullptr;
thread_local int depth = 0;
thread_local bool forwarding = false;

struct Held : at::ObserverContext {
  std::vector<c10::IValue> inputs;
};

void append_tensor(const at::Tensor& t, uint64_t& n, int64_t& device) {
  if (!t.defined() || !t.has_storage()) return;
  log_words.push_back(reinterpret_cast<uint64_t>(t.const_data_ptr()));
  log_words.push_back(static_cast<uint64_t>(t.nbytes()));
  auto d = t.device();
  log_words.push_back((static_cast<uint64_t>(d.type()) << 8) | static_cast<uint8_t>(d.index()));
  if (d.is_cuda() && device < 0) device = d.index();
  ++n;
}

void append_values(const c10::IValue* values, size_t count) {
  size_t count_at = log_words.size();
  log_words.push_back(0);
  uint64_t n = 0;
  int64_t device = -1;
  for (size_t k = 0; k < count; ++k) {
    const c10::IValue& v = values[k];
    if (v.isTensor()) {
      append_tensor(v.toTensor(), n, device);
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) append_tensor(t, n, device);
    }
  }
  log_words[count_at] = n;
  uint64_t stream = 0;
  if (device >= 0) {
    auto impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    stream = static_cast<uint64_t>(impl->getStream(c10::Device(c10::DeviceType::CUDA, device)).id());
  }
  log_words.push_back(stream);
}

void append_frame() {
  if (!want_frames) return;
  PyGILState_STATE gil = PyGILState_Ensure();
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  uint64_t code_word = 0, lasti = 0;
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    auto found = is_library.find(reinterpret_cast<PyObject*>(code));
    bool library;
    if (found == is_library.end()) {
      PyObject* r = PyObject_CallOneArg(library_predicate, code->co_filename);
      library = r == nullptr || PyObject_IsTrue(r);
      Py_XDECREF(r);
      PyErr_Clear();
      Py_INCREF(code);  // the map holds it: its address names no other code object meanwhile
      is_library.emplace(reinterpret_cast<PyObject*>(code), library);
    } else {
      library = found->second;
    }
    if (!library) {
      code_word = reinterpret_cast<uint64_t>(code);
      lasti = static_cast<uint64_t>(PyFrame_GetLasti(frame));
      Py_DECREF(code);
      break;
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  PyGILState_Release(gil);
  log_words.push_back(code_word);
  log_words.push_back(lasti);
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (forward_to != nullptr) {
    if (forwarding || depth++ > 0) return nullptr;
    auto held = std::make_unique<Held>();
    auto inputs = fn.inputs();
    held->inputs.assign(inputs.begin(), inputs.end());
    return held;
  }
  log_words.push_back(1);
  log_words.push_back(reinterpret_cast<uint64_t>(fn.name()));
  log_words.push_back(reinterpret_cast<uint64_t>(fn.overload_name()));
  auto inputs = fn.inputs();
  append_values(inputs.data(), inputs.size());
  append_frame();
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* context) {
  if (forward_to != nullptr) {
    if (forwarding) return;
    --depth;
    if (context == nullptr || std::uncaught_exceptions() > 0) return;  // a failed op ran nothing to record
    py::gil_scoped_acquire gil;
    forwarding = true;
    try {
      py::list inputs, outputs;
      for (const auto& v : static_cast<Held*>(context)->inputs) inputs.append(torch::jit::toPyObject(v));
      for (const auto& v : fn.outputs()) outputs.append(torch::jit::toPyObject(v));
      py::handle call(forward_to);
      call(py::str(fn.name()), inputs, outputs);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("the observer's Python call");
    }
    forwarding = false;
    return;
  }
  log_words.push_back(2);
  log_words.push_back(reinterpret_cast<uint64_t>(fn.name()));
  log_words.push_back(reinterpret_cast<uint64_t>(fn.overload_name()));
  const auto& outputs = fn.outputs();
  append_values(outputs.data(), outputs.size());
}

}  // namespace

void start(py::object predicate, bool frames, py::object forward) {
  TORCH_CHECK(handle == 0, "the observer is already on");
  Py_XDECREF(library_predicate);
  library_predicate = predicate.release().ptr();
  want_frames = frames;
  Py_XDECREF(forward_to);
  forward_to = forward.is_none() ? nullptr : forward.release().ptr();
  depth = 0;
  log_words.clear();
  handle = at::addThreadLocalCallback(at::RecordFunctionCallback(on_start, on_end)
                                          .needsInputs(true)
                                          .needsOutputs(true)
                                          .scopes({at::RecordScope::FUNCTION}));
}

py::bytes stop() {
  TORCH_CHECK(handle != 0, "the observer is off");
  at::removeCallback(handle);
  handle = 0;
  py::bytes log(reinterpret_cast<const char*>(log_words.data()), log_words.size() * sizeof(uint64_t));
  log_words.clear();
  return log;
}

py::object op_name(uint64_t word) { return py::str(reinterpret_cast<const char*>(word)); }

py::object code_object(uint64_t word) {
  return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(word));
}
"""


def build(build_directory: Path | None = None):
    """The observer, compiled into ``build_directory`` (None: torch's cache, ~/.cache/torch_extensions)."""
    from torch.utils.cpp_extension import load_inline

    # NDEBUG as libtorch's own build: RecordFunction's debug-only checks read a flag only a debug
    # libtorch sets
    return load_inline("kvverify_record_hook_probe", cpp_sources=SOURCE, extra_cflags=["-O2", "-DNDEBUG"],
                       functions=["start", "stop", "op_name", "code_object"], verbose=False,
                       build_directory=None if build_directory is None else str(build_directory))


def decode(ext, blob: bytes, frames: bool) -> list[dict]:
    """The log as one dict per entry: "start" or "end", the op's name, its tensors (inputs at the
    start, outputs at the end) as (address, bytes, device word), the stream id, and at the start the
    user's frame as "file:line" (None without frames or where none was found)."""
    import numpy as np

    words = np.frombuffer(blob, dtype=np.uint64).tolist()
    entries, k = [], 0
    while k < len(words):
        tag, name, overload, n = words[k:k + 4]
        if tag not in (1, 2) or 3 * n > len(words) - k:
            raise ValueError(f"the observer's log is malformed at word {k}")
        k += 4
        overload = str(ext.op_name(overload))
        entry = {"kind": "start" if tag == 1 else "end",
                 "name": str(ext.op_name(name)) + (f".{overload}" if overload else ""),
                 "tensors": [tuple(words[k + 3 * j:k + 3 * j + 3]) for j in range(n)]}
        k += 3 * n
        entry["stream"] = words[k]
        k += 1
        if tag == 1 and frames:
            code, lasti = words[k], words[k + 1]
            k += 2
            entry["at"] = None
            if code:
                c = ext.code_object(code)
                line = next((ln for start, end, ln in c.co_lines() if start <= lasti < end), None)
                entry["at"] = f"{Path(c.co_filename).name}:{line}"
        entries.append(entry)
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=300, help="fills of each of the 32 tensors per timing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loop-steps", type=int, default=100, help="steps of the engine loop (CUDA only; 0: none)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--build-dir", type=Path, help="compile the observer here (default: torch's extension cache)")
    args = parser.parse_args(argv)

    import torch

    from kvverify.record.capture.frames import Locator

    if args.build_dir is not None:
        args.build_dir.mkdir(parents=True, exist_ok=True)
    ext = build(args.build_dir)
    locator = Locator()
    library = locator._library  # the recorder's own rule for which files are library code
    layers = [torch.zeros(96, 16, device=args.device) for _ in range(32)]

    def fills() -> None:
        for layer in layers:
            layer[0:8].fill_(1)  # <- probe fill

    def per_fill() -> float:
        fills()  # warm-up
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.process_time()
        for _ in range(args.steps):
            fills()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return (time.process_time() - start) / args.steps / len(layers) * 1e6

    def recorded() -> float:
        from kvverify.record import recording
        with recording():
            return per_fill()

    cases = {"plain": per_fill, "pass-through mode": lambda: _under(pass_through_mode()(), per_fill),
             "C++ observer": lambda: _under(Observed(ext, library, frames=False), per_fill),
             "C++ observer + user frame": lambda: _under(Observed(ext, library), per_fill),
             "C++ observer -> Python per op": lambda: _under(Observed(ext, library, False, _forwarded), per_fill)}
    if args.device == "cuda":
        cases["kvverify record (today)"] = recorded
    best = {name: float("inf") for name in cases}
    for _ in range(args.repeats):  # in turn: a busy host slows all of them alike
        for name, run in cases.items():
            best[name] = min(best[name], run())

    # What the observer logged is what the recorder needs: check it once, small.
    with Observed(ext, library) as observed:
        layers[3][0:8].fill_(1)  # <- checked fill
    entries = decode(ext, observed.log, frames=True)
    names = [e["name"] for e in entries if e["kind"] == "start"]
    fill = next(e for e in entries if e["kind"] == "start" and e["name"] == "aten::fill_.Scalar")
    view_address = layers[3][0:8].data_ptr()
    # The ops a replay of the log keeps, against those a dispatch mode sees, over a few op kinds:
    # composite (linear, reshape, to), with inner calls (sum, _to_copy, addmm), views, in place, and
    # one composite with a CPU kernel of its own (native_channel_shuffle: whole on the CPU,
    # decomposed on CUDA).
    weight, bias = torch.zeros(16, 16, device=args.device), torch.zeros(16, device=args.device)

    def mixed(layer):
        layer[0:8].fill_(1)
        layer.to(torch.float64)
        torch.nn.functional.linear(layer, weight, bias)
        layer.zero_()
        torch.sum(layer, dim=0)
        layer.reshape(-1).add_(1)
        torch.native_channel_shuffle(layer.view(1, 96, 4, 4), 2)

    forwarded = []
    with Observed(ext, library, False, lambda name, inputs, outputs: forwarded.append((name, inputs, outputs))):
        layers[5][0:8].fill_(2)
    fill_call = forwarded[-1] if forwarded else ("", [], [])
    live = (len(fill_call[1]) == 2 and isinstance(fill_call[1][0], torch.Tensor) and fill_call[1][1] == 2
            and fill_call[1][0].data_ptr() == layers[5][0:8].data_ptr() and fill_call[2][0] is fill_call[1][0])

    seen = []
    with _Seeing(seen):
        mixed(layers[4])
    with Observed(ext, library, frames=False) as observed:
        mixed(layers[4])
    kept = replay_keeps(decode(ext, observed.log, frames=False))
    checks = {
        "ops": names,
        "fill at the view's address": fill["tensors"][0][0] == view_address,
        "fill bytes": fill["tensors"][0][1] == 8 * 16 * 4,
        "fill located": fill["at"],
        "stream logged": fill["stream"] if args.device == "cuda" else None,
        "dispatch mode sees": seen,
        "replay keeps": kept,
        "forwarded": [name for name, _, _ in forwarded],
        "forwarded fill has its live view and value": live,
    }
    ok = ("aten::slice.Tensor" in names and checks["fill at the view's address"] and checks["fill bytes"]
          and fill["at"] == f"{Path(__file__).name}:{_line_of('# <- checked fill')}" and kept == seen
          and checks["forwarded"] == ["aten::slice", "aten::fill_"] and live)

    plain = best["plain"]
    print(f"per layer[0:8].fill_(1) on {args.device}, CPU time, best of {args.repeats} x {args.steps} x 32:")
    for name, us in best.items():
        print(f"  {name:28s} {us:6.2f} us  (+{us - plain:5.2f} over plain)")
    loops = {}
    if args.device == "cuda" and args.loop_steps:
        loops = engine_loops(ext, library, args.loop_steps, args.repeats)
        for load, ms in loops.items():
            shown = ", ".join(f"{how} {v:.2f}" + ("" if how == "plain" else f" ({v / ms['plain']:.2f}x)")
                              for how, v in ms.items())
            print(f"engine loop, {load}: ms/step, median of {args.repeats}: {shown}")
    print(f"log check: {'ok' if ok else 'FAILED'} {json.dumps(checks)}")
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "torch": torch.__version__,
                                         "per_fill_us": best, "loop_ms_per_step": loops, "log_check": checks,
                                         "ok": ok}, indent=2))
    return 0 if ok else 1


BACKENDS = {0: "CPU", 1: "CUDA"}  # c10::DeviceType, as the log's device word carries it above its index


def decomposed(name: str, device_word: int | None) -> bool:
    """Whether torch decomposes op ``name`` above the dispatch mode for tensors of that device: it
    has a ``CompositeImplicitAutograd`` kernel and neither a kernel for the tensors' backend nor a
    ``CompositeExplicitAutograd`` one (the dispatcher's rule for filling the Autograd keys)."""
    import torch

    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    if not has_kernel(name, "CompositeImplicitAutograd"):
        return False
    backend = BACKENDS.get(device_word >> 8) if device_word is not None else None
    return not has_kernel(name, "CompositeExplicitAutograd") and not (backend and has_kernel(name, backend))


def replay_keeps(entries: list[dict]) -> list[str]:
    """The ops of a decoded log that a recorder on the observer would record: of each call tree, the
    outermost calls that torch does not decompose (``decomposed``), which is what a
    ``TorchDispatchMode`` sees (composites decompose above it; a kernel's inner calls run with the
    mode popped)."""
    kept, under_kept = [], []  # per open call: it or a call around it is kept
    for e in entries:
        if e["kind"] == "end":
            under_kept.pop()
            continue
        around = bool(under_kept) and under_kept[-1]
        keep = not around and not decomposed(e["name"], e["tensors"][0][2] if e["tensors"] else None)
        if keep:
            kept.append(e["name"])
        under_kept.append(around or keep)
    return kept


class _Seeing:
    """A dispatch mode that appends each op's name to ``seen`` as the observer's log names it
    (``aten::fill_.Scalar``; the default overload unnamed)."""

    def __new__(cls, seen: list):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Seeing(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func._schema.name + (f".{func._overloadname}" if func._overloadname != "default" else "")
                seen.append(name)
                return func(*args, **(kwargs or {}))

        return Seeing()


class Observed:
    """The observer on this thread while the block runs: logging (with the user's frame where
    ``frames``), or, given ``forward``, calling it per outermost op; ``log``: the log's bytes."""

    def __init__(self, ext, library, frames: bool = True, forward=None) -> None:
        self.ext, self.library, self.frames, self.forward = ext, library, frames, forward
        self.log = b""

    def __enter__(self) -> Observed:
        self.ext.start(self.library, self.frames, self.forward)
        return self

    def __exit__(self, *exc) -> None:
        self.log = self.ext.stop()


def engine_loops(ext, library, steps: int, repeats: int) -> dict:
    """Median ms per step of each engine-style load, plain, under the pass-through mode and under
    the observer."""
    import contextlib
    import dataclasses
    import statistics

    contexts = {"plain": contextlib.nullcontext, "pass-through mode": pass_through_mode(),
                "C++ observer + user frame": lambda: Observed(ext, library)}
    out = {}
    for load, shape in engine_shapes(steps=steps).items():
        for make in contexts.values():
            time_loop(dataclasses.replace(shape, steps=3), make())  # warm-up
        seconds = {how: [] for how in contexts}
        for _ in range(repeats):  # in turn: a busy host slows each of them alike
            for how, make in contexts.items():
                seconds[how].append(time_loop(shape, make()))
        out[load] = {how: statistics.median(s) / steps * 1e3 for how, s in seconds.items()}
    return out


def _forwarded(name: str, inputs: list, outputs: list) -> None:
    """What the observer calls per outermost op in its forwarding mode: nothing more, so that the
    figure is the bridge's own cost (GIL, the arguments as Python objects, the call)."""


def _under(context, run):
    with context:
        return run()


def _line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(k for k, line in enumerate(lines, 1) if marker in line and "_line_of" not in line)


if __name__ == "__main__":
    raise SystemExit(main())
