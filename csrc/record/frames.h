// The calling thread's Python frames, read without the GIL and without allocating (frames.cpp).
#pragma once

#include <cstdint>

namespace kvverify::frames {

// Whether frames can be read in this process: the interpreter is the one the extension was built
// for. Call once, outside a signal handler, before snapshot().
bool usable();

// The calling thread's innermost `max_frames` Python frames as words: [n, then per frame: line,
// file bytes, name bytes, the file name's bytes packed 8 to a word (its end where it was cut),
// then the function name's]. Returns the words written (1 and n = 0 where none can be read).
// Async-signal-safe: no allocation, no lock, no GIL.
int snapshot(int64_t* out, int capacity, int max_frames);

}  // namespace kvverify::frames
