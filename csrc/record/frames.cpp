// The calling thread's Python stack, read without the GIL and without allocating: what a sampling
// profiler reads, for the places where the recorder cannot take the GIL (a signal handler on a
// page fault of the host watch, host_watch.cpp; a driver call made with the GIL released).
//
// Each thread's frames are changed only by that thread, and the thread is here, in this call: its
// stack stands still while it is read. Code objects stay alive while their frames are on the stack,
// so the record copies what it needs (file name, function name, line) and holds no reference.
//
// This is the one translation unit built against CPython's full API (the rest of the extension
// keeps to the limited API of 3.10): the layout of an interpreter frame is CPython's own
// (Include/internal/pycore_frame.h, 3.11 to 3.13; PyFrameObject in 3.10). The layout of the
// Python the extension was built for is checked against the running one (usable()); where they
// differ, or for a Python this file does not know, no frame is read: the record is then unlocated,
// which the recorder says.
#undef Py_LIMITED_API
#include <Python.h>

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000
#define KVVERIFY_FRAMES 311
#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#elif PY_VERSION_HEX >= 0x030A0000 && PY_VERSION_HEX < 0x030B0000
#define KVVERIFY_FRAMES 310
#include <frameobject.h>
#else
#define KVVERIFY_FRAMES 0
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "frames.h"

namespace kvverify::frames {
namespace {

constexpr int kMaxFile = 240;  // bytes of a file name kept (its end: the part that names it)
constexpr int kMaxName = 160;

// The UTF-8 bytes of a str without allocating: compact ASCII strings hold them inline, other
// compact strings where their UTF-8 form was made already; else nothing.
const char* utf8_of(PyObject* s, Py_ssize_t* n) {
  if (s == nullptr || !PyUnicode_Check(s)) return nullptr;
  if (PyUnicode_IS_COMPACT_ASCII(s)) {
    *n = reinterpret_cast<PyASCIIObject*>(s)->length;
    return reinterpret_cast<const char*>(reinterpret_cast<PyASCIIObject*>(s) + 1);
  }
  if (PyUnicode_IS_COMPACT(s)) {
    auto* c = reinterpret_cast<PyCompactUnicodeObject*>(s);
    if (c->utf8 != nullptr) {
      *n = c->utf8_length;
      return c->utf8;
    }
  }
  return nullptr;
}

// Append `text` (at most `limit` bytes; a file name keeps its end) packed 8 to a word.
int put_text(int64_t* out, int room, const char* text, Py_ssize_t n, int limit, bool keep_end, int* length) {
  if (text == nullptr) {
    text = "?";
    n = 1;
  }
  if (n > limit) {
    if (keep_end) text += n - limit;
    n = limit;
  }
  const int words = static_cast<int>((n + 7) / 8);
  if (words > room) return -1;
  std::memset(out, 0, static_cast<size_t>(words) * 8);
  std::memcpy(out, text, static_cast<size_t>(n));
  *length = static_cast<int>(n);
  return words;
}

// One frame: [line, file bytes, name bytes, packed file, packed name]; -1 where it does not fit.
int put_frame(int64_t* out, int room, PyCodeObject* code, int line) {
  if (room < 3) return -1;
  Py_ssize_t nf = 0, nn = 0;
  const char* file = utf8_of(code->co_filename, &nf);
  const char* name = utf8_of(code->co_name, &nn);
  int lf = 0, ln = 0;
  const int wf = put_text(out + 3, room - 3, file, nf, kMaxFile, true, &lf);
  if (wf < 0) return -1;
  const int wn = put_text(out + 3 + wf, room - 3 - wf, name, nn, kMaxName, false, &ln);
  if (wn < 0) return -1;
  out[0] = line;
  out[1] = lf;
  out[2] = ln;
  return 3 + wf + wn;
}

bool checked = false;
bool layout_matches = false;

}  // namespace

bool usable() {
  if (!checked) {
    checked = true;
#if KVVERIFY_FRAMES
    // the running interpreter's major.minor must be the one this file was built for
    const char* version = Py_GetVersion();  // "3.12.3 (main, ...)"
    const int major = std::atoi(version), minor = std::atoi(std::strchr(version, '.') + 1);
    layout_matches = major == PY_MAJOR_VERSION && minor == PY_MINOR_VERSION;
#endif
  }
  return layout_matches;
}

int snapshot(int64_t* out, int capacity, int max_frames) {
  if (capacity < 1) return 0;
  out[0] = 0;
  if (!layout_matches || !Py_IsInitialized()) return 1;
#if KVVERIFY_FRAMES
  PyThreadState* tstate = PyGILState_GetThisThreadState();  // this thread's, held or not
  if (tstate == nullptr) return 1;
  int used = 1, n = 0;
#if KVVERIFY_FRAMES == 310
  for (PyFrameObject* f = tstate->frame; f != nullptr && n < max_frames; f = f->f_back) {
    PyCodeObject* code = f->f_code;
    const int line = f->f_lasti < 0 ? code->co_firstlineno : PyCode_Addr2Line(code, f->f_lasti * 2);
#else
#if PY_VERSION_HEX >= 0x030D0000
  _PyInterpreterFrame* f = tstate->current_frame;
#else
  _PyInterpreterFrame* f = tstate->cframe != nullptr ? tstate->cframe->current_frame : nullptr;
#endif
  for (; f != nullptr && n < max_frames; f = f->previous) {
    if (_PyFrame_IsIncomplete(f)) continue;  // a C shim, or a frame not started yet
#if PY_VERSION_HEX >= 0x030D0000
    if (!PyCode_Check(f->f_executable)) continue;
    PyCodeObject* code = reinterpret_cast<PyCodeObject*>(f->f_executable);
#else
    PyCodeObject* code = f->f_code;
#endif
    // PyCode_Addr2Line walks the code's line table: no allocation, no lock
    const int line = PyCode_Addr2Line(code, _PyInterpreterFrame_LASTI(f) * static_cast<int>(sizeof(_Py_CODEUNIT)));
#endif
    const int w = put_frame(out + used, capacity - used, code, line);
    if (w < 0) break;
    used += w;
    ++n;
  }
  out[0] = n;
  return used;
#else
  (void)max_frames;
  return 1;
#endif
}

}  // namespace kvverify::frames
