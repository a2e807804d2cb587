// The chunk kernels of src/ops/cuda run on the host (emulation.h): each tensor-core (`_tc`)
// kernel against its float32 (`_f32`) twin on the same random inputs, for the shapes given on
// the command line. Prints one line per output: `<kernel> <output> <max |tc − f32| / max |f32|>`.
// With `--dump DIR` it also writes to DIR, as raw float32, every `_tc` output (`<kernel>.<output>`,
// for comparing builds), its `_f32` twin (`<kernel>.<output>.f32`) and the inputs (`in.<name>`),
// from which the crate's tests compute the same outputs with the CPU ops.
//
//   chunk_kernels N BH C DK DV [--dump DIR]
#include "emulation.h"
#include "../../src/ops/cuda/chunk_tc.cu"

#include <cstdio>
#include <random>
#include <string>

// Shared memory of every kernel: blocks run one after another, so one array each suffices.
float osm[65536], ism[65536], wsm[65536];

namespace {
using Buf = std::vector<float>;

struct Shape {
  int n, bh, c, dk, dv;
  long long blocks() const { return (long long)n * bh; }
};

std::mt19937 rng(7);
Buf uniform(size_t len, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  Buf x(len);
  for (auto &v : x) v = d(rng);
  return x;
}
Buf normal(size_t len, float sd) {
  std::normal_distribution<float> d(0.0f, sd);
  Buf x(len);
  for (auto &v : x) v = d(rng);
  return x;
}
// Per-token log decays γ, cumulative within each chunk of c (negative, falling).
Buf gammas(const Shape &s) {
  Buf g = uniform(s.blocks() * s.c, -0.2f, -0.01f);
  for (long long b = 0; b < s.blocks(); ++b)
    for (int t = 1; t < s.c; ++t) g[b * s.c + t] += g[b * s.c + t - 1];
  return g;
}

std::string dump_dir;
// One buffer as raw float32 in the dump directory, if there is one.
void emit(const std::string &name, const Buf &x) {
  if (dump_dir.empty()) return;
  FILE *f = std::fopen((dump_dir + "/" + name).c_str(), "wb");
  std::fwrite(x.data(), 4, x.size(), f);
  std::fclose(f);
}
void report(const char *kernel, const char *what, const Buf &tc, const Buf &f32) {
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < tc.size(); ++i) {
    diff = std::max(diff, (double)std::fabs(tc[i] - f32[i]));
    scale = std::max(scale, (double)std::fabs(f32[i]));
    if (!std::isfinite(tc[i])) diff = INFINITY;
  }
  std::printf("%s %s %.3e\n", kernel, what, scale > 0 ? diff / scale : diff);
  emit(std::string(kernel) + "." + what, tc);
  emit(std::string(kernel) + "." + what + ".f32", f32);
}
Buf part(const Buf &x, size_t from, size_t len) { return Buf(x.begin() + from, x.begin() + from + len); }

const dim3 THREADS{256, 1, 1};

void intra(const Shape &s) {
  const long long bl = s.blocks();
  const Buf k = normal(bl * s.c * s.dk, 1.0f / std::sqrt((float)s.dk)), v = normal(bl * s.c * s.dv, 1.0f);
  Buf scal = uniform(bl * s.c, 0.05f, 0.95f);
  const Buf g = gammas(s);
  scal.insert(scal.end(), g.begin(), g.end());
  emit("in.intra.k", k);
  emit("in.intra.v", v);
  emit("in.intra.scal", scal);
  const size_t lw = bl * s.c * s.dv, lk = bl * s.c * s.dk;
  Buf fw[2];
  for (int tc = 0; tc < 2; ++tc) {
    Buf out(lw + lk, NAN);
    emu::launch(dim3{unsigned(bl), 1, 1}, THREADS, [&] {
      (tc ? chunk_intra_fwd_tc : chunk_intra_fwd_f32)(k.data(), v.data(), scal.data(), out.data(),
                                                      out.data() + lw, bl, s.c, s.dk, s.dv);
    });
    fw[tc] = out;
  }
  report("chunk_intra_fwd", "w", part(fw[1], 0, lw), part(fw[0], 0, lw));
  report("chunk_intra_fwd", "kc", part(fw[1], lw, lk), part(fw[0], lw, lk));

  const Buf gw = normal(lw, 1.0f), gkc = normal(lk, 1.0f);
  emit("in.intra.gw", gw);
  emit("in.intra.gkc", gkc);
  const size_t n = bl * s.c * (s.dk + s.dv + 2);
  Buf bw[2];
  for (int tc = 0; tc < 2; ++tc) {
    Buf out(n, NAN);
    emu::launch(dim3{unsigned(bl), 1, 1}, THREADS, [&] {
      (tc ? chunk_intra_bwd_tc : chunk_intra_bwd_f32)(k.data(), v.data(), scal.data(), gw.data(), gkc.data(),
                                                      out.data(), bl, s.c, s.dk, s.dv, -1.0f);
    });
    bw[tc] = out;
  }
  report("chunk_intra_bwd", "dk", part(bw[1], 0, lk), part(bw[0], 0, lk));
  report("chunk_intra_bwd", "dv", part(bw[1], lk, lw), part(bw[0], lk, lw));
  report("chunk_intra_bwd", "dbeta", part(bw[1], lk + lw, bl * s.c), part(bw[0], lk + lw, bl * s.c));
  report("chunk_intra_bwd", "dgamma", part(bw[1], lk + lw + bl * s.c, bl * s.c),
         part(bw[0], lk + lw + bl * s.c, bl * s.c));
}

void out(const Shape &s) {
  const long long bl = s.blocks();
  const size_t lu = bl * s.c * s.dv, ls = (size_t)(s.n + 1) * s.bh * s.dk * s.dv, lq = bl * s.c * 2 * s.dk;
  const Buf qk = normal(lq, 1.0f / std::sqrt((float)s.dk)), walked = normal(lu + ls, 1.0f), g = gammas(s);
  const float scale = 1.0f / std::sqrt((float)s.dk);
  emit("in.out.qk", qk);
  emit("in.out.walked", walked);
  emit("in.out.gamma", g);
  Buf o[2];
  for (int tc = 0; tc < 2; ++tc) {
    Buf x(lu, NAN);
    emu::launch(dim3{unsigned(bl), 1, 1}, THREADS, [&] {
      (tc ? chunk_out_fwd_tc : chunk_out_fwd_f32)(qk.data(), walked.data(), g.data(), x.data(), bl, s.c, s.dk, s.dv,
                                                  scale);
    });
    o[tc] = x;
  }
  report("chunk_out_fwd", "o", o[1], o[0]);

  const Buf grad = normal(lu, 1.0f);
  emit("in.out.grad", grad);
  Buf dqk[2], rest[2];
  for (int tc = 0; tc < 2; ++tc) {
    Buf d(lq, NAN), r(lu + ls + bl * s.c, 0.0f);
    emu::launch(dim3{unsigned(bl), 1, 1}, THREADS, [&] {
      (tc ? chunk_out_bwd_tc : chunk_out_bwd_f32)(qk.data(), walked.data(), g.data(), grad.data(), d.data(), r.data(),
                                                  bl, (long long)(lu + ls), s.c, s.dk, s.dv, scale);
    });
    dqk[tc] = d;
    rest[tc] = r;
  }
  report("chunk_out_bwd", "dqk", dqk[1], dqk[0]);
  report("chunk_out_bwd", "du", part(rest[1], 0, lu), part(rest[0], 0, lu));
  report("chunk_out_bwd", "dstates", part(rest[1], lu, ls), part(rest[0], lu, ls));
  report("chunk_out_bwd", "dgamma", part(rest[1], lu + ls, bl * s.c), part(rest[0], lu + ls, bl * s.c));
}

// The tensor-core walk's forms by the widest keys they take (chunk.rs launches the narrowest
// that holds dk), their names' suffixes, and the kernels.
struct WalkForm {
  int max_dk;
  const char *suffix;
  decltype(&chunk_walk_fwd_tc) fwd;
  decltype(&chunk_walk_bwd_tc) bwd;
};
const WalkForm WALK_FORMS[] = {{64, "_k64", chunk_walk_fwd_tc_k64, chunk_walk_bwd_tc_k64},
                               {128, "_k128", chunk_walk_fwd_tc_k128, chunk_walk_bwd_tc_k128},
                               {256, "", chunk_walk_fwd_tc, chunk_walk_bwd_tc}};

// Every tensor-core form that takes dk, against the float32 form: the one chunk.rs launches
// reported as `chunk_walk_*`, the wider ones as `chunk_walk_*_tc<suffix>`; for the plain rule
// (`delta` 0: no Kc) with `_plain` after the name, and nothing dumped.
void walk(const Shape &s, int delta) {
  const std::string rule = delta ? "" : "_plain";
  const std::string dump = dump_dir;
  if (!delta) dump_dir.clear();
  const long long bl = s.blocks();
  const size_t lu = bl * s.c * s.dv, lk = bl * s.c * s.dk, ls = (size_t)s.bh * s.dk * s.dv;
  const Buf w = normal(lu, 1.0f), kc = normal(lk, 0.3f), k = normal(lk, 1.0f / std::sqrt((float)s.dk));
  const Buf e = uniform(bl * s.c, 0.3f, 1.0f), s0 = normal(ls, 1.0f), a = uniform(bl * s.dk, 0.5f, 1.0f);
  for (auto [name, x] : {std::pair{"w", &w}, {"kc", &kc}, {"k", &k}, {"e", &e}, {"s0", &s0}, {"a", &a}})
    emit(std::string("in.walk.") + name, *x);
  const dim3 grid{unsigned((s.dv + WALK_TV - 1) / WALK_TV), unsigned(s.bh), 1};
  const Buf gu = normal(lu, 1.0f), gs = normal((s.n + 1) * ls, 1.0f);
  emit("in.walk.gu", gu);
  emit("in.walk.gs", gs);
  const int tiles = (s.dv + WALK_TV - 1) / WALK_TV;

  // The float32 form.
  Buf u(lu, NAN), st((s.n + 1) * ls, NAN), dw(lu, NAN), gend(s.n * ls, NAN), ds0(ls, NAN);
  emu::launch(grid, THREADS, [&] {
    chunk_walk_fwd_f32(w.data(), kc.data(), k.data(), e.data(), s0.data(), a.data(), u.data(), st.data(), s.n, s.bh,
                       s.c, s.dk, s.dv, delta);
  });
  emu::launch(grid, THREADS, [&] {
    chunk_walk_bwd_f32(kc.data(), k.data(), e.data(), a.data(), gu.data(), gs.data(), dw.data(), gend.data(),
                       ds0.data(), s.n, s.bh, s.c, s.dk, s.dv, delta);
  });
  // The tensor-core form's partial sums over each 32-column tile, from the float32 form's
  // outputs: da_i[r] = Σ_j S_i[r][j] G_{i+1}[r][j], de_i[t] = Σ_j U_i[t][j] (K_i G_{i+1})[t][j].
  Buf rda(tiles * bl * s.dk), rde(tiles * bl * s.c);
  for (int tile = 0; tile < tiles; ++tile)
    for (long long b = 0; b < bl; ++b) {
      const float *S = st.data() + b * s.dk * s.dv, *G = gend.data() + b * s.dk * s.dv;
      const float *U = u.data() + b * s.c * s.dv, *K = k.data() + b * s.c * s.dk;
      for (int r = 0; r < s.dk; ++r) {
        double x = 0.0;
        for (int j = tile * WALK_TV; j < std::min(s.dv, (tile + 1) * WALK_TV); ++j)
          x += (double)S[r * s.dv + j] * G[r * s.dv + j];
        rda[(tile * bl + b) * s.dk + r] = (float)x;
      }
      for (int t = 0; t < s.c; ++t) {
        double x = 0.0;
        for (int j = tile * WALK_TV; j < std::min(s.dv, (tile + 1) * WALK_TV); ++j) {
          double kg = 0.0;
          for (int r = 0; r < s.dk; ++r) kg += (double)K[t * s.dk + r] * G[r * s.dv + j];
          x += U[t * s.dv + j] * kg;
        }
        rde[(tile * bl + b) * s.c + t] = (float)x;
      }
    }

  bool launched = true;
  for (const WalkForm &f : WALK_FORMS) {
    if (s.dk > f.max_dk) continue;
    const std::string fwd = (launched ? "chunk_walk_fwd" : std::string("chunk_walk_fwd_tc") + f.suffix) + rule;
    const std::string bwd = (launched ? "chunk_walk_bwd" : std::string("chunk_walk_bwd_tc") + f.suffix) + rule;
    launched = false;
    Buf uo(lu, NAN), so((s.n + 1) * ls, NAN);
    emu::launch(grid, THREADS, [&] {
      f.fwd(w.data(), kc.data(), k.data(), e.data(), s0.data(), a.data(), uo.data(), so.data(), s.n, s.bh, s.c, s.dk,
            s.dv, delta);
    });
    report(fwd.c_str(), "u", uo, u);
    report(fwd.c_str(), "states", so, st);
    Buf x(lu, NAN), y(s.n * ls, NAN), z(ls, NAN), da(tiles * bl * s.dk, NAN), de(tiles * bl * s.c, NAN);
    emu::launch(grid, THREADS, [&] {
      f.bwd(kc.data(), k.data(), e.data(), a.data(), gu.data(), gs.data(), x.data(), y.data(), z.data(), s.n, s.bh,
            s.c, s.dk, s.dv, delta, u.data(), st.data(), da.data(), de.data());
    });
    report(bwd.c_str(), "dw", x, dw);
    report(bwd.c_str(), "gend", y, gend);
    report(bwd.c_str(), "ds0", z, ds0);
    report(bwd.c_str(), "da_tiles", da, rda);
    report(bwd.c_str(), "de_tiles", de, rde);
  }
  dump_dir = dump;
}
}  // namespace

int main(int argc, char **argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: chunk_kernels N BH C DK DV [--dump DIR]\n");
    return 2;
  }
  const Shape s{std::atoi(argv[1]), std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5])};
  if (argc == 8 && std::string(argv[6]) == "--dump") dump_dir = argv[7];
  intra(s);
  out(s);
  walk(s, 1);
  walk(s, 0);
  return 0;
}
