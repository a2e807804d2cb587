// The GPU's recurrences without gradients run on the host (emulation.h), against a float64
// sequential reference on the same inputs: the tiled sequential kernel of
// src/ops/cuda/recurrence.cu in each block shape (8 or 4 warps, one or two state columns a
// thread) at several key widths, with no decay, a decay per step and one per key channel, both
// rules; and the chunked form of src/ops/cuda/chunk_fused.cu in each instance, at key widths it
// pads, lengths that end mid-chunk and value widths that end mid-tile, with no decay and one per
// step. Prints one line per case, `<case> <max |got − want| / max |want|>` for the outputs and
// the final state, and exits non-zero naming a case that is off.
#include "emulation.h"
#include "../../src/ops/cuda/recurrence.cu"
#include "../../src/ops/cuda/chunk_fused.cu"

#include <cstdio>
#include <random>
#include <string>

// The kernel's staged steps: blocks run one after another, so one array serves them all.
alignas(16) float stage[65536];
// The chunked form's, and that of the chunk kernels its file includes.
alignas(16) float fsm[65536], osm[65536], ism[65536], wsm[65536];

namespace {
using Buf = std::vector<float>;
std::mt19937 rng(5);
int failures = 0;

Buf uniform(size_t len, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  Buf x(len);
  for (auto &v : x) v = d(rng);
  return x;
}

struct Case {
  int b, t, h, dk, dv, decay, delta;
};

struct Inputs {
  Buf q, k, v, beta, g, gk, s0;
};

Inputs draw(const Case &c) {
  const size_t tok = size_t(c.b) * c.t * c.h;
  Inputs x{uniform(tok * c.dk, -1, 1), uniform(tok * c.dk, -1, 1), uniform(tok * c.dv, -1, 1),
           uniform(tok, 0.1f, 0.9f),   uniform(tok, -0.5f, -0.01f), uniform(tok * c.dk, -0.3f, 0.0f),
           uniform(size_t(c.b) * c.h * c.dk * c.dv, -0.1f, 0.1f)};
  // Unit keys, as the models' L2-normed ones, keep the delta rule's state bounded.
  for (size_t i = 0; i < tok; ++i) {
    double ss = 0.0;
    for (int j = 0; j < c.dk; ++j) ss += double(x.k[i * c.dk + j]) * x.k[i * c.dk + j];
    for (int j = 0; j < c.dk; ++j) x.k[i * c.dk + j] = float(x.k[i * c.dk + j] / std::sqrt(ss));
  }
  return x;
}

// The recurrence in float64, step by step: outputs [B, T, H, dv], then the final state.
std::vector<double> reference(const Case &c, const Inputs &x, float scale) {
  std::vector<double> out(size_t(c.b) * c.t * c.h * c.dv + size_t(c.b) * c.h * c.dk * c.dv);
  double *state_out = out.data() + size_t(c.b) * c.t * c.h * c.dv;
  for (int b = 0; b < c.b; ++b)
    for (int h = 0; h < c.h; ++h) {
      const size_t bh = size_t(b) * c.h + h;
      std::vector<double> s(x.s0.begin() + bh * c.dk * c.dv, x.s0.begin() + (bh + 1) * c.dk * c.dv);
      for (int t = 0; t < c.t; ++t) {
        const size_t tok = (size_t(b) * c.t + t) * c.h + h;
        const double a = c.decay >= 1 ? std::exp(double(x.g[tok])) : 1.0;
        for (int i = 0; i < c.dk; ++i) {
          const double e = c.decay == 2 ? a * std::exp(double(x.gk[tok * c.dk + i])) : a;
          for (int j = 0; j < c.dv; ++j) s[i * c.dv + j] *= e;
        }
        for (int j = 0; j < c.dv; ++j) {
          double pred = 0.0;
          for (int i = 0; i < c.dk; ++i) pred += s[i * c.dv + j] * x.k[tok * c.dk + i];
          const double v = x.v[tok * c.dv + j];
          const double u = c.delta ? x.beta[tok] * (v - pred) : x.beta[tok] * v;
          double o = 0.0;
          for (int i = 0; i < c.dk; ++i) {
            s[i * c.dv + j] += x.k[tok * c.dk + i] * u;
            o += s[i * c.dv + j] * x.q[tok * c.dk + i];
          }
          out[tok * c.dv + j] = scale * o;
        }
      }
      std::copy(s.begin(), s.end(), state_out + bh * c.dk * c.dv);
    }
  return out;
}

void check(const std::string &what, const Buf &got, const std::vector<double> &want, size_t from, size_t to) {
  double err = 0.0, mag = 1e-30;
  for (size_t i = from; i < to; ++i) {
    err = std::max(err, std::abs(double(got[i]) - want[i]));
    mag = std::max(mag, std::abs(want[i]));
  }
  const double rel = err / mag;
  std::printf("%s %.3e\n", what.c_str(), rel);
  if (!(rel <= 1e-5)) {
    std::fprintf(stderr, "%s: off by %.3e\n", what.c_str(), rel);
    failures++;
  }
}

// One launch of recurrence_tiled<ROWS, R, DECAY, COLS> as recurrence.rs makes it: `warps` warps
// a block, `tc` steps staged at a time (a few, so that the two buffers take turns).
template <int ROWS, int R, int DECAY, int COLS> void run(const Case &c, int warps, int tc) {
  const Inputs x = draw(c);
  const float scale = 0.37f;
  const int cols = warps * (32 / R) * COLS;
  const size_t n_o = size_t(c.b) * c.t * c.h * c.dv;
  Buf out(n_o + size_t(c.b) * c.h * c.dk * c.dv, NAN);
  const int step = (2 * c.dk + (DECAY == 2 ? c.dk : 0) + cols + 2 + 3) / 4 * 4;
  if (2 * tc * step > int(sizeof(stage) / 4)) std::abort();
  emu::launch(dim3{unsigned((c.dv + cols - 1) / cols), unsigned(c.b * c.h), 1}, dim3{unsigned(32 * warps), 1, 1},
              [&] {
                recurrence_tiled<ROWS, R, DECAY, COLS>(x.q.data(), x.k.data(), x.v.data(), x.beta.data(), x.g.data(),
                                                       x.gk.data(), x.s0.data(), out.data(), out.data() + n_o, c.b,
                                                       c.t, c.h, c.dv, c.delta, scale, tc);
              });
  const auto want = reference(c, x, scale);
  const std::string what = "t" + std::to_string(ROWS) + "_" + std::to_string(R) + "_" + std::to_string(DECAY) +
                           " cols " + std::to_string(COLS) + " warps " + std::to_string(warps) + " dk " +
                           std::to_string(c.dk) + " dv " + std::to_string(c.dv) + " T " + std::to_string(c.t) +
                           (c.delta ? " delta" : " plain");
  check(what + " outputs", out, want, 0, n_o);
  check(what + " state", out, want, n_o, out.size());
}

// One launch of chunk_fused_fwd<DK, C> as recurrence.rs makes it, for keys dk ≤ DK wide; with
// `in_place` the final state goes over s0.
template <int DK, int C> void run_chunks(const Case &c, bool in_place) {
  const Inputs x = draw(c);
  const float scale = 0.37f;
  const size_t n_o = size_t(c.b) * c.t * c.h * c.dv, n_s = size_t(c.b) * c.h * c.dk * c.dv;
  Buf out(n_o + n_s, NAN), s0 = x.s0;
  if (ChunkFused<DK, C>::floats > int(sizeof(fsm) / 4)) std::abort();
  float *state = in_place ? s0.data() : out.data() + n_o;
  emu::launch(dim3{unsigned((c.dv + CF_TV - 1) / CF_TV), unsigned(c.b * c.h), 1}, dim3{256, 1, 1}, [&] {
    chunk_fused_fwd<DK, C>(x.q.data(), x.k.data(), x.v.data(), x.beta.data(), x.g.data(), s0.data(), out.data(),
                           state, c.t, c.h, c.dk, c.dv, c.decay, c.delta, scale);
  });
  if (in_place) std::copy(s0.begin(), s0.end(), out.begin() + n_o);
  const auto want = reference(c, x, scale);
  const std::string what = "chunks" + std::to_string(DK) + " dk " + std::to_string(c.dk) + " dv " +
                           std::to_string(c.dv) + " T " + std::to_string(c.t) + " decay " +
                           std::to_string(c.decay) + (c.delta ? " delta" : " plain") + (in_place ? " in place" : "");
  check(what + " outputs", out, want, 0, n_o);
  check(what + " state", out, want, n_o, out.size());
}

// Both rules, no decay and one per step.
template <int DK, int C> void chunk_forms(int dk, int dv, int t, bool in_place = false) {
  for (int decay = 0; decay < 2; ++decay)
    for (int delta = 0; delta < 2; ++delta) run_chunks<DK, C>(Case{2, t, 2, dk, dv, decay, delta}, in_place);
}

template <int ROWS, int R, int DECAY> void forms(int dv, int t) {
  for (int delta = 0; delta < 2; ++delta) {
    const Case c{2, t, 2, ROWS * R, dv, DECAY, delta};
    for (int warps : {8, 4}) {
      run<ROWS, R, DECAY, 1>(c, warps, 5);
      run<ROWS, R, DECAY, 2>(c, warps, 5);
    }
  }
}

template <int ROWS, int R> void decays(int dv, int t) {
  forms<ROWS, R, 0>(dv, t);
  forms<ROWS, R, 1>(dv, t);
  forms<ROWS, R, 2>(dv, t);
}
}  // namespace

int main() {
  // dk 128 (four threads a column of 32 rows) with dv 80: the last block's columns partly past
  // dv in every form; dk 64 (two threads); dk 96 (24 rows); dk 32 over 16 rows and two threads,
  // dv 40; dk 256 (eight threads) with one step, the shortest sequence.
  decays<32, 4>(80, 13);
  decays<32, 2>(128, 11);
  decays<24, 4>(72, 9);
  decays<16, 2>(40, 12);
  decays<32, 8>(48, 1);
  // The chunked form (chunks of CF_C = 32 tokens): dk 128 over four chunks and a part (T 150),
  // dv 80 (the second column tile mostly past dv); dk 64 with the state in place; dk 48 padded to
  // 64, one step; dk 96 padded to 128 over exactly two chunks; dk 30 (rows not a multiple of
  // four: staged by single floats) padded to 32, one chunk and a step; dk 256 with dv 48.
  chunk_forms<128, CF_C>(128, 80, 150);
  chunk_forms<64, CF_C>(64, 64, 70, true);
  chunk_forms<64, CF_C>(48, 40, 1);
  chunk_forms<128, CF_C>(96, 64, 64);
  chunk_forms<32, CF_C>(30, 36, 33);
  chunk_forms<256, CF_C>(256, 48, 45);
  return failures ? 1 : 0;
}
