// Runs one launch of a kernel of mpsboost.ops.fp8_metal.SOURCE on the CPU, the way Metal's dispatchThreads runs
// it: `driver IN OUT`. IN (written by tests/ops/test_fp8_metal_emulated.py), little-endian:
//   8 bytes "MPSBEMU2"; 64 bytes the kernel's name (NUL padded);
//   int64 threads[2] (threads per grid dimension, torch.mps.compile_shader's `threads=`), group[2]
//   (`group_size=`); int64 nbuf, nscalar; int64 size[nbuf] (bytes); int64 scalar[nscalar] (the kernel's
//   `constant long&` arguments, in order); then the bytes of each buffer.
// The kernel's parameters must be nbuf `device` pointers, nscalar `constant long&`, then the uint2 threadgroup
// position, the uint simdgroup index and the uint lane (checked at compile time against the SOURCE signature
// and at run time against IN). Every buffer is its own allocation of exactly its size, 16-byte aligned like an
// MTLBuffer's contents (so AddressSanitizer, when built with it, catches a read one byte past any of them).
// OUT: the bytes of every buffer after the launch, in order.
// Each threadgroup's threads run as fibers of this one OS thread (class Fibers; metal_stdlib's simd_sum synchronises
// the 32 lanes of each simdgroup at its barriers); threadgroups run one after another.
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.metal"  // SOURCE, verbatim; its `#include <metal_stdlib>` is tests/ops/metal_emu/metal_stdlib

namespace {

[[noreturn]] void die(const std::string &what) {
  std::fprintf(stderr, "driver: %s\n", what.c_str());
  std::exit(2);
}

struct Buffer {
  void *p = nullptr;
  size_t n = 0;
  explicit Buffer(size_t bytes) : n(bytes) { p = ::operator new(bytes ? bytes : 1, std::align_val_t{16}); }
  ~Buffer() { ::operator delete(p, std::align_val_t{16}); }
  Buffer(const Buffer &) = delete;
  Buffer &operator=(const Buffer &) = delete;
};

template <class... P>
constexpr size_t leading_pointers() {
  constexpr bool is_ptr[] = {std::is_pointer_v<P>...};
  size_t i = 0;
  while (i < sizeof...(P) && is_ptr[i]) {
    ++i;
  }
  return i;
}

// The kernel's I-th argument: a buffer, a scalar (by reference, as `constant long&`) or a thread position.
template <size_t I, class P, size_t NPTR, size_t NSC>
decltype(auto) argument(std::vector<std::unique_ptr<Buffer>> &bufs, std::vector<long> &sc, metal::uint2 tg,
                        metal::uint sg, metal::uint lane) {
  if constexpr (I < NPTR) {
    return static_cast<P>(bufs[I]->p);
  } else if constexpr (I < NPTR + NSC) {
    return static_cast<long &>(sc[I - NPTR]);
  } else if constexpr (I == NPTR + NSC) {
    return tg;
  } else if constexpr (I == NPTR + NSC + 1) {
    return sg;
  } else {
    return lane;
  }
}

// The threads of one threadgroup as fibers on this one OS thread (ucontext), each on its own stack: a thread runs
// until it waits at a barrier (metal::emu::Barrier yields to the scheduler), and the scheduler resumes the threads in
// turn until every one has returned. A std::thread per thread outnumbers the cores many times over, and its waiters
// spin against the threads they wait for; a fiber switch is a function call and a signal mask.
// Only one thread runs at a time, so the kernel's memory needs no atomics here; what concurrency would break (a
// read of another thread's write with no barrier between) shows as a wrong value, as the threads run in an order
// that changes between threadgroups. A barrier some thread never reaches is a deadlock, reported as one.
class Fibers {
 public:
  Fibers(int n, std::function<void(int)> body) : body_(std::move(body)), fibers_(size_t(n)) {
    for (auto &f : fibers_) {
      f.stack = std::make_unique<unsigned char[]>(STACK);
    }
  }

  void run(metal::emu::Threadgroup &ctx, bool descending) {
    const int n = int(fibers_.size());
    for (int i = 0; i < n; ++i) {
      Fiber &f = fibers_[size_t(i)];
      f.done = false;
      if (getcontext(&f.uc) != 0) {
        die("getcontext failed");
      }
      f.uc.uc_stack.ss_sp = f.stack.get();
      f.uc.uc_stack.ss_size = STACK;
      f.uc.uc_link = &sched_;
      makecontext(&f.uc, reinterpret_cast<void (*)()>(&Fibers::entry), 0);
    }
    metal::emu::tg_ctx = &ctx;
    metal::emu::yield = &Fibers::yield;
    self_ = this;
    for (int left = n; left;) {
      const unsigned long before = metal::emu::arrivals;
      const int left_before = left;
      for (int k = 0; k < n; ++k) {
        const int i = descending ? n - 1 - k : k;
        Fiber &f = fibers_[size_t(i)];
        if (f.done) {
          continue;
        }
        current_ = i;
        metal::emu::tl_simdgroup = metal::uint(i / metal::emu::SIMD_WIDTH);
        metal::emu::tl_lane = metal::uint(i % metal::emu::SIMD_WIDTH);
        if (swapcontext(&sched_, &f.uc) != 0) {
          die("swapcontext failed");
        }
        left -= f.done ? 1 : 0;
      }
      if (left && left == left_before && metal::emu::arrivals == before) {
        die("deadlock: " + std::to_string(left) + " threads wait at a barrier the others of their group never reach");
      }
    }
    metal::emu::yield = nullptr;
  }

 private:
  static constexpr size_t STACK = 256 * 1024;
  struct Fiber {
    ucontext_t uc{};
    std::unique_ptr<unsigned char[]> stack;
    bool done = false;
  };

  static void entry() {
    Fibers *self = self_;
    const int i = self->current_;
    self->body_(i);
    self->fibers_[size_t(i)].done = true;
  }  // returns to uc_link: the scheduler

  static void yield() {
    Fibers *self = self_;
    if (swapcontext(&self->fibers_[size_t(self->current_)].uc, &self->sched_) != 0) {
      die("swapcontext failed");
    }
  }

  static inline Fibers *self_ = nullptr;
  std::function<void(int)> body_;
  std::vector<Fiber> fibers_;
  ucontext_t sched_{};
  int current_ = 0;
};

template <class... P>
void dispatch(void (*fn)(P...), const long threads[2], const long group[2], std::vector<long> &sc,
              std::vector<std::unique_ptr<Buffer>> &bufs) {
  using Params = std::tuple<P...>;
  constexpr size_t n = sizeof...(P);
  constexpr size_t nptr = leading_pointers<P...>();
  static_assert(n >= nptr + 3, "kernel must end with (uint2 tg, uint sg, uint lane)");
  constexpr size_t nsc = n - nptr - 3;
  static_assert(std::is_same_v<std::tuple_element_t<n - 3, Params>, metal::uint2>);
  static_assert(std::is_same_v<std::tuple_element_t<n - 2, Params>, metal::uint>);
  static_assert(std::is_same_v<std::tuple_element_t<n - 1, Params>, metal::uint>);
  static_assert([]<size_t... I>(std::index_sequence<I...>) {
    return (std::is_same_v<std::tuple_element_t<nptr + I, Params>, long &> && ...);
  }(std::make_index_sequence<nsc>{}), "scalars must be `constant long&`");
  if (bufs.size() != nptr || sc.size() != nsc) {
    die("the kernel takes " + std::to_string(nptr) + " buffers and " + std::to_string(nsc) + " scalars; given " +
        std::to_string(bufs.size()) + " and " + std::to_string(sc.size()));
  }
  if (group[0] <= 0 || group[1] <= 0 || group[0] * group[1] > 1024 || (group[0] * group[1]) % 32) {
    die("threadgroup size must be a positive multiple of 32 threads, at most 1024");
  }
  if (group[1] != 1) {
    die("the emulation numbers simdgroups along x only (group_size[1] must be 1)");
  }
  if (threads[0] <= 0 || threads[1] <= 0 || threads[0] % group[0] || threads[1] % group[1]) {
    die("grid not a whole number of threadgroups (partial threadgroups are not emulated)");
  }
  const long tgx = threads[0] / group[0], tgy = threads[1] / group[1];
  const int nthreads = int(group[0]);
  const int nsg = nthreads / metal::emu::SIMD_WIDTH;
  metal::emu::Threadgroup ctx{};
  metal::emu::Barrier all(nthreads);  // threadgroup_barrier
  ctx.all = &all;
  std::vector<std::unique_ptr<metal::emu::Barrier>> bars;
  for (int s = 0; s < nsg; ++s) {
    bars.push_back(std::make_unique<metal::emu::Barrier>(metal::emu::SIMD_WIDTH));
    ctx.bars[s] = bars.back().get();
  }
  metal::uint2 tg{};
  Fibers fibers(nthreads, [&](int tid) {
    const metal::uint sg = metal::uint(tid / metal::emu::SIMD_WIDTH), lane = metal::uint(tid % metal::emu::SIMD_WIDTH);
    [&]<size_t... I>(std::index_sequence<I...>) {
      fn(argument<I, std::tuple_element_t<I, Params>, nptr, nsc>(bufs, sc, tg, sg, lane)...);
    }(std::make_index_sequence<n>{});
  });
  // Threadgroups one after another (a loop over y then x); each one's threads resumed in ascending order, and in
  // descending order in every other threadgroup, so that a read of another thread's threadgroup memory without the
  // barrier before it sees the write missing whichever side of it the writer is.
  for (long g = 0; g < tgx * tgy; ++g) {
    tg = metal::uint2{metal::uint(g % tgx), metal::uint(g / tgx)};
    fibers.run(ctx, g % 2 == 1);
  }
}

void read_exact(std::FILE *f, void *dst, size_t n, const char *what) {
  if (n && std::fread(dst, 1, n, f) != n) {
    die(std::string("short input reading ") + what);
  }
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 3) {
    die("usage: driver IN OUT");
  }
  std::FILE *f = std::fopen(argv[1], "rb");
  if (!f) {
    die(std::string("cannot open ") + argv[1]);
  }
  char magic[8], name[65] = {};
  long threads[2], group[2], nbuf, nsc;
  read_exact(f, magic, 8, "magic");
  if (std::memcmp(magic, "MPSBEMU2", 8) != 0) {
    die("bad magic");
  }
  read_exact(f, name, 64, "name");
  read_exact(f, threads, sizeof threads, "threads");
  read_exact(f, group, sizeof group, "group");
  read_exact(f, &nbuf, sizeof nbuf, "nbuf");
  read_exact(f, &nsc, sizeof nsc, "nscalar");
  if (nbuf < 0 || nbuf > 31 || nsc < 0 || nsc > 31) {
    die("bad buffer or scalar count");
  }
  std::vector<long> sizes(nbuf), sc(nsc);
  read_exact(f, sizes.data(), sizeof(long) * nbuf, "sizes");
  read_exact(f, sc.data(), sizeof(long) * nsc, "scalars");
  std::vector<std::unique_ptr<Buffer>> bufs;
  for (long i = 0; i < nbuf; ++i) {
    if (sizes[i] < 0) {
      die("negative buffer size");
    }
    bufs.push_back(std::make_unique<Buffer>(size_t(sizes[i])));
    read_exact(f, bufs.back()->p, bufs.back()->n, "a buffer");
  }
  std::fclose(f);

  const std::string k(name);
#if __has_include("kernels_table.inc")
  // another source's kernels: its test writes their table beside kernels.metal, one line per kernel,
  // `if (k == "NAME") { dispatch(NAME, threads, group, sc, bufs); } else`
#include "kernels_table.inc"
#else
  if (k == "mpsb_fp8_rows_float") {
    dispatch(mpsb_fp8_rows_float, threads, group, sc, bufs);
  } else if (k == "mpsb_fp8_rows_half") {
    dispatch(mpsb_fp8_rows_half, threads, group, sc, bufs);
  } else if (k == "mpsb_fp8_rows_bfloat16") {
    dispatch(mpsb_fp8_rows_bfloat16, threads, group, sc, bufs);
  } else
#endif
  {
    die("unknown kernel " + k);
  }

  std::FILE *o = std::fopen(argv[2], "wb");
  if (!o) {
    die(std::string("cannot write ") + argv[2]);
  }
  for (auto &b : bufs) {
    if (b->n && std::fwrite(b->p, 1, b->n, o) != b->n) {
      die(std::string("cannot write ") + argv[2]);
    }
  }
  if (std::fclose(o) != 0) {
    die(std::string("cannot write ") + argv[2]);
  }
  return 0;
}
