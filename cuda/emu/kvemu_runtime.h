// kvemu runtime: fibers, the block scheduler, barriers, warp collectives, cp.async, shared
// memory and the launch entry point. Included once per module by cuda/emu/module.cpp, after
// the kernel source (see kvemu.h for the model).
#pragma once

#include <dlfcn.h>
#include <link.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <mutex>
#include <utility>
#include <vector>

#ifdef __SANITIZE_ADDRESS__
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#define KVEMU_API extern "C" __attribute__((visibility("default")))

namespace kvemu {

// ---- context switch ----------------------------------------------------------------------

#if defined(__x86_64__)
// kvemu_switch(save, to): pushes the SysV callee-saved registers, stores rsp in *save,
// loads `to` and pops the target's registers. MXCSR and the x87 control word are shared by
// every fiber (never changed by the kernels), so they are not switched.
extern "C" void kvemu_switch(void** save, void* to);
asm(R"(
    .text
    .p2align 4
    .type kvemu_switch, @function
kvemu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size kvemu_switch, .-kvemu_switch
)");
struct Context { void* sp; };
#else
struct Context { ucontext_t uc; };
#endif

// ---- state -------------------------------------------------------------------------------

enum State { READY, AT_BARRIER, AT_COLLECTIVE, DONE };

struct Copy { char* dst; const char* src; int size, src_bytes; long long group; };

struct Fiber {
    FiberIds ids;  // first: threadIdx reads it through kvemu_cur_ids
    int lin = 0;
    State state = READY;
    int kind = 0;  // barrier or collective kind while waiting
    const char* file = nullptr;
    int line = 0;
    unsigned mask = 0;
    uint64_t value = 0, result = 0;
    int arg = 0, width = 32;
    long long committed = 0;  // cp.async groups committed so far
    std::vector<Copy> copies; // issued, not yet completed
    char* stack_lo = nullptr;
    size_t stack_size = 0;
    Context ctx;
    void* asan_fake = nullptr;
};

// The collectives of one warp that some lanes wait at (usually none or one).
struct Open { int kind; unsigned mask; const char* file; int line; unsigned arrived; };
struct Warp {
    unsigned exist = 0, done = 0;  // lanes that are threads of the block / have exited
    std::vector<Open> open;
};

struct Entry {
    const char* name;
    int nparams;
    const int* sizes;
    const int* pointers;
    void (*invoke)(void** params);
};

FiberIds* kvemu_cur_ids;
uint3 kvemu_block;
dim3 kvemu_bdim, kvemu_gdim;

static Fiber* kvemu_cur;
static std::vector<Fiber> kvemu_fibers;
static std::vector<int> kvemu_ready;
static std::vector<Warp> kvemu_warps;
static Context kvemu_sched;
static const Entry* kvemu_entry;
static void** kvemu_params;
static int kvemu_nthreads, kvemu_done, kvemu_first_exit;
static uint64_t kvemu_rng;
// the open barrier: how many wait, where, and its reduction so far
static int kvemu_bar_count, kvemu_bar_kind, kvemu_bar_line, kvemu_bar_acc;
static const char* kvemu_bar_file;
// the first fault of the launch
static int kvemu_fault_code;
static char kvemu_fault_msg[2048];
static std::mutex kvemu_lock;
#ifdef __SANITIZE_ADDRESS__
static const void* kvemu_sched_stack;
static size_t kvemu_sched_stack_size;
#endif

static uint64_t next_random() {  // splitmix64
    uint64_t z = (kvemu_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// ---- shared memory ----------------------------------------------------------------------

struct Region { char* lo; size_t size; };
static std::vector<Region> kvemu_shared;  // where this module's __shared__ variables live
static char* kvemu_shared_base;
static char* kvemu_shared_end;

#ifdef __SANITIZE_ADDRESS__
// The shared variables are plain statics with ASan redzones: found once, by asking ASan
// for every global in this module's writable segments. The runtime's own globals are all
// named kvemu_* and it has no function-local statics, so every other one is __shared__.
static int find_shared_cb(struct dl_phdr_info* info, size_t, void* self) {
    Dl_info me;
    if (!dladdr(self, &me) || (void*)info->dlpi_addr != me.dli_fbase) return 0;
    uintptr_t relro_lo = 0, relro_hi = 0;  // made read-only after relocation: no shared there
    for (int j = 0; j < info->dlpi_phnum; j++)
        if (info->dlpi_phdr[j].p_type == PT_GNU_RELRO) {
            relro_lo = info->dlpi_addr + info->dlpi_phdr[j].p_vaddr;
            relro_hi = relro_lo + info->dlpi_phdr[j].p_memsz;
        }
    for (int j = 0; j < info->dlpi_phnum; j++) {
        const ElfW(Phdr)& ph = info->dlpi_phdr[j];
        if (ph.p_type != PT_LOAD || !(ph.p_flags & PF_W)) continue;
        uintptr_t lo = info->dlpi_addr + ph.p_vaddr;
        const uintptr_t end = lo + ph.p_memsz;
        if (lo >= relro_lo && lo < relro_hi) lo = relro_hi;
        char* p = (char*)((lo + 7) & ~(uintptr_t)7);
        char* hi = (char*)end;
        while (p < hi) {
            char name[256];
            void* beg = nullptr;
            size_t size = 0;
            const char* kind = __asan_address_is_poisoned(p)
                ? nullptr : __asan_locate_address(p, name, sizeof name, &beg, &size);
            if (kind && !strcmp(kind, "global") && size && (char*)beg <= p && p < (char*)beg + size) {
                if (name[0] && strncmp(name, "kvemu", 5) && name[0] != '*' && name[0] != '_')
                    kvemu_shared.push_back({(char*)beg, size});
                p = (char*)(((uintptr_t)beg + size + 7) & ~(uintptr_t)7);
            } else {
                p += 8;
            }
        }
    }
    return 1;
}
static void locate_shared() {
    if (kvemu_shared_base) return;
    dl_iterate_phdr(find_shared_cb, (void*)&find_shared_cb);
    kvemu_shared_base = (char*)~(uintptr_t)0;
    kvemu_shared_end = nullptr;
    for (const Region& r : kvemu_shared) {
        if (r.lo < kvemu_shared_base) kvemu_shared_base = r.lo;
        if (r.lo + r.size > kvemu_shared_end) kvemu_shared_end = r.lo + r.size;
    }
    if (kvemu_shared.empty()) kvemu_shared_base = kvemu_shared_end = (char*)&kvemu_shared;
}
#else
// The shared variables are thread_local: they are this module's whole TLS block (the
// runtime has no thread_local of its own but this anchor, which forces the block to exist).
static thread_local char kvemu_tls_anchor;
struct TlsQuery { void* self; char* lo; size_t size; };
static int find_tls_cb(struct dl_phdr_info* info, size_t, void* data) {
    TlsQuery* q = (TlsQuery*)data;
    Dl_info me;
    if (!dladdr(q->self, &me) || (void*)info->dlpi_addr != me.dli_fbase) return 0;
    for (int j = 0; j < info->dlpi_phnum; j++)
        if (info->dlpi_phdr[j].p_type == PT_TLS) {
            q->lo = (char*)info->dlpi_tls_data;
            q->size = info->dlpi_phdr[j].p_memsz;
        }
    return 1;
}
static void locate_shared() {  // per launch: the TLS block is the launching OS thread's
    *(volatile char*)&kvemu_tls_anchor = 0;
    TlsQuery q{(void*)&find_tls_cb, nullptr, 0};
    dl_iterate_phdr(find_tls_cb, &q);
    kvemu_shared.assign(1, Region{q.lo, q.lo ? q.size : 0});
    kvemu_shared_base = q.lo;
    kvemu_shared_end = q.lo + (q.lo ? q.size : 0);
}
#endif

static void poison_shared() {
    for (const Region& r : kvemu_shared) memset(r.lo, 0xFF, r.size);
}

static bool in_shared(const void* p, size_t n) {
    const char* c = (const char*)p;
    for (const Region& r : kvemu_shared)
        if (c >= r.lo && c + n <= r.lo + r.size) return true;
    return false;
}

// ---- faults ------------------------------------------------------------------------------

static void thread_name(const Fiber& f, char* buf, size_t n) {
    snprintf(buf, n, "thread (%u,%u,%u)", f.ids.tid.x, f.ids.tid.y, f.ids.tid.z);
}

static const char* const kvemu_barrier_names[] = {"__syncthreads", "__syncthreads_or",
                                                   "__syncthreads_and", "__syncthreads_count"};
static const char* const kvemu_collective_names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                                      "__shfl_xor_sync", "__any_sync", "__all_sync",
                                                      "__ballot_sync", "__syncwarp"};

static const char* kind_name(bool barrier, int kind) {
    return barrier ? kvemu_barrier_names[kind] : kvemu_collective_names[kind];
}

static void switch_to_scheduler(bool exiting);

static void vrecord_fault(int code, const Fiber* who, const char* fmt, va_list ap) {
    if (kvemu_fault_code) return;
    kvemu_fault_code = code;
    int n = snprintf(kvemu_fault_msg, sizeof kvemu_fault_msg, "%s: block (%u,%u,%u)",
                     kvemu_entry ? kvemu_entry->name : "?", kvemu_block.x, kvemu_block.y, kvemu_block.z);
    if (who && n < (int)sizeof kvemu_fault_msg) {
        char t[64];
        thread_name(*who, t, sizeof t);
        n += snprintf(kvemu_fault_msg + n, sizeof kvemu_fault_msg - n, " %s", t);
    }
    if (n < (int)sizeof kvemu_fault_msg) n += snprintf(kvemu_fault_msg + n, sizeof kvemu_fault_msg - n, ": ");
    if (n < (int)sizeof kvemu_fault_msg) vsnprintf(kvemu_fault_msg + n, sizeof kvemu_fault_msg - n, fmt, ap);
}

static void record_fault(int code, const Fiber* who, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vrecord_fault(code, who, fmt, ap);
    va_end(ap);
}

// A fault raised by the running thread: recorded, and the thread never runs again.
void fault(int code, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vrecord_fault(code, kvemu_cur, fmt, ap);
    va_end(ap);
    switch_to_scheduler(true);
    __builtin_unreachable();
}

// ---- fibers ------------------------------------------------------------------------------

static size_t kvemu_stack_bytes() {
#ifdef __SANITIZE_ADDRESS__
    return 256 << 10;
#else
    return 64 << 10;
#endif
}

static void fiber_main();

#if defined(__x86_64__)
static void start_context(Fiber& f) {
    // top: [0 = fiber_main's return address][fiber_main (ret target)][6 saved registers]
    void** top = (void**)(f.stack_lo + f.stack_size);
    top[-1] = nullptr;
    top[-2] = (void*)&fiber_main;
    for (int i = 3; i <= 8; i++) top[-i] = nullptr;
    f.ctx.sp = (void*)(top - 8);
}
static inline void jump(Context& save, Context& to) { kvemu_switch(&save.sp, to.sp); }
#else
static void start_context(Fiber& f) {
    getcontext(&f.ctx.uc);
    f.ctx.uc.uc_stack.ss_sp = f.stack_lo;
    f.ctx.uc.uc_stack.ss_size = f.stack_size;
    f.ctx.uc.uc_link = nullptr;
    makecontext(&f.ctx.uc, fiber_main, 0);
}
static inline void jump(Context& save, Context& to) { swapcontext(&save.uc, &to.uc); }
#endif

// Stacks for n fibers: one mapping, each stack with a PROT_NONE guard page below it; kept
// for the life of the process and grown on demand.
static std::vector<std::pair<char*, size_t>> kvemu_stacks;

static void ensure_fibers(int n) {
    std::vector<std::pair<char*, size_t>>& stacks = kvemu_stacks;
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), size = kvemu_stack_bytes();
    while ((int)stacks.size() < n) {
        const int batch = 32;
        char* m = (char*)mmap(nullptr, batch * (size + page), PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) {
            record_fault(LAUNCH_FAILED, nullptr, "cannot map fiber stacks");
            return;
        }
        for (int i = 0; i < batch; i++) {
            char* g = m + i * (size + page);
            mprotect(g, page, PROT_NONE);
            stacks.push_back({g + page, size});
        }
    }
    if ((int)kvemu_fibers.size() < n) kvemu_fibers.resize(n);
    for (int i = 0; i < n; i++) {
        kvemu_fibers[i].stack_lo = stacks[i].first;
        kvemu_fibers[i].stack_size = stacks[i].second;
    }
}

static void switch_to_scheduler(bool exiting) {
    Fiber* f = kvemu_cur;
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_start_switch_fiber(exiting ? nullptr : &f->asan_fake, kvemu_sched_stack,
                                   kvemu_sched_stack_size);
#else
    (void)exiting;
#endif
    jump(f->ctx, kvemu_sched);
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_finish_switch_fiber(f->asan_fake, &kvemu_sched_stack, &kvemu_sched_stack_size);
#endif
}

static void check_exit(Fiber& f);

static void fiber_main() {
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_finish_switch_fiber(nullptr, &kvemu_sched_stack, &kvemu_sched_stack_size);
#endif
    kvemu_entry->invoke(kvemu_params);
    Fiber& f = *kvemu_cur;
    check_exit(f);
    f.state = DONE;
    f.copies.clear();  // copies never waited for land in shared memory nobody reads again
    if (kvemu_done++ == 0) kvemu_first_exit = f.lin;
    switch_to_scheduler(true);
    __builtin_unreachable();
}

// ---- scheduling points -------------------------------------------------------------------

static void make_ready(Fiber& f) {
    f.state = READY;
    if (&f != kvemu_cur) kvemu_ready.push_back(f.lin);
}

void yield_point() { switch_to_scheduler(false); }

int barrier(int kind, int pred, const char* file, int line) {
    Fiber& f = *kvemu_cur;
    const char* name = kind_name(true, kind);
    if (__builtin_expect(kvemu_done > 0, 0)) {
        char t[64];
        thread_name(kvemu_fibers[kvemu_first_exit], t, sizeof t);
        fault(ILLEGAL_INSTRUCTION, "%s at %s:%d reached after %s exited (every thread of the "
              "block must reach a barrier)", name, file, line, t);
    }
    if (kvemu_bar_count > 0 && (kvemu_bar_kind != kind || kvemu_bar_line != line ||
                                (kvemu_bar_file != file && strcmp(kvemu_bar_file, file)))) {
        fault(ILLEGAL_INSTRUCTION, "divergent barrier: %s at %s:%d while %d thread(s) wait at %s "
              "at %s:%d", name, file, line, kvemu_bar_count, kind_name(true, kvemu_bar_kind),
              kvemu_bar_file, kvemu_bar_line);
    }
    if (kvemu_bar_count == 0) {
        kvemu_bar_kind = kind;
        kvemu_bar_file = file;
        kvemu_bar_line = line;
        kvemu_bar_acc = kind == BAR_AND ? 1 : 0;
    }
    if (kind == BAR_OR) kvemu_bar_acc |= pred;
    else if (kind == BAR_AND) kvemu_bar_acc &= pred;
    else if (kind == BAR_COUNT) kvemu_bar_acc += pred;
    f.state = AT_BARRIER;
    f.kind = kind;
    f.file = file;
    f.line = line;
    if (++kvemu_bar_count == kvemu_nthreads) {
        for (int i = 0; i < kvemu_nthreads; i++) {
            kvemu_fibers[i].result = (uint64_t)kvemu_bar_acc;
            make_ready(kvemu_fibers[i]);
        }
        kvemu_bar_count = 0;
    }
    yield_point();
    return (int)f.result;
}

static void complete_collective(int wbase, unsigned mask) {
    Fiber* lanes[32] = {};
    for (int l = 0; l < 32; l++)
        if (mask >> l & 1u) lanes[l] = &kvemu_fibers[wbase + l];
    uint64_t vote = 0;
    int any = 0, all = 1;
    for (int l = 0; l < 32; l++)
        if (lanes[l]) {
            const int p = lanes[l]->value != 0;
            any |= p;
            all &= p;
            if (p) vote |= 1ull << l;
        }
    for (int l = 0; l < 32; l++) {
        Fiber* f = lanes[l];
        if (!f) continue;
        const int w = f->width, seg = l & ~(w - 1);
        int src = l;
        switch (f->kind) {
            case SHFL_IDX: src = seg + (f->arg & (w - 1)); break;
            case SHFL_UP: src = (l - seg) >= f->arg ? l - f->arg : l; break;
            case SHFL_DOWN: src = (l - seg) + f->arg < w ? l + f->arg : l; break;
            case SHFL_XOR: src = l ^ f->arg; src = src < seg + w ? src : l; break;
            default: break;
        }
        if (f->kind <= SHFL_XOR)  // a source lane outside the mask gives undefined bits: poison
            f->result = (src >= 0 && src < 32 && lanes[src]) ? lanes[src]->value : ~0ull;
        else if (f->kind == VOTE_ANY) f->result = any;
        else if (f->kind == VOTE_ALL) f->result = all;
        else if (f->kind == VOTE_BALLOT) f->result = vote;
        make_ready(*f);
    }
}

uint64_t collective(int kind, unsigned mask, uint64_t value, int arg, int width,
                    const char* file, int line) {
    Fiber& f = *kvemu_cur;
    const int lane = f.lin & 31, wbase = f.lin - lane;
    const unsigned me = 1u << lane;
    Warp& w = kvemu_warps[f.lin >> 5];
    const char* name = kind_name(false, kind);
    if (!(mask & me))
        fault(ILLEGAL_INSTRUCTION, "%s at %s:%d: mask 0x%08x leaves out the calling lane %d",
              name, file, line, mask, lane);
    if (width < 1 || width > 32 || (width & (width - 1)))
        fault(ILLEGAL_INSTRUCTION, "%s at %s:%d: width %d is not a power of 2 in [1, 32]",
              name, file, line, width);
    if (mask & ~w.exist)
        fault(ILLEGAL_INSTRUCTION, "%s at %s:%d: mask 0x%08x names lane %d, which is not a "
              "thread of the block (%d threads)", name, file, line, mask,
              __builtin_ctz(mask & ~w.exist), kvemu_nthreads);
    if (mask & w.done) {
        const int l = __builtin_ctz(mask & w.done);
        char t[64];
        thread_name(kvemu_fibers[wbase + l], t, sizeof t);
        fault(ILLEGAL_INSTRUCTION, "%s at %s:%d: mask 0x%08x names lane %d (%s), which has "
              "exited", name, file, line, mask, l, t);
    }
    // the open collective of this warp that involves this lane, if any, must be this one
    Open* match = nullptr;
    for (Open& o : w.open) {
        if (!((o.mask & me) || (o.arrived & mask))) continue;
        if (o.kind != kind || o.mask != mask || o.line != line || (o.file != file && strcmp(o.file, file))) {
            const int l = __builtin_ctz(o.arrived);
            char t[64];
            thread_name(kvemu_fibers[wbase + l], t, sizeof t);
            fault(ILLEGAL_INSTRUCTION, "%s at %s:%d (mask 0x%08x) while lane %d (%s) waits at %s "
                  "at %s:%d (mask 0x%08x)", name, file, line, mask, l, t, kind_name(false, o.kind),
                  o.file, o.line, o.mask);
        }
        match = &o;
    }
    if (!match) {
        w.open.push_back(Open{kind, mask, file, line, 0});
        match = &w.open.back();
    }
    match->arrived |= me;
    f.kind = kind;
    f.mask = mask;
    f.value = value;
    f.arg = arg;
    f.width = width;
    f.file = file;
    f.line = line;
    f.state = AT_COLLECTIVE;
    if (match->arrived == mask) {
        complete_collective(wbase, mask);
        *match = w.open.back();
        w.open.pop_back();
    }
    yield_point();
    return f.result;
}

static void check_exit(Fiber& f) {
    if (kvemu_bar_count > 0)
        fault(ILLEGAL_INSTRUCTION, "exits while %d thread(s) wait at %s at %s:%d (every thread "
              "of the block must reach a barrier)", kvemu_bar_count,
              kind_name(true, kvemu_bar_kind), kvemu_bar_file, kvemu_bar_line);
    const int lane = f.lin & 31, wbase = f.lin - lane;
    Warp& w = kvemu_warps[f.lin >> 5];
    for (const Open& o : w.open) {
        if (!(o.mask >> lane & 1u)) continue;
        const int l = __builtin_ctz(o.arrived);
        char n[64];
        thread_name(kvemu_fibers[wbase + l], n, sizeof n);
        fault(ILLEGAL_INSTRUCTION, "lane %d exits while lane %d (%s) waits for it at %s at "
              "%s:%d (mask 0x%08x)", lane, l, n, kind_name(false, o.kind), o.file, o.line, o.mask);
    }
    w.done |= 1u << lane;
}

// ---- cp.async ---------------------------------------------------------------------------

size_t cvta_to_shared(const void* p, const char* file, int line) {
    if (!in_shared(p, 1))
        fault(ILLEGAL_ADDRESS, "__cvta_generic_to_shared at %s:%d: %p is not shared memory",
              file, line, p);
    return (size_t)((const char*)p - kvemu_shared_base);
}

void cp_async(uint32_t smem, const void* gmem, int size, int src_bytes, const char* file, int line) {
    char* dst = kvemu_shared_base + smem;
    if (!in_shared(dst, (size_t)size))
        fault(ILLEGAL_ADDRESS, "cp.async at %s:%d: shared address 0x%x + %d bytes is outside "
              "shared memory", file, line, smem, size);
    if (((uintptr_t)dst | (uintptr_t)gmem) & (uintptr_t)(size - 1))
        fault(MISALIGNED_ADDRESS, "cp.async at %s:%d: %d-byte copy %p -> shared 0x%x is not "
              "%d-byte aligned", file, line, size, gmem, smem, size);
    if (src_bytes < 0 || src_bytes > size)
        fault(ILLEGAL_INSTRUCTION, "cp.async at %s:%d: src_bytes %d outside [0, %d]",
              file, line, src_bytes, size);
    memset(dst, 0xFF, (size_t)size);  // poison until the wait_group that covers it
    kvemu_cur->copies.push_back({dst, (const char*)gmem, size, src_bytes, kvemu_cur->committed});
}

void cp_commit() { kvemu_cur->committed++; }

// wait_group n: every copy of a group older than the n most recent committed ones lands now
// (its source is read now); copies not yet committed stay pending.
void cp_wait(int n) {
    Fiber& f = *kvemu_cur;
    const long long limit = f.committed - n;
    size_t keep = 0;
    for (size_t i = 0; i < f.copies.size(); i++) {
        const Copy& c = f.copies[i];
        if (c.group < limit) {
            memcpy(c.dst, c.src, (size_t)c.src_bytes);
            memset(c.dst + c.src_bytes, 0, (size_t)(c.size - c.src_bytes));
        } else {
            f.copies[keep++] = c;
        }
    }
    f.copies.resize(keep);
    yield_point();
}

void check_atomic(const void* p, size_t size) {
    if ((uintptr_t)p & (size - 1))
        fault(MISALIGNED_ADDRESS, "atomic on %p: not %zu-byte aligned", p, size);
}

// ---- the block scheduler -------------------------------------------------------------------

static void describe_wait(const Fiber& f, char* buf, size_t n) {
    if (f.state == AT_BARRIER)
        snprintf(buf, n, "%s at %s:%d", kind_name(true, f.kind), f.file, f.line);
    else
        snprintf(buf, n, "%s at %s:%d (mask 0x%08x)", kind_name(false, f.kind), f.file, f.line, f.mask);
}

// No thread can run but some are not done: names each distinct wait with its threads.
static void report_deadlock() {
    char msg[1536];
    int len = snprintf(msg, sizeof msg, "deadlock: no thread can run;");
    std::vector<bool> seen(kvemu_nthreads, false);
    for (int i = 0; i < kvemu_nthreads && len < (int)sizeof msg - 1; i++) {
        const Fiber& f = kvemu_fibers[i];
        if (seen[i] || f.state == DONE) continue;
        char what[256];
        describe_wait(f, what, sizeof what);
        int count = 0, first = i, last = i;
        for (int j = i; j < kvemu_nthreads; j++) {
            char other[256];
            if (kvemu_fibers[j].state == DONE || seen[j]) continue;
            describe_wait(kvemu_fibers[j], other, sizeof other);
            if (!strcmp(other, what)) { seen[j] = true; count++; last = j; }
        }
        len += snprintf(msg + len, sizeof msg - len, " %d thread(s) (linear %d..%d) wait at %s;",
                        count, first, last, what);
    }
    if (kvemu_done && len < (int)sizeof msg - 1)
        snprintf(msg + len, sizeof msg - len, " %d exited", kvemu_done);
    record_fault(ILLEGAL_INSTRUCTION, nullptr, "%s", msg);
}

static void run_block(uint3 block) {
    kvemu_block = block;
    const int n = kvemu_nthreads;
    poison_shared();
    kvemu_done = 0;
    kvemu_bar_count = 0;
    kvemu_ready.clear();
    kvemu_warps.resize((size_t)(n + 31) / 32);
    for (size_t w = 0; w < kvemu_warps.size(); w++) {
        const int lanes = n - 32 * (int)w < 32 ? n - 32 * (int)w : 32;
        kvemu_warps[w].exist = lanes == 32 ? ~0u : (1u << lanes) - 1u;
        kvemu_warps[w].done = 0;
        kvemu_warps[w].open.clear();
    }
    for (int i = 0; i < n; i++) {
        Fiber& f = kvemu_fibers[i];
        f.lin = i;
        f.ids.tid = uint3{(unsigned)(i % kvemu_bdim.x), (unsigned)(i / kvemu_bdim.x % kvemu_bdim.y),
                          (unsigned)(i / (kvemu_bdim.x * kvemu_bdim.y))};
        f.state = READY;
        f.committed = 0;
        f.copies.clear();
        f.asan_fake = nullptr;
#ifdef __SANITIZE_ADDRESS__
        __asan_unpoison_memory_region(f.stack_lo, f.stack_size);  // frames abandoned by a fault
#endif
        start_context(f);
        kvemu_ready.push_back(i);
    }
    while (!kvemu_ready.empty() && !kvemu_fault_code) {
        const size_t k = (size_t)(next_random() % kvemu_ready.size());
        const int i = kvemu_ready[k];
        kvemu_ready[k] = kvemu_ready.back();
        kvemu_ready.pop_back();
        Fiber& f = kvemu_fibers[i];
        kvemu_cur = &f;
        kvemu_cur_ids = &f.ids;
#ifdef __SANITIZE_ADDRESS__
        void* fake = nullptr;
        __sanitizer_start_switch_fiber(&fake, f.stack_lo, f.stack_size);
#endif
        jump(kvemu_sched, f.ctx);
#ifdef __SANITIZE_ADDRESS__
        __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
        kvemu_cur = nullptr;
        if (f.state == READY) kvemu_ready.push_back(i);
    }
    if (!kvemu_fault_code && kvemu_done < n) report_deadlock();
}

// The blocks of the grid in a seeded random order: a Fisher-Yates shuffle, or for very
// large grids an affine permutation i -> (a * i + b) mod count.
static void run_grid() {
    const uint64_t count = (uint64_t)kvemu_gdim.x * kvemu_gdim.y * kvemu_gdim.z;
    std::vector<uint64_t> order;
    uint64_t a = 1, b = 0;
    if (count <= (1u << 20)) {
        order.resize(count);
        for (uint64_t i = 0; i < count; i++) order[i] = i;
        for (uint64_t i = count; i > 1; i--) std::swap(order[i - 1], order[next_random() % i]);
    } else {
        b = next_random() % count;
        a = next_random() % count | 1;
        auto gcd = [](uint64_t x, uint64_t y) { while (y) { uint64_t t = x % y; x = y; y = t; } return x; };
        while (gcd(a, count) != 1) a += 2;
    }
    for (uint64_t i = 0; i < count && !kvemu_fault_code; i++) {
        const uint64_t id = order.empty() ? (unsigned __int128)(a * (unsigned __int128)i + b) % count : order[i];
        const uint64_t gx = kvemu_gdim.x, gy = kvemu_gdim.y;
        run_block(uint3{(unsigned)(id % gx), (unsigned)(id / gx % gy), (unsigned)(id / (gx * gy))});
    }
}

// ---- the registry ----------------------------------------------------------------------

template <class... A, size_t... I>
inline void invoke_with(void (*fn)(A...), void** p, std::index_sequence<I...>) {
    fn(*static_cast<A*>(p[I])...);
}

template <auto F>
struct Kernel;
template <class... A, void (*F)(A...)>
struct Kernel<F> {
    static constexpr int n = sizeof...(A);
    static constexpr int sizes[n + 1] = {(int)sizeof(A)..., 0};
    static constexpr int pointers[n + 1] = {(int)std::is_pointer<A>::value..., 0};
    static void invoke(void** p) { invoke_with(F, p, std::index_sequence_for<A...>{}); }
    static Entry entry(const char* name) { return Entry{name, n, sizes, pointers, &invoke}; }
};

}  // namespace kvemu

// ---- the C ABI used by kvcore/gpu/_emu/kernels.py ----------------------------------------------

extern const kvemu::Entry kvemu_entries[];
extern const int kvemu_entry_count;

KVEMU_API int kvemu_kernel_count() { return kvemu_entry_count; }
KVEMU_API const char* kvemu_kernel_name(int i) { return kvemu_entries[i].name; }
KVEMU_API int kvemu_kernel_nparams(int i) { return kvemu_entries[i].nparams; }
KVEMU_API int kvemu_kernel_param_size(int i, int j) { return kvemu_entries[i].sizes[j]; }
KVEMU_API int kvemu_kernel_param_is_pointer(int i, int j) { return kvemu_entries[i].pointers[j]; }

// Runs the whole grid of kernel `i` on the calling thread. Returns 0, or a kvemu::Fault
// code with the message in errbuf.
KVEMU_API int kvemu_launch(int i, const unsigned* grid, const unsigned* block, unsigned shmem,
                           void** params, unsigned long long seed, char* errbuf, int errlen) {
    using namespace kvemu;
    std::lock_guard<std::mutex> guard(kvemu_lock);
    kvemu_fault_code = 0;
    kvemu_fault_msg[0] = 0;
    kvemu_entry = &kvemu_entries[i];
    const unsigned long long threads = (unsigned long long)block[0] * block[1] * block[2];
    if (!block[0] || !block[1] || !block[2] || block[0] > 1024 || block[1] > 1024 ||
        block[2] > 64 || threads > 1024) {
        record_fault(INVALID_VALUE, nullptr, "block (%u,%u,%u): at most (1024,1024,64) and 1024 "
                     "threads, none 0", block[0], block[1], block[2]);
    } else if (!grid[0] || !grid[1] || !grid[2] || grid[0] > 0x7FFFFFFFu || grid[1] > 65535 ||
               grid[2] > 65535) {
        record_fault(INVALID_VALUE, nullptr, "grid (%u,%u,%u): x in [1, 2^31 - 1], y and z in "
                     "[1, 65535]", grid[0], grid[1], grid[2]);
    } else if (shmem > 48 * 1024) {
        record_fault(INVALID_VALUE, nullptr, "%u bytes of dynamic shared memory: more than 48 KiB",
                     shmem);
    } else {
        kvemu_rng = seed * 0x2545F4914F6CDD1Dull + 0x9E3779B97F4A7C15ull;
        kvemu_gdim = dim3{grid[0], grid[1], grid[2]};
        kvemu_bdim = dim3{block[0], block[1], block[2]};
        kvemu_nthreads = (int)threads;
        kvemu_params = params;
        locate_shared();
        ensure_fibers(kvemu_nthreads);
        if (!kvemu_fault_code) run_grid();
    }
    kvemu_cur = nullptr;
    if (kvemu_fault_code && errbuf && errlen > 0) snprintf(errbuf, (size_t)errlen, "%s", kvemu_fault_msg);
    return kvemu_fault_code;
}

// Bytes of the module's shared-memory area (all kernels' __shared__ variables together).
KVEMU_API unsigned long long kvemu_shared_bytes() {
    std::lock_guard<std::mutex> guard(kvemu::kvemu_lock);
    kvemu::locate_shared();
    return (unsigned long long)(kvemu::kvemu_shared_end - kvemu::kvemu_shared_base);
}
