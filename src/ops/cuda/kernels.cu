// CUDA kernels behind statecut's custom ops, launched from the Rust modules beside this file;
// the CPU halves of the same ops live in src/ops and define the semantics. build.rs compiles
// this file with `--features cuda`: one translation unit, so one module holds every kernel.
#include "adamw.cu"
#include "conv.cu"
#include "norm.cu"
#include "distill.cu"
#include "recurrence.cu"
#include "decode.cu"
#include "mlp.cu"
#include "prep.cu"
#include "chunk_layout.cu"
#include "chunk_walk.cu"
#include "chunk_intra.cu"
#include "chunk_out.cu"
#include "chunk_tc.cu"
#include "chunk_fused.cu"
