// The emulated libcuda.so.1 (kvcore.gpu.use_emulator()). cuda-python's bindings load it in
// place of the driver's library (it is loaded first, under the driver's soname) and resolve
// every entry point through cuGetProcAddress, as they do with the real driver. This file
// only answers cuGetProcAddress: the entry points themselves are the emulated driver's
// (kvcore/gpu/_emu/driver.py, one C function per driver call and API version), registered
// through kvemu_set_resolver.
#include <stdint.h>
#include <string.h>

typedef int CUresult;
typedef void *(*kvemu_resolver)(const char *symbol, int cudaVersion, uint64_t flags);

static kvemu_resolver resolver = nullptr;

enum { SUCCESS = 0, INVALID_VALUE = 1, NOT_INITIALIZED = 3, NOT_FOUND = 500 };
enum { PROC_SUCCESS = 0, PROC_SYMBOL_NOT_FOUND = 1, PROC_VERSION_NOT_SUFFICIENT = 2 };

extern "C" {

__attribute__((visibility("default"))) void kvemu_set_resolver(kvemu_resolver r) { resolver = r; }

__attribute__((visibility("default")))
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, uint64_t flags,
                             int *symbolStatus);

__attribute__((visibility("default")))
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, uint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, nullptr);
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, uint64_t flags,
                             int *symbolStatus) {
    if (symbol == nullptr || pfn == nullptr) return INVALID_VALUE;
    *pfn = nullptr;
    if (strcmp(symbol, "cuGetProcAddress") == 0) {   // v2 (with symbolStatus) from CUDA 12.0
        *pfn = cudaVersion >= 12000 ? (void *)&cuGetProcAddress_v2 : (void *)&cuGetProcAddress;
    } else if (resolver != nullptr) {
        *pfn = resolver(symbol, cudaVersion, flags);
    }
    if (symbolStatus != nullptr) *symbolStatus = *pfn ? PROC_SUCCESS : PROC_SYMBOL_NOT_FOUND;
    return *pfn ? SUCCESS : NOT_FOUND;
}

}  // extern "C"
