// attn-cuda's kernels on the CPU (`src/emu.rs`): the CUDA C vocabulary and
// the PTX instructions the kernels use, emulated so that a host C++
// compiler builds the very source NVRTC compiles (with ATTN_EMU defined,
// the kernels' `asm` helpers call the functions below instead).
//
// Each GPU thread runs as a fiber on the calling OS thread, one block at a
// time; a fiber runs until it reaches a barrier (`__syncthreads`) or a warp
// collective (shuffles, `ldmatrix`, `mma.sync`, `__syncwarp`), where it
// yields. Warps run as far apart as the barriers let them, and lanes in
// alternating order (`run_block`). A collective completes when all 32
// lanes of the warp have reached it: the last lane to arrive computes
// every lane's result from what each deposited, exactly as the PTX ISA
// defines the instruction's fragments (written here from the ISA's
// tables, not from the kernels' comments). What it checks, each an error
// naming the block and thread:
// - lanes of one warp at different collectives, a collective with lanes
//   that have exited, a warp mask other than all lanes, a barrier or
//   collective that can never complete (deadlock);
// - shared memory: `ldmatrix` rows and `cp.async` targets inside the
//   launch's dynamic size and 16-byte aligned, `cp.async` sources 16-byte
//   aligned, 32-bit loads 4-byte aligned (`check_aligned`: a GPU faults,
//   x86 does not); the whole shared arena is filled with 0xff bytes (a
//   NaN in every float and 16-bit float) before each block, so a read of
//   a value never written comes out NaN;
// - `cp.async`: the target bytes turn to poison when the copy is issued,
//   and the data lands only when `cp.async.wait_group` (or the thread's
//   exit) retires its group, the latest moment the ISA allows: a read
//   before the wait, and a refill of a stage other warps still read (a
//   missing barrier), both bring NaN;
// - a write into shared bytes while a `cp.async` into them is in flight;
// - static shared arrays (STATIC_SMEM) live in the same poisoned arena,
//   after the dynamic ones, and must fit a block with them;
// - a grid or block past CUDA's limits.
// Global memory bounds are the host's: `emu.rs` pads every buffer with
// poison and checks the padding after each launch; an index past a
// fixed-size array (UBSan's bounds check, `emu.rs`'s flags) stops the
// process naming the line.
//
// Arithmetic: `mma.sync` multiplies the 16-bit inputs exactly and adds the
// products in f32 in k order, rounding to nearest at each step (tensor
// cores group the additions and truncate: an error bound tuned here alone
// could be optimistic; the conformance bound is derived, not tuned);
// `ex2.approx.ftz` is exp2f with subnormals flushed; conversions round to
// nearest even as the instructions do. Not checked: races between blocks
// (blocks run one after another), lanes of a warp meeting at different
// call sites of the same collective. `__launch_bounds__` is empty here;
// a unit test (`variant.rs`, `launches_match_the_kernels_launch_bounds`)
// checks each kernel's bound against the block the host launches.
// Needs GCC 12 or Clang 15 (`_Float16`).

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#if !defined(__x86_64__)
#error "the kernel emulator's fibers switch stacks on x86-64 only"
#endif

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static
#define DYNAMIC_SMEM(T, name) T* name = (T*)emu::g.smem
#define STATIC_SMEM(T, name, dims) \
    T(&name) dims = *reinterpret_cast<T(*) dims>(emu::static_smem(#name, sizeof(T dims)))

#define EMU_EXPORT extern "C" __attribute__((visibility("default")))

namespace emu {

struct Dim3 {
    unsigned x, y, z;
};

struct Copy {
    unsigned char* dst;
    const unsigned char* src;
    unsigned bytes;
};

struct Thread {
    void* sp = nullptr;
    unsigned char* stack = nullptr;  // the top of its stack
    Dim3 tid{0, 0, 0};
    unsigned id = 0;  // linear: x fastest, as the hardware numbers lanes
    int lane = 0, warp = 0;
    bool done = false;
    const char* waiting = "";  // where it last yielded (for a deadlock's report)
    std::vector<std::vector<Copy>> groups;  // committed cp.async groups, oldest first
    std::vector<Copy> open;                 // copies not yet committed
};

// What one lane brings to a warp collective and gets back.
struct Slot {
    uint32_t in[10];
    uint64_t arg;
    uint32_t out[4];
};

struct Warp {
    int arrived = 0;
    unsigned gen = 0;
    int live = 32;
    const char* op = "";
    Slot s[32];
};

// One launch, as `Launch` in src/emu.rs fills it. The shared-memory
// arena (SMEM_CAP bytes, 16-byte aligned) and the fibers' stacks are the
// host's, one for every compiled variant: `stack_count` stacks of
// `stack_size` bytes, a guard page at the low end of each.
struct Launch {
    unsigned grid[3];
    unsigned block[3];
    uint64_t smem;
    const void* params;
    char* err;
    uint64_t err_len;
    unsigned char* stacks;
    uint64_t stack_size;
    uint64_t stack_count;
    unsigned char* smem_arena;
};
constexpr size_t SMEM_CAP = 232448;  // 227 KiB, Hopper's most per block

struct State {
    Dim3 gdim{1, 1, 1}, bdim{1, 1, 1}, block{0, 0, 0};
    std::vector<Thread> threads;
    std::vector<Warp> warps;
    Thread* cur = nullptr;
    void* sched_sp = nullptr;
    int bar_arrived = 0;
    unsigned bar_gen = 0;
    int live = 0;
    bool progress = false;
    bool failed = false;
    char msg[512] = {0};
    unsigned char* smem = nullptr;  // the arena, SMEM_CAP bytes
    uint64_t smem_bytes = 0;         // the launch's dynamic size
    // Static shared arrays, placed after the dynamic ones in each block.
    std::vector<std::pair<const char*, uint64_t>> statics;
    uint64_t static_top = 0;
    void (*body)(const void*) = nullptr;
    const void* params = nullptr;
};

static State g;

extern "C" __attribute__((visibility("hidden"))) void attn_emu_switch(void** save, void* to);

// Saves the callee-saved registers and the stack pointer into *save, then
// resumes the context whose stack pointer is `to` (SysV x86-64 ABI).
asm(R"(
    .text
    .p2align 4
    .globl attn_emu_switch
    .hidden attn_emu_switch
    .type attn_emu_switch, @function
attn_emu_switch:
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
    .size attn_emu_switch, .-attn_emu_switch
)");

static void yield_at(const char* where) {
    g.cur->waiting = where;
    attn_emu_switch(&g.cur->sp, g.sched_sp);
}

// Records the first error and abandons the block: the scheduler never
// resumes a fiber after this.
[[noreturn]] static void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail(const char* fmt, ...) {
    if (!g.failed) {
        g.failed = true;
        int n = snprintf(g.msg, sizeof g.msg, "block (%u,%u,%u) thread %u: ", g.block.x, g.block.y,
                         g.block.z, g.cur ? g.cur->id : 0u);
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(g.msg + n, sizeof g.msg - n, fmt, ap);
        va_end(ap);
    }
    for (;;) yield_at("failed");
}

static void retire(Thread& t, size_t keep) {
    while (t.groups.size() > keep) {
        for (const Copy& c : t.groups.front()) {
            // Still the poison of its issue: nothing wrote the target
            // while the copy was in flight (a race on a GPU).
            for (int k = 0; k < 16; ++k) {
                if (c.dst[k] != 0xff) fail("shared bytes written while a cp.async into them was in flight");
            }
            memcpy(c.dst, c.src, c.bytes);
            memset(c.dst + c.bytes, 0, 16 - c.bytes);
        }
        t.groups.erase(t.groups.begin());
    }
}

static void cp_async_commit_group_of(Thread& t) {
    t.groups.push_back(t.open);
    t.open.clear();
}

static void block_barrier() {
    g.bar_arrived++;
    g.progress = true;
    if (g.bar_arrived == g.live) {
        g.bar_arrived = 0;
        g.bar_gen++;
        return;
    }
    unsigned gen = g.bar_gen;
    while (g.bar_gen == gen) yield_at("__syncthreads");
}

// The calling lane has filled its slot; waits for the warp's 32 lanes at
// the same collective `op`; the last to arrive runs `all(warp)`, which
// fills every lane's `out`.
template <class F>
static void warp_op(const char* op, unsigned mask, F all) {
    Warp& w = g.warps[g.cur->warp];
    if (mask != 0xffffffffu) fail("%s with lane mask %#x (only whole warps are emulated)", op, mask);
    if (w.live != 32) fail("%s in a warp with %d lanes exited", op, 32 - w.live);
    if (w.arrived == 0) {
        w.op = op;
    } else if (strcmp(w.op, op) != 0) {
        fail("lanes of warp %d at different collectives: %s and %s", g.cur->warp, w.op, op);
    }
    w.arrived++;
    g.progress = true;
    if (w.arrived == 32) {
        all(w);
        w.arrived = 0;
        w.gen++;
        return;
    }
    unsigned gen = w.gen;
    while (w.gen == gen) yield_at(op);
}

static void thread_exit() {
    Thread& t = *g.cur;
    if (!t.open.empty()) cp_async_commit_group_of(t);
    retire(t, 0);
    t.done = true;
    g.live--;
    g.warps[t.warp].live--;
    g.progress = true;
    if (g.bar_arrived > 0 && g.bar_arrived == g.live) {
        g.bar_arrived = 0;
        g.bar_gen++;
    }
    if (g.warps[t.warp].arrived > 0) {
        fail("exited while %d lanes of its warp wait at %s", g.warps[t.warp].arrived,
             g.warps[t.warp].op);
    }
    for (;;) yield_at("exited");
}

static void fiber_main() {
    g.body(g.params);
    thread_exit();
}

// The block's static shared array `name` of `bytes` (STATIC_SMEM): the
// same bytes for every thread of the block, in the poisoned arena after
// the dynamic shared memory; static and dynamic together must fit a block.
static unsigned char* static_smem(const char* name, uint64_t bytes) {
    for (auto& s : g.statics) {
        if (strcmp(s.first, name) == 0) return g.smem + s.second;
    }
    const uint64_t off = g.static_top;
    g.static_top += (bytes + 15) / 16 * 16;
    if (g.static_top > SMEM_CAP) {
        fail("static shared memory (%s) past a block's %zu bytes with the launch's %llu dynamic",
             name, SMEM_CAP, (unsigned long long)g.smem_bytes);
    }
    g.statics.emplace_back(name, off);
    return g.smem + off;
}

// Shared-memory offset of `p` (what `cvta.to.shared` gives), checked to
// lie in the arena.
static uint32_t to_shared(const void* p) {
    const unsigned char* b = (const unsigned char*)p;
    if (b < g.smem || b >= g.smem + SMEM_CAP) fail("a shared-memory address outside shared memory");
    return (uint32_t)(b - g.smem);
}

static unsigned char* shared_at(uint32_t off, uint32_t bytes, const char* what) {
    if ((uint64_t)off + bytes > g.smem_bytes) {
        fail("%s reads or writes shared bytes %u..%u, past the launch's %llu", what, off, off + bytes,
             (unsigned long long)g.smem_bytes);
    }
    return g.smem + off;
}

static void run_block() {
    const unsigned n = g.bdim.x * g.bdim.y * g.bdim.z;
    g.live = (int)n;
    g.bar_arrived = 0;
    g.warps.assign((n + 31) / 32, Warp());
    for (unsigned i = 0; i < g.warps.size(); ++i) {
        unsigned lanes = n - 32 * i;
        g.warps[i].live = lanes < 32 ? (int)lanes : 32;
    }
    memset(g.smem, 0xff, SMEM_CAP);
    g.statics.clear();
    g.static_top = (g.smem_bytes + 15) / 16 * 16;
    for (unsigned i = 0; i < n; ++i) {
        Thread& t = g.threads[i];
        t.id = i;
        t.tid = Dim3{i % g.bdim.x, (i / g.bdim.x) % g.bdim.y, i / (g.bdim.x * g.bdim.y)};
        t.lane = (int)(i % 32);
        t.warp = (int)(i / 32);
        t.done = false;
        t.groups.clear();
        t.open.clear();
        // The first switch pops six zero registers and returns into
        // fiber_main with the stack aligned as at a call.
        void** sp = (void**)(t.stack - 64);
        for (int r = 0; r < 6; ++r) sp[r] = nullptr;
        sp[6] = (void*)&fiber_main;
        sp[7] = nullptr;
        t.sp = sp;
    }
    // Each warp runs as far as it can (until all its lanes wait at a
    // block barrier or have exited) before the next starts, in ascending
    // warp order between one pair of barriers and descending between the
    // next: the warps drift as far apart as the barriers allow, so a
    // missing barrier lets one warp read what another has not written yet
    // or overwrite what another still reads.
    const unsigned warps = (unsigned)g.warps.size();
    for (;;) {
        bool alive = false, moved = false;
        const bool up = g.bar_gen % 2 == 0;
        for (unsigned k = 0; k < warps; ++k) {
            const unsigned w = up ? k : warps - 1 - k;
            for (;;) {
                g.progress = false;
                // Lanes too run in ascending order between one pair of the
                // warp's collectives and descending between the next, so a
                // lane reading what another lane wrote without a
                // `__syncwarp` sees the old value one way or the other.
                const unsigned lo = 32 * w, hi = (n < 32 * (w + 1) ? n : 32 * (w + 1));
                const bool lanes_up = g.warps[w].gen % 2 == 0;
                for (unsigned j = lo; j < hi; ++j) {
                    const unsigned i = lanes_up ? j : hi - 1 - (j - lo);
                    Thread& t = g.threads[i];
                    if (t.done) continue;
                    alive = true;
                    g.cur = &t;
                    attn_emu_switch(&g.sched_sp, t.sp);
                    g.cur = nullptr;
                    if (g.failed) return;
                }
                if (!g.progress) break;
                moved = true;
            }
        }
        if (!alive) return;
        if (!moved) {
            for (unsigned i = 0; i < n; ++i) {
                if (!g.threads[i].done) {
                    g.cur = &g.threads[i];
                    g.failed = true;
                    snprintf(g.msg, sizeof g.msg,
                             "block (%u,%u,%u): deadlock: thread %u waits at %s forever (%d of %d "
                             "threads at __syncthreads)",
                             g.block.x, g.block.y, g.block.z, i, g.threads[i].waiting, g.bar_arrived,
                             g.live);
                    return;
                }
            }
        }
    }
}

static int run(const Launch& l, void (*body)(const void*)) {
    g.failed = false;
    g.msg[0] = 0;
    if (l.smem > SMEM_CAP) {
        snprintf(l.err, l.err_len, "%llu bytes of dynamic shared memory, past %zu",
                 (unsigned long long)l.smem, SMEM_CAP);
        return 1;
    }
    if (l.grid[0] == 0 || l.grid[1] == 0 || l.grid[2] == 0 || l.grid[0] > 0x7fffffffu ||
        l.grid[1] > 65535 || l.grid[2] > 65535) {
        snprintf(l.err, l.err_len, "grid (%u,%u,%u) past CUDA's limits", l.grid[0], l.grid[1],
                 l.grid[2]);
        return 1;
    }
    const uint64_t threads = (uint64_t)l.block[0] * l.block[1] * l.block[2];
    if (threads == 0 || threads > 1024 || l.block[2] > 64) {
        snprintf(l.err, l.err_len, "block (%u,%u,%u) past CUDA's limits", l.block[0], l.block[1],
                 l.block[2]);
        return 1;
    }
    if (l.smem_arena == nullptr || (uintptr_t)l.smem_arena % 16 != 0) {
        snprintf(l.err, l.err_len, "no 16-byte aligned shared-memory arena");
        return 1;
    }
    g.smem = l.smem_arena;
    g.smem_bytes = l.smem;
    g.gdim = Dim3{l.grid[0], l.grid[1], l.grid[2]};
    g.bdim = Dim3{l.block[0], l.block[1], l.block[2]};
    g.body = body;
    g.params = l.params;
    if (l.stack_count < threads || l.stack_size % 16 != 0) {
        snprintf(l.err, l.err_len, "%llu stacks for %llu threads",
                 (unsigned long long)l.stack_count, (unsigned long long)threads);
        return 1;
    }
    g.threads.resize(threads);
    for (unsigned i = 0; i < threads; ++i) g.threads[i].stack = l.stacks + (i + 1) * l.stack_size;
    for (unsigned z = 0; z < l.grid[2]; ++z) {
        for (unsigned y = 0; y < l.grid[1]; ++y) {
            for (unsigned x = 0; x < l.grid[0]; ++x) {
                g.block = Dim3{x, y, z};
                run_block();
                if (g.failed) {
                    snprintf(l.err, l.err_len, "%s", g.msg);
                    return 1;
                }
            }
        }
    }
    return 0;
}

// ---- PTX and CUDA intrinsics ----------------------------------------------

// A GPU faults on a load or store not aligned to its width; x86 does not.
static inline void check_aligned(const void* p, uintptr_t bytes, const char* what) {
    if ((uintptr_t)p % bytes != 0) fail("%s at %p, not %u-byte aligned", what, p, (unsigned)bytes);
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

// cvt.rn.bf16.f32: round to nearest even; a NaN stays a (quiet) NaN.
static inline uint16_t bf16_rn(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_f32(uint16_t x) { return bits_f32((uint32_t)x << 16); }

// cvt.rn.f16.f32 and cvt.f32.f16 (exact), subnormals kept.
static inline uint16_t f16_rn(float f) {
    _Float16 h = (_Float16)f;
    uint16_t x;
    memcpy(&x, &h, 2);
    return x;
}

static inline float f16_f32(uint16_t x) {
    _Float16 h;
    memcpy(&h, &x, 2);
    return (float)h;
}

// cvt.rn.{bf16x2,f16x2}.f32 d, a, b: a to the upper half, b to the lower.
static inline uint32_t cvt_rn_bf16x2(float a, float b) {
    return ((uint32_t)bf16_rn(a) << 16) | bf16_rn(b);
}

static inline uint32_t cvt_rn_f16x2(float a, float b) {
    return ((uint32_t)f16_rn(a) << 16) | f16_rn(b);
}

static inline bool subnormal(float x) { return x != 0.0f && std::fabs(x) < 1.17549435e-38f; }

// ex2.approx.ftz.f32 (exact here; the ISA allows 2 ulp).
static inline float ex2_approx_ftz(float x) {
    if (subnormal(x)) x = 0.0f;
    float y = std::exp2(x);
    return subnormal(y) ? 0.0f : y;
}

// cp.async.cg.shared.global [dst], [src], 16, bytes.
static inline void cp_async_cg16(uint32_t dst, const void* src, uint32_t bytes) {
    if (dst % 16 != 0) fail("cp.async to shared offset %u, not 16-byte aligned", dst);
    if ((uintptr_t)src % 16 != 0) fail("cp.async from %p, not 16-byte aligned", src);
    if (bytes > 16) fail("cp.async of %u source bytes (at most 16)", bytes);
    unsigned char* d = shared_at(dst, 16, "cp.async");
    // Poison now, data when the group retires: a read before the wait
    // (a missing wait) and a write into bytes others still read (a
    // missing barrier before the refill) both bring NaN.
    memset(d, 0xff, 16);
    g.cur->open.push_back(Copy{d, (const unsigned char*)src, bytes});
}

static inline void cp_async_commit_group() { cp_async_commit_group_of(*g.cur); }

static inline void cp_async_wait_group(int n) { retire(*g.cur, (size_t)n); }

// ldmatrix.sync.aligned.m8n8.{x2,x4}[.trans].shared.b16: lanes 8i..8i+7
// give the row addresses of matrix i; lane l receives in register i, of
// matrix i, row l/4's elements 2(l%4) and 2(l%4)+1, or with .trans column
// l/4's elements of rows 2(l%4) and 2(l%4)+1 (the lower index in the lower
// half).
static inline void ldmatrix(int count, bool trans, uint32_t addr, uint32_t* r) {
    Thread& me = *g.cur;
    g.warps[me.warp].s[me.lane].arg = addr;
    const char* op = count == 4 ? (trans ? "ldmatrix.x4.trans" : "ldmatrix.x4")
                                : (trans ? "ldmatrix.x2.trans" : "ldmatrix.x2");
    warp_op(op, 0xffffffffu, [&](Warp& w) {
        for (int i = 0; i < count; ++i) {
            for (int rr = 0; rr < 8; ++rr) {
                uint32_t a = (uint32_t)w.s[8 * i + rr].arg;
                if (a % 16 != 0) fail("%s row address %u of matrix %d not 16-byte aligned", op, a, i);
                shared_at(a, 16, op);
            }
        }
        for (int l = 0; l < 32; ++l) {
            for (int i = 0; i < count; ++i) {
                uint16_t e[2];
                for (int k = 0; k < 2; ++k) {
                    int row = trans ? 2 * (l % 4) + k : l / 4;
                    int col = trans ? l / 4 : 2 * (l % 4) + k;
                    const unsigned char* p = g.smem + w.s[8 * i + row].arg + 2 * col;
                    memcpy(&e[k], p, 2);
                }
                w.s[l].out[i] = (uint32_t)e[0] | ((uint32_t)e[1] << 16);
            }
        }
    });
    for (int i = 0; i < count; ++i) r[i] = g.warps[me.warp].s[me.lane].out[i];
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 with
// g = lane / 4, t = lane % 4 (PTX ISA, "Matrix Fragments for
// mma.m16n8k16"): A's register i holds row g + 8 (i % 2), columns
// 2t + 8 (i / 2) and the next; B's register i, rows (k) 2t + 8i and the
// next of column g; C's element i, row g + 8 (i / 2), column 2t + i % 2.
template <bool BF16>
static inline void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                            uint32_t b0, uint32_t b1) {
    Thread& me = *g.cur;
    Slot& s = g.warps[me.warp].s[me.lane];
    uint32_t in[10] = {a0, a1, a2, a3, b0, b1, f32_bits(c[0]), f32_bits(c[1]), f32_bits(c[2]),
                       f32_bits(c[3])};
    memcpy(s.in, in, sizeof in);
    warp_op(BF16 ? "mma.m16n8k16.bf16" : "mma.m16n8k16.f16", 0xffffffffu, [&](Warp& w) {
        auto half = [](uint32_t reg, int k) {
            uint16_t x = (uint16_t)(k == 0 ? reg & 0xffffu : reg >> 16);
            return BF16 ? bf16_f32(x) : f16_f32(x);
        };
        float A[16][16], B[16][8], C[16][8];
        for (int l = 0; l < 32; ++l) {
            const int gq = l / 4, tq = l % 4;
            for (int i = 0; i < 4; ++i) {
                for (int k = 0; k < 2; ++k) {
                    A[gq + 8 * (i % 2)][2 * tq + 8 * (i / 2) + k] = half(w.s[l].in[i], k);
                }
            }
            for (int i = 0; i < 2; ++i) {
                for (int k = 0; k < 2; ++k) B[2 * tq + 8 * i + k][gq] = half(w.s[l].in[4 + i], k);
            }
            for (int i = 0; i < 4; ++i) C[gq + 8 * (i / 2)][2 * tq + i % 2] = bits_f32(w.s[l].in[6 + i]);
        }
        for (int l = 0; l < 32; ++l) {
            const int gq = l / 4, tq = l % 4;
            for (int i = 0; i < 4; ++i) {
                const int row = gq + 8 * (i / 2), col = 2 * tq + i % 2;
                float d = C[row][col];
                for (int k = 0; k < 16; ++k) d = std::fma(A[row][k], B[k][col], d);
                w.s[l].out[i] = f32_bits(d);
            }
        }
    });
    for (int i = 0; i < 4; ++i) c[i] = bits_f32(s.out[i]);
}

}  // namespace emu

// ---- the CUDA C vocabulary the kernels use --------------------------------

#define threadIdx (emu::g.cur->tid)
#define blockIdx (emu::g.block)
#define blockDim (emu::g.bdim)
#define gridDim (emu::g.gdim)

static inline float __int_as_float(int x) { return emu::bits_f32((uint32_t)x); }
static inline float __uint_as_float(unsigned x) { return emu::bits_f32(x); }
static inline unsigned __float_as_uint(float x) { return emu::f32_bits(x); }
static inline int __float_as_int(float x) { return (int)emu::f32_bits(x); }
static inline size_t __cvta_generic_to_shared(const void* p) { return emu::to_shared(p); }

static inline void __syncthreads() { emu::block_barrier(); }

static inline void __syncwarp(unsigned mask = 0xffffffffu) {
    emu::warp_op("__syncwarp", mask, [](emu::Warp&) {});
}

template <class T>
static inline T emu_shfl(const char* op, unsigned mask, T v, int arg, bool xor_lanes) {
    static_assert(sizeof(T) <= 8, "shuffled values are at most 8 bytes");
    emu::Thread& me = *emu::g.cur;
    emu::Slot& s = emu::g.warps[me.warp].s[me.lane];
    memcpy(s.in, &v, sizeof(T));
    s.arg = (uint64_t)(uint32_t)arg;
    emu::warp_op(op, mask, [&](emu::Warp& w) {
        for (int l = 0; l < 32; ++l) {
            int src = xor_lanes ? (l ^ (int)w.s[l].arg) : (int)w.s[l].arg;
            src &= 31;
            memcpy(w.s[l].out, w.s[src].in, sizeof(T));
        }
    });
    T r;
    memcpy(&r, s.out, sizeof(T));
    return r;
}

template <class T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    return emu_shfl("shfl.bfly", mask, v, lane_mask, true);
}

template <class T>
static inline T __shfl_sync(unsigned mask, T v, int src_lane) {
    return emu_shfl("shfl.idx", mask, v, src_lane, false);
}

// One launch of kernel `name`, whose parameter block has type `P`.
#define EMU_KERNEL(name, P)                                                      \
    static void emu_body_##name(const void* p) { name(*(const P*)p); }          \
    EMU_EXPORT int emu_run_##name(const emu::Launch* l) {                       \
        return emu::run(*l, emu_body_##name);                                    \
    }
