// Fuzzes hub validation: whatever bytes a segment holds, validate_hub either rejects them or
// guarantees that every offset the readers then use stays inside the mapping.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "shm/layout.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace bb::shm;
  // The input is the start of the segment; the mapping is as long as the input (at least a
  // header) so truncation is explored too.
  std::vector<unsigned char> mem(std::max(size, sizeof(HubHeader)) + 64);
  unsigned char* base = mem.data() + (64 - reinterpret_cast<uintptr_t>(mem.data()) % 64) % 64;
  const size_t mapped = mem.size() - size_t(base - mem.data());
  std::memcpy(base, data, std::min(size, mapped));
  std::string err;
  if (!validate_hub(base, mapped, &err)) {
    if (err.empty()) __builtin_trap();  // every rejection says why
    return 0;
  }
  // Accepted: touch the last byte of every region a reader uses.
  HubView v{base};
  uint64_t sink = 0;
  sink += v.bubble()->seq.load();
  sink += v.stats()->steps.load();
  for (uint32_t i = 0; i < v.header()->max_slots; ++i) sink += v.slot(i)->doorbell.load();
  for (uint32_t k = 0; k < kEventStreams; ++k) {
    const auto stream = EventStream(k);
    sink += v.events(stream)->next.load();
    for (uint32_t i = 0; i < v.header()->event_capacity; ++i)
      sink += v.event_entries(stream)[i].ts_ns;
  }
  asm volatile("" : : "r"(sink));  // keep the reads
  return 0;
}
