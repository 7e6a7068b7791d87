// One emulated module: the kernel source KVEMU_SOURCE (e.g. "kv_append.cu") compiled for the
// CPU, with a registry of its extern "C" kernels KVEMU_KERNELS (X(name) X(name) ..., from
// the module's PTX .entry lines). Built by kvcore/gpu/_emu/kernels.py:
//   g++ -std=c++17 -O2 -fPIC -shared -ffp-contract=off -DKVCORE_EMU -I<emu> -I<sources>
//       -DKVEMU_SOURCE='"<module>.cu"' -DKVEMU_KERNELS='X(a) X(b)' module.cpp
#include "kvemu.h"

// The kernel source in an unnamed namespace: its functions (and their __shared__ statics)
// have internal linkage, so every shared variable is this module's own.
namespace {
#include KVEMU_SOURCE
}

#include "kvemu_runtime.h"

#define X(name) ::kvemu::Kernel<&name>::entry(#name),
extern const kvemu::Entry kvemu_entries[] = {KVEMU_KERNELS};
#undef X
extern const int kvemu_entry_count = (int)(sizeof kvemu_entries / sizeof kvemu_entries[0]);
