// What the C ABI's translation units share: how a handle names its object and how a
// size-prefixed struct is initialised and read (docs/C_API.md). Internal to capi/.
#pragma once

#include <bubble/bubble.h>

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "core/error.h"
#include "core/task.h"
#include "core/trainer.h"

namespace bb::capi {

// A handle is the core object's own address (struct bb_trainer and struct bb_task are never
// defined): a call reaches the object without a pointer in between, one dependent cache miss
// less on a bubble begin that comes with cold caches.
inline core::Trainer* impl(bb_trainer_h h) { return reinterpret_cast<core::Trainer*>(h); }
inline core::Task* impl(bb_task_h h) { return reinterpret_cast<core::Task*>(h); }

// The *_init_sized functions: exactly `size` bytes of the caller's struct are written, our
// defaults as far as they go and zeros past them (a newer header's fields, which we ignore),
// and size says how big the caller's struct is. Nothing below 8 bytes (no room for the size a
// call then checks) or above 64 KiB (not a size of any version of any of these structs).
template <typename T>
void init_sized(T* out, size_t size, const T& defaults) {
  if (!out || size < 8 || size > 65536) return;
  const size_t known = std::min(size, sizeof(T));
  std::memcpy(out, &defaults, known);
  if (size > known) std::memset(reinterpret_cast<char*>(out) + known, 0, size - known);
  out->size = uint32_t(size);
}

// Copies a caller's size-prefixed struct over our defaults: the smaller of the two sizes wins,
// so an older caller gets defaults for fields it does not know and a newer caller's extra
// fields are ignored. `min_size` is the size of the first released version.
template <typename T>
bb_status read_options(const T* in, const T& defaults, size_t min_size, const char* what, T* out) {
  *out = defaults;
  if (!in) return BB_OK;
  if (in->size < min_size)
    return core::fail(BB_E_INVALID, "%s.size is %u: initialise the struct with its _init() "
                      "function or _INIT macro", what, in->size);
  // Every version of the struct is a whole number of its alignment: a size that is not ends
  // inside a field, which a copy would take half of (half a callback's address, say).
  if (in->size % alignof(T) != 0)
    return core::fail(BB_E_INVALID, "%s.size is %u, which ends inside a field: initialise the "
                      "struct with its _init() function or _INIT macro", what, in->size);
  std::memcpy(out, in, std::min<size_t>(in->size, sizeof(T)));
  out->size = sizeof(T);
  return BB_OK;
}

}  // namespace bb::capi
