// The op log (kvverify/record/capture/oplog.py reads it): every op the recording thread calls
// through torch's dispatcher, written into the native log (native_log.h) at the call, as the facts
// the recorder's handlers need, so that the program pays a callback per op and the handlers run
// after it, in the log's order.
//
// A thread-local at::RecordFunction observer (the hook torch's profiler uses) sees every
// dispatcher call, the ops inside other ops too. It keeps what a TorchDispatchMode sees: of each
// call tree, the outermost calls that torch does not decompose above the dispatch mode (the
// recorder's Python classifier says, once per op and backend: "transparent" for a composite it
// decomposes, "swallow" for an op that touches nothing, "log" for the rest). A kept op writes
// `op_begin` at its start and, at its end, `op` (its facts) or `op_failed` (it raised): the
// recorder holds back what it reports meanwhile until the op is logged, as it does live.
//
// An `op` record's fields: id, device, stream (the current device and its current stream, where
// the classifier asks for them; else -1, 0), then the inputs and the outputs, each a count and its
// values. A value is tagged:
//   0 none (or a value the handlers do not read: a string, a device, a dtype list)
//   1 tensor: device type, device index, scalar type, flags, data pointer, covering span start,
//     covering span bytes, storage data pointer, storage bytes, numel, version, stream handle of its
//     device (0: not a CUDA tensor), nvalues (-1: not logged), values...
//   2 int, 3 bool, 4 double (its bits), 5 tensor list (a count, then tensors), 6 stream (handle, device),
//   7 a tensor that is not strided memory (sparse, nested): the recorder says it did not see the op
// Values of int64 tensors are logged where the classifier asks: every CPU input (its contents at the
// call, which the program may rewrite right after it), and the CUDA inputs at the positions it
// names (read back on the current stream: a batched swap's pointer tables).
// The user's frame is the innermost whose code the Python predicate does not call library code
// (asked once per code object); it is the record's one frame.

#include <ATen/Context.h>
#include <ATen/record_function.h>
#include <Python.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <dlfcn.h>
#include <pthread.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "native_log.h"

// Outside the limited API the extension is built against (3.10), in every CPython since 3.9.
extern "C" PyFrameObject* PyFrame_GetBack(PyFrameObject* frame);

namespace kvverify::native {
namespace {

enum Class : int64_t { kTransparent = 0, kSwallow = 1, kLog = 2 };
enum Flags : int64_t { kCpuValues = 1, kCurrentStream = 2 };
enum Tag : int64_t { kNone = 0, kTensor = 1, kInt = 2, kBool = 3, kDouble = 4, kList = 5, kStream = 6, kOpaque = 7 };
enum TensorFlags : int64_t { kContiguous = 1, kPinned = 2, kVersioned = 4 };
constexpr int64_t kMaxValues = int64_t{1} << 22;  // int64 tensors longer than this are not copied
// Past this many records of its thread not taken, the next op first has the recorder log what the log holds (a
// pause of the program, but a log of bounded size in a long one).
constexpr int64_t kFlushRecords = int64_t{1} << 18;

struct OpClass {
  int64_t cls = kTransparent;
  int64_t id = 0;
  int64_t flags = 0;
  uint64_t cuda_values = 0;  // input positions whose CUDA int64 values are read back
};

struct Key {
  const char* name;
  const char* overload;
  int backend;
  bool operator==(const Key& o) const { return name == o.name && overload == o.overload && backend == o.backend; }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    return std::hash<const void*>()(k.name) ^ (std::hash<const void*>()(k.overload) << 1) ^ (size_t(k.backend) << 7);
  }
};

PyObject* classifier = nullptr;  // (name, overload, backend) -> (class, id, flags, cuda_values)
PyObject* is_library = nullptr;  // (code) -> bool
PyObject* flush = nullptr;       // () -> None: the recorder logs what the log holds
std::unordered_map<Key, OpClass, KeyHash> classes;
std::unordered_map<PyObject*, bool> library_codes;           // code -> library; holds the code
std::unordered_map<uint64_t, int> lines;                     // (code, lasti) -> line
std::string failure;
at::CallbackHandle handle = 0;
uint64_t owner = 0;  // the thread the observer is on
thread_local int depth = 0;  // this thread's depth in kept ops
thread_local int quiet = 0;  // the recorder's own work: nothing is logged
std::atomic<int64_t> elsewhere{0};  // ops of other threads the callback reached (autograd's): not logged
// A frame's line from its last instruction, cached per call site (CPython 3.11+; found at run time, since
// the extension's ABI is 3.10's); else PyFrame_GetLineNumber, which walks the line table every time.
using LastiFn = int (*)(PyFrameObject*);
using Addr2LineFn = int (*)(PyObject*, int);
const LastiFn frame_lasti = reinterpret_cast<LastiFn>(dlsym(RTLD_DEFAULT, "PyFrame_GetLasti"));
const Addr2LineFn addr2line = reinterpret_cast<Addr2LineFn>(dlsym(RTLD_DEFAULT, "PyCode_Addr2Line"));

// One open dispatcher call of this thread: a stack of them, reused (no allocation per op). A deque:
// the observer calls Python at an op's start (the classifier, the frame predicate), where the
// collector may run a finalizer that calls ops of its own, pushing calls on top of the one being
// written down; a deque's elements stay where they are as it grows.
struct Open {
  enum : int { kNotSeen, kInside, kKept } state = kNotSeen;  // kInside: a call inside a kept op
  OpClass op;
  int64_t device = -1, stream = 0;
  std::vector<int64_t> frames;
  std::vector<int64_t> inputs;
  bool unwritten = false;  // the observer failed on it: logged with id -1
  int64_t t0 = 0;          // when its call began (native_log.h: a record's span)
};
thread_local std::deque<Open> calls;
thread_local size_t open_calls = 0;
thread_local std::vector<int64_t> fields;  // an op record's fields, reused

Open& push_call() {
  if (open_calls == calls.size()) {
    calls.emplace_back();
  }
  Open& open = calls[open_calls++];
  open.state = Open::kNotSeen;
  return open;
}

void facts(const at::RecordFunction& fn, c10::ArrayRef<c10::IValue> inputs, Open& open);

// The program's dispatch modes on this thread's stack (torch's infra modes, FakeTensorMode and
// its kin, lie below every other one whenever they were entered), and how many there were where the
// op log started: the recording's dispatch mode would sit above those.
int64_t program_modes() {
  using c10::impl::TorchDispatchModeKey;
  using c10::impl::TorchDispatchModeTLS;
  int64_t n = TorchDispatchModeTLS::stack_len();
  if (n == 0) {
    return 0;
  }
  for (auto key : {TorchDispatchModeKey::FAKE, TorchDispatchModeKey::PROXY, TorchDispatchModeKey::FUNCTIONAL}) {
    if (TorchDispatchModeTLS::get_mode(key).has_value()) {
      --n;
    }
  }
  return n;
}
int64_t modes_below = 0;

// The classifier's answer for this op on this backend (the GIL taken: called once per key).
OpClass classify(const at::RecordFunction& fn, int backend) {
  const Key key{fn.name(), fn.overload_name(), backend};
  auto found = classes.find(key);
  if (found != classes.end()) {
    return found->second;
  }
  OpClass answer;
  if (!fn.operator_name().has_value()) {
    // no dispatcher op (autograd's "autograd::engine::evaluate_function: MulBackward0"): the ops
    // inside it are the program's, seen one by one. Not kept in the map: its name is its own string,
    // whose address another one's may take after it
    return answer;
  }
  answer.cls = kLog;  // an op the classifier cannot answer for is logged: its handler then says what failed
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* r = PyObject_CallFunction(classifier, "ssi", fn.name(), fn.overload_name(), backend);
  if (r != nullptr && PyTuple_Check(r) && PyTuple_Size(r) == 4) {
    answer.cls = PyLong_AsLongLong(PyTuple_GetItem(r, 0));
    answer.id = PyLong_AsLongLong(PyTuple_GetItem(r, 1));
    answer.flags = PyLong_AsLongLong(PyTuple_GetItem(r, 2));
    answer.cuda_values = PyLong_AsUnsignedLongLong(PyTuple_GetItem(r, 3));
  } else {
    answer.id = -1;
  }
  Py_XDECREF(r);
  PyErr_Clear();
  PyGILState_Release(gil);
  classes.emplace(key, answer);
  return answer;
}

// The innermost frame of the user's code as (code, line), the code's reference held by the record;
// (0, 0) where there is none.
std::pair<int64_t, int64_t> user_frame() {
  if (!Py_IsInitialized()) {
    return {0, 0};
  }
  PyGILState_STATE gil = PyGILState_Ensure();
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyObject* code = reinterpret_cast<PyObject*>(PyFrame_GetCode(frame));  // new reference
    auto found = library_codes.find(code);
    bool library;
    if (found == library_codes.end()) {
      PyObject* r = PyObject_CallFunctionObjArgs(is_library, code, nullptr);
      library = r == nullptr || PyObject_IsTrue(r) == 1;
      Py_XDECREF(r);
      PyErr_Clear();
      Py_INCREF(code);  // the map holds it: its address names no other code object meanwhile
      library_codes.emplace(code, library);
    } else {
      library = found->second;
    }
    if (!library) {
      int line;
      if (frame_lasti != nullptr && addr2line != nullptr) {
        const int lasti = frame_lasti(frame);
        const uint64_t at = (static_cast<uint64_t>(reinterpret_cast<uintptr_t>(code)) << 20) ^ static_cast<uint64_t>(lasti);
        auto known = lines.find(at);
        if (known == lines.end()) {  // (the code is held by library_codes: its address stays its own)
          known = lines.emplace(at, addr2line(code, lasti)).first;
        }
        line = known->second;
      } else {
        line = PyFrame_GetLineNumber(frame);
      }
      Py_DECREF(frame);
      PyGILState_Release(gil);
      return {static_cast<int64_t>(reinterpret_cast<uintptr_t>(code)), line};  // the record's reference
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  PyGILState_Release(gil);
  return {0, 0};
}

int64_t handle_of(const c10::cuda::CUDAStream& s) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(s.stream()));
}

void int64_values(const at::Tensor& t, bool cuda, std::vector<int64_t>& words) {
  const int64_t n = t.numel();
  if (n > kMaxValues || (cuda && !t.is_contiguous())) {
    words.push_back(-1);
    return;
  }
  words.push_back(n);
  const size_t at = words.size();
  words.resize(at + static_cast<size_t>(n));
  if (n == 0) {
    return;
  }
  if (!cuda) {
    // contiguous() of a strided view is a dispatcher call inside the kept op: not logged (depth > 0)
    const at::Tensor dense = t.is_contiguous() ? t : t.contiguous();
    std::memcpy(words.data() + at, dense.const_data_ptr<int64_t>(), static_cast<size_t>(n) * sizeof(int64_t));
    return;
  }
  // read back on the current stream of its device, as the op will read it; native capture does
  // not see this copy (the recorder's own)
  c10::cuda::CUDAGuard guard(t.device().index());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
  ++suppressed();
  const bool ok = cudaMemcpyAsync(words.data() + at, t.const_data_ptr(), static_cast<size_t>(n) * sizeof(int64_t),
                                  cudaMemcpyDeviceToHost, stream) == cudaSuccess &&
                  cudaStreamSynchronize(stream) == cudaSuccess;
  --suppressed();
  if (!ok) {
    cudaGetLastError();
    words.resize(at);
    words.back() = -1;
  }
}

void tensor(const at::Tensor& t, bool values, bool cuda_values, std::vector<int64_t>& words) {
  if (!t.defined()) {
    words.push_back(kNone);
    return;
  }
  if (t.layout() != c10::kStrided || !t.has_storage()) {
    words.push_back(kOpaque);
    return;
  }
  const c10::Device device = t.device();
  const c10::Storage& storage = t.storage();
  const bool memory = !storage.device().is_meta() && (storage.data() != nullptr || storage.nbytes() == 0);
  int64_t flags = t.is_contiguous() ? kContiguous : 0;
  const auto start = static_cast<int64_t>(reinterpret_cast<uintptr_t>(memory ? t.const_data_ptr() : nullptr));
  // the covering span: strides are never negative in torch
  int64_t length = 0;
  if (t.numel() != 0) {
    int64_t hi = 0;
    const auto sizes = t.sizes();
    const auto strides = t.strides();
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] > 1) {
        hi += (sizes[d] - 1) * strides[d];
      }
    }
    length = (hi + 1) * static_cast<int64_t>(t.element_size());
  }
  const bool cuda = device.is_cuda();
  if (memory && device.is_cpu() && storage.data() != nullptr &&
      at::globalContext().isPinnedPtr(storage.data(), c10::DeviceType::CUDA)) {
    flags |= kPinned;
  }
  int64_t version = 0;
  if (!t.is_inference()) {
    flags |= kVersioned;
    version = static_cast<int64_t>(t.unsafeGetTensorImpl()->version_counter().current_version());
  }
  words.insert(words.end(),
               {kTensor, memory ? static_cast<int64_t>(device.type()) : -1, device.index(),
                static_cast<int64_t>(t.scalar_type()), flags, start, length,
                static_cast<int64_t>(reinterpret_cast<uintptr_t>(memory ? storage.data() : nullptr)),
                static_cast<int64_t>(storage.nbytes()), t.numel(), version,
                cuda ? handle_of(c10::cuda::getCurrentCUDAStream(device.index())) : 0});
  if (memory && t.scalar_type() == at::kLong && ((values && device.is_cpu()) || (cuda_values && cuda))) {
    int64_values(t, cuda, words);
  } else {
    words.push_back(-1);
  }
}

void value(const c10::IValue& v, bool values, bool cuda_values, std::vector<int64_t>& words) {
  if (v.isTensor() && v.toTensor().defined() && v.toTensor().unsafeGetTensorImpl()->is_wrapped_number()) {
    // a Python number torch wrapped in a 0-dim CPU tensor: a dispatch mode is handed the number
    const at::Tensor& t = v.toTensor();
    if (t.scalar_type() == at::kLong) {
      words.insert(words.end(), {kInt, *t.const_data_ptr<int64_t>()});
    } else if (t.scalar_type() == at::kBool) {
      words.insert(words.end(), {kBool, *t.const_data_ptr<bool>() ? 1 : 0});
    } else if (t.scalar_type() == at::kDouble) {
      int64_t bits;
      std::memcpy(&bits, t.const_data_ptr<double>(), sizeof(bits));
      words.insert(words.end(), {kDouble, bits});
    } else {
      words.push_back(kNone);
    }
  } else if (v.isTensor()) {
    tensor(v.toTensor(), values, cuda_values, words);
  } else if (v.isInt()) {
    words.insert(words.end(), {kInt, v.toInt()});
  } else if (v.isBool()) {
    words.insert(words.end(), {kBool, v.toBool() ? 1 : 0});
  } else if (v.isDouble()) {
    const double d = v.toDouble();
    int64_t bits;
    std::memcpy(&bits, &d, sizeof(bits));
    words.insert(words.end(), {kDouble, bits});
  } else if (v.isTensorList()) {
    const auto list = v.toTensorList();
    words.insert(words.end(), {kList, static_cast<int64_t>(list.size())});
    for (const at::Tensor& t : list) {
      tensor(t, values, false, words);
    }
  } else if (v.isList()) {  // Tensor?[]
    const auto list = v.toListRef();
    bool tensors = true;
    for (const auto& e : list) {
      tensors = tensors && (e.isTensor() || e.isNone());
    }
    if (!tensors || list.empty()) {
      words.push_back(kNone);
      return;
    }
    words.insert(words.end(), {kList, static_cast<int64_t>(list.size())});
    for (const auto& e : list) {
      if (e.isTensor()) {
        tensor(e.toTensor(), values, false, words);
      } else {
        words.push_back(kNone);
      }
    }
  } else if (v.isStream()) {
    const c10::Stream s = v.toStream();
    if (s.device_type() == c10::DeviceType::CUDA) {
      words.insert(words.end(), {kStream, handle_of(c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, s)),
                                 s.device_index()});
    } else {
      words.push_back(kNone);
    }
  } else {
    words.push_back(kNone);
  }
}

int backend_of(c10::ArrayRef<c10::IValue> inputs) {
  for (const auto& v : inputs) {
    if (v.isTensor() && v.toTensor().defined()) {
      return static_cast<int>(v.toTensor().device().type());
    }
    if (v.isTensorList() && v.toTensorList().size() > 0) {
      return static_cast<int>(v.toTensorList().get(0).device().type());
    }
  }
  return -1;
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (static_cast<uint64_t>(pthread_self()) != owner) {
    // torch hands thread-local callbacks on to the threads that run work for this one (autograd's)
    elsewhere.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  // Python runs below (the flush, the classifier, the frame): calls made meanwhile (a finalizer's)
  // push on top of this one and are gone again before it goes on; its state is set after them
  Open& open = push_call();
  if (quiet > 0) {
    return nullptr;
  }
  if (depth > 0) {
    ++depth;
    open.state = Open::kInside;
    return nullptr;
  }
  if (c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Python)) {
    return nullptr;  // torch keeps dispatch modes out of it (torch.tensor's own empty()): a mode would not see it
  }
  if (program_modes() > modes_below) {
    // a dispatch mode the program entered after the recording started sees the op first (it sits
    // above the recording's): what it runs in its place reaches the observer as calls of its own
    return nullptr;
  }
  if (own_pending_records() >= kFlushRecords) {  // (this thread's: its flush takes no other's)
    PyGILState_STATE gil = PyGILState_Ensure();
    ++quiet;
    PyObject* r = PyObject_CallNoArgs(flush);
    --quiet;
    Py_XDECREF(r);
    PyErr_Clear();  // (the recorder notes its own failures)
    PyGILState_Release(gil);
  }
  const auto inputs = fn.inputs();
  const OpClass op = classify(fn, backend_of(inputs));
  if (op.cls == kTransparent) {
    return nullptr;
  }
  const auto frame = op.cls == kLog ? user_frame() : std::pair<int64_t, int64_t>{0, 0};
  // no Python from here on: what a call inside this one does is not this op's record
  open.t0 = now_ns();
  ++depth;
  open.state = Open::kKept;
  open.op = op;
  if (op.cls == kSwallow) {
    return nullptr;
  }
  open.unwritten = false;
  open.device = -1;
  open.stream = 0;
  open.frames.assign(1, 0);
  if (frame.first != 0) {
    open.frames[0] = 1;
    open.frames.push_back(frame.first);
    open.frames.push_back(frame.second);
  }
  open.inputs.clear();
  owe_begin(true);
  try {
    facts(fn, inputs, open);
  } catch (...) {  // the program's op runs on; the record says the op log could not write it down
    open.unwritten = true;
  }
  return nullptr;
}

void facts(const at::RecordFunction& fn, c10::ArrayRef<c10::IValue> inputs, Open& open) {
  const OpClass& op = open.op;
  if ((op.flags & kCurrentStream) && c10::cuda::device_count() > 0) {
    open.device = c10::cuda::current_device();
    open.stream = handle_of(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(open.device)));
  }
  open.inputs.push_back(static_cast<int64_t>(inputs.size()));
  for (size_t k = 0; k < inputs.size(); ++k) {
    value(inputs[k], (op.flags & kCpuValues) != 0, k < 64 && ((op.cuda_values >> k) & 1), open.inputs);
  }
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (open_calls == 0) {  // (another thread's call, or one that started before the observer)
    return;
  }
  Open& open = calls[--open_calls];
  if (open.state == Open::kNotSeen) {
    return;
  }
  --depth;
  if (open.state == Open::kInside || open.op.cls == kSwallow) {
    return;
  }
  if (std::uncaught_exceptions() > 0) {
    owe_begin(false);
    append_record(kOpFailed, open.frames, {open.op.id}, open.t0);
    return;
  }
  fields.assign({open.op.id, open.device, open.stream});
  if (!open.unwritten) {
    try {
      fields.insert(fields.end(), open.inputs.begin(), open.inputs.end());
      const auto& outputs = fn.outputs();
      fields.push_back(static_cast<int64_t>(outputs.size()));
      for (const auto& v : outputs) {
        value(v, false, false, fields);
      }
    } catch (...) {
      open.unwritten = true;
    }
  }
  if (open.unwritten) {
    fields.assign({-1, -1, 0, 0, 0});
  }
  owe_begin(false);
  append_record(kOp, open.frames, fields, open.t0);
}

}  // namespace
}  // namespace kvverify::native

using namespace kvverify::native;

extern "C" {

// Start the op log on the calling thread (the GIL held): `classify(name, overload, backend)` ->
// (class, id, flags, cuda_values), `library(code)` -> whether frames of that code are library
// code, `flush()` logs what the log holds; `below`: how many of the program's dispatch modes on this
// thread's stack lie below the recording (-1: those there now; a recording that goes on after a pause
// stays where it was). Returns null, or why it could not start.
__attribute__((visibility("default"))) const char* kvverify_ops_start(PyObject* classify_fn, PyObject* library_fn,
                                                                     PyObject* flush_fn, int64_t below) {
  if (handle != 0) {
    failure = "the op log already runs on another thread";
    return failure.c_str();
  }
  Py_XDECREF(classifier);
  Py_XDECREF(is_library);
  Py_XDECREF(flush);
  Py_INCREF(classify_fn);
  Py_INCREF(library_fn);
  Py_INCREF(flush_fn);
  classifier = classify_fn;
  is_library = library_fn;
  flush = flush_fn;
  classes.clear();
  elsewhere.store(0);
  owner = static_cast<uint64_t>(pthread_self());
  modes_below = below >= 0 ? below : program_modes();
  depth = 0;
  open_calls = 0;
  try {
    handle = at::addThreadLocalCallback(at::RecordFunctionCallback(on_start, on_end)
                                            .scopes({at::RecordScope::FUNCTION})
                                            .needsInputs(true)
                                            .needsOutputs(true));
  } catch (const std::exception& e) {
    failure = std::string("torch refused the op observer: ") + e.what();
    return failure.c_str();
  }
  return nullptr;
}

// The program's dispatch modes the op log sits above (its start's `below`, or those on the stack then).
__attribute__((visibility("default"))) int64_t kvverify_ops_below() { return modes_below; }

// Stop the op log (on the thread that started it; the GIL held).
__attribute__((visibility("default"))) void kvverify_ops_stop() {
  if (handle != 0) {
    at::removeCallback(handle);
    handle = 0;
  }
  owner = 0;
  classes.clear();
}

// A report of the recorder's own, held in Python at `index`, at this point of the thread's log.
__attribute__((visibility("default"))) void kvverify_ops_mark(int64_t index) { append(kMark, {index}, false); }

// Ops of other threads the observer reached since the start (not logged), now reset.
__attribute__((visibility("default"))) int64_t kvverify_ops_elsewhere() { return elsewhere.exchange(0); }

// The calling thread's depth in the recorder's own work moves by `delta`: no op is logged inside it.
__attribute__((visibility("default"))) void kvverify_ops_quiet(int delta) { quiet += delta; }

}  // extern "C"
